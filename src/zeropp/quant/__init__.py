"""Block quantization for ZeRO++: one API, a torch reference on every device, fast kernels where available.

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

Storage. int8: ``data`` is int8 with the row's shape. int4: two values per byte, element ``2i`` in
the low nibble and ``2i+1`` in the high one (two's complement nibbles), ``ceil(n / 2)`` bytes a row.
``scales`` is fp32 ``[..., blocks]``.

Reductions (the two qgZ hops) add the sources in index order, ``((x0 + x1) + x2) + ...``, in fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType
from typing import Literal

import torch

__all__ = ["QuantSpec", "Quantized", "kernels_for"]

Backend = Literal["auto", "torch", "triton"]


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


def kernels_for(device: torch.device, backend: Backend = "auto") -> ModuleType:
    """The module implementing quantize / dequantize / dequantize_reduce / dequantize_reduce_quantize.

    Each takes and returns the types above; see ``zeropp.quant.reference`` for their contracts.
    """
    from importlib.util import find_spec

    from zeropp.quant import reference

    device = torch.device(device)
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"zeropp: unknown quantization backend {backend!r} (auto, torch or triton)")
    if backend == "torch" or (backend == "auto" and (device.type != "cuda" or find_spec("triton") is None)):
        return reference
    try:
        from zeropp.quant import triton_kernels
    except ImportError as error:
        raise RuntimeError(f"zeropp: quantization backend 'triton' needs the triton package ({error})") from error
    if device.type != "cuda" and not triton_kernels.INTERPRETED:
        raise RuntimeError(
            "zeropp: Triton kernels on CPU tensors need the interpreter: set TRITON_INTERPRET=1 before "
            "zeropp.quant.triton_kernels is first imported"
        )
    return triton_kernels
