"""Torch reference implementation of the quantization API (any device; the rounding rule of ``zeropp.quant``).

Every function works on rows along the last dimension. ``x`` may be a strided view whose last
dimension is contiguous; ``row_order`` lets the caller quantize rows in another order than they
are stored (qgZ's tensor-slice reordering), which a fused kernel does without a copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zeropp.quant import Quantized, QuantSpec


def quantize(
    x: torch.Tensor, spec: QuantSpec, *, row_order: torch.Tensor | None = None, out: Quantized | None = None
) -> Quantized:
    """Quantize `x` [..., n] (or, with `row_order`, the rows ``x.reshape(-1, n)[row_order]``)."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    if row_order is not None:
        rows = rows[row_order]
        lead = (row_order.numel(),)
    else:
        lead = tuple(x.shape[:-1])
    block, blocks = spec.block(n), spec.blocks(n)
    padded = F.pad(rows.float(), (0, blocks * block - n)).view(-1, blocks, block)
    absmax = padded.abs().amax(dim=-1)
    scales = absmax / torch.full_like(absmax, spec.qmax)  # a true division on CUDA too (not x * (1/q))
    usable = (scales > 0) & torch.isfinite(scales)
    divisor = torch.where(usable, scales, torch.ones_like(scales)).unsqueeze(-1)
    q = torch.round(padded / divisor).clamp_(-spec.qmax, spec.qmax)
    q = torch.where(usable.unsqueeze(-1), q, torch.zeros_like(q)).view(-1, blocks * block)[:, :n]
    q = q.to(torch.int8)
    data = q if spec.bits == 8 else _pack_int4(q)
    result = Quantized(data.reshape(*lead, spec.row_bytes(n)), scales.reshape(*lead, blocks), n, spec)
    if out is None:
        return result
    out.data.copy_(result.data)
    out.scales.copy_(result.scales)
    return out


def dequantize(q: Quantized, dtype: torch.dtype, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Values of `q` as `dtype`, shape [..., n]."""
    values = _dequantize_fp32(q).to(dtype)
    if out is None:
        return values
    return out.copy_(values)


def dequantize_reduce(
    q: Quantized, dtype: torch.dtype, *, divisor: int = 1, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``(sum over sources i of dequantize(q[i])) / divisor`` in fp32, cast to `dtype`; shape q.shape[1:] + [n]."""
    total = _sum_sources(q)
    if divisor != 1:
        total = total / torch.full_like(total, divisor)
    values = total.to(dtype)
    if out is None:
        return values
    return out.copy_(values)


def dequantize_reduce_quantize(q: Quantized, spec: QuantSpec) -> Quantized:
    """Sum of the sources' dequantized rows (fp32), quantized again with `spec` (qgZ's intra-node hop)."""
    return quantize(_sum_sources(q), spec)


def _sum_sources(q: Quantized) -> torch.Tensor:
    values = _dequantize_fp32(q)
    total = values[0].clone()
    for source in range(1, values.shape[0]):
        total += values[source]
    return total


def _dequantize_fp32(q: Quantized) -> torch.Tensor:
    spec, n = q.spec, q.n
    lead = tuple(q.data.shape[:-1])
    codes = q.data.reshape(-1, q.data.shape[-1])
    codes = codes if spec.bits == 8 else _unpack_int4(codes, n)
    block, blocks = spec.block(n), spec.blocks(n)
    padded = F.pad(codes.float(), (0, blocks * block - n)).view(-1, blocks, block)
    values = (padded * q.scales.reshape(-1, blocks, 1)).view(-1, blocks * block)[:, :n]
    return values.reshape(*lead, n)


def _pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 values in [-7, 7], [rows, n] -> uint8 [rows, ceil(n/2)], element 2i in the low nibble."""
    if q.shape[-1] % 2:
        q = F.pad(q, (0, 1))
    nibbles = (q.to(torch.int16) & 0xF).to(torch.uint8)
    return nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)


def _unpack_int4(packed: torch.Tensor, n: int) -> torch.Tensor:
    low = (packed & 0xF).to(torch.int16)
    high = (packed >> 4).to(torch.int16)
    both = torch.stack((low, high), dim=-1).view(packed.shape[0], -1)[:, :n]
    return torch.where(both >= 8, both - 16, both).to(torch.int8)
