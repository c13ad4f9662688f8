"""Block quantization for ZeRO++: the format (spec, quantized tensors, int4 packing) and the kernel API every backend implements.

Layout. A tensor is quantized row by row along its last dimension (``n`` elements per row). A row
is cut into blocks of ``spec.block_size`` elements (the last block may be shorter); every block has
one fp32 scale. ``block_size=None`` gives one scale per row: the per-tensor baseline of the paper's
Fig. 2, kept for comparison only.

Rounding rule (every backend must follow it bit for bit)::

    absmax = max |x| over the block, in fp32
    scale  = absmax / qmax                       qmax = 127 (int8) or 7 (int4)
    q      = clamp(round_half_even(x / scale), -qmax, qmax)   (0 where scale is 0 or not finite)
    x'     = q * scale                           in fp32, then cast to the output dtype

A block holding an inf or a NaN gets a non-finite scale, so it dequantizes to NaN: an fp16
overflow survives quantization and the loss scaler still sees it.

Storage. int8: ``data`` is int8 with the row's shape. int4: ``data`` is uint8, two values per byte,
element ``2i`` in the low nibble and ``2i+1`` in the high one (two's complement nibbles),
``ceil(n / 2)`` bytes a row; ``pack_int4`` and ``unpack_int4`` convert, and the Triton kernels do the
same bit manipulation in place. ``scales`` is fp32 ``[..., blocks]``.

Reductions (the two qgZ hops) add the sources in index order, ``((x0 + x1) + x2) + ...``, in fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class QuantSpec:
    bits: Literal[4, 8] = 8
    block_size: int | None = 256  # elements per scale along a row; None: one scale per row

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1

    def block(self, n: int) -> int:
        """Elements per block in a row of `n` (the whole row when there are no blocks)."""
        return max(1, n) if self.block_size is None else self.block_size

    def blocks(self, n: int) -> int:
        """Scales per row of `n` elements."""
        return max(1, math.ceil(n / self.block(n)))

    def row_bytes(self, n: int) -> int:
        """Bytes of quantized data per row of `n` elements."""
        return n if self.bits == 8 else (n + 1) // 2

    @property
    def data_dtype(self) -> torch.dtype:
        return torch.int8 if self.bits == 8 else torch.uint8


@dataclass
class Quantized:
    """Quantized rows: ``data`` [..., row_bytes(n)], ``scales`` [..., blocks(n)], ``n`` values a row."""

    data: torch.Tensor
    scales: torch.Tensor
    n: int
    spec: QuantSpec

    def __getitem__(self, index) -> Quantized:
        return Quantized(self.data[index], self.scales[index], self.n, self.spec)

    def reshape(self, *lead: int) -> Quantized:
        """The same rows under other leading dimensions."""
        data = self.data.reshape(*lead, self.data.shape[-1])
        return Quantized(data, self.scales.reshape(*lead, self.scales.shape[-1]), self.n, self.spec)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scales.numel() * self.scales.element_size()

    def copy_(self, src: Quantized) -> Quantized:
        """Copy `src`'s data and scales into this one's; returns self."""
        self.data.copy_(src.data)
        self.scales.copy_(src.scales)
        return self


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes in [-8, 7], [..., n] -> uint8 [..., ceil(n / 2)] in the int4 storage layout above."""
    nibbles = F.pad(codes, (0, codes.shape[-1] % 2)).view(torch.uint8) & 0xF
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The int8 codes [..., n] of uint8 bytes [..., ceil(n / 2)] in the int4 storage layout above."""
    nibbles = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)[..., :n]
    return (nibbles ^ 8).view(torch.int8) - 8


@runtime_checkable
class QuantKernels(Protocol):
    """The quantization API, as ``kernels_for`` returns it: a module with these four functions.

    Every backend follows the rounding rule and storage above bit for bit, and works on rows along
    the last dimension; ``out`` arguments are written and returned (copied into where a backend
    cannot write them in place).
    """

    def quantize(
        self, x: torch.Tensor, spec: QuantSpec, *, row_order: torch.Tensor | None = None, out: Quantized | None = None
    ) -> Quantized:
        """Quantize `x` [..., n] (or, with `row_order`, the rows ``x.reshape(-1, n)[row_order]``).

        `x` may be a strided view whose last dimension is contiguous; `row_order` quantizes rows in
        another order than they are stored (qgZ's tensor-slice reordering).
        """

    def dequantize(self, q: Quantized, dtype: torch.dtype, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Values of `q` as `dtype`, shape [..., n]."""

    def dequantize_reduce(
        self, q: Quantized, dtype: torch.dtype, *, divisor: int = 1, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``(sum over sources i of dequantize(q[i])) / divisor`` in fp32, cast to `dtype`; shape q.shape[1:] + [n]."""

    def dequantize_reduce_quantize(self, q: Quantized, spec: QuantSpec) -> Quantized:
        """Sum of the sources' dequantized rows (fp32), quantized again with `spec` (qgZ's intra-node hop)."""
