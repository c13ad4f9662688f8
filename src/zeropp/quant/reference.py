"""Torch reference implementation of ``zeropp.quant.QuantKernels`` (any device; the rounding rule of ``zeropp.quant``).

``row_order`` and ``out`` go through copies here, which a fused kernel avoids.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zeropp.quant import Quantized, QuantSpec, pack_int4, unpack_int4


def quantize(
    x: torch.Tensor, spec: QuantSpec, *, row_order: torch.Tensor | None = None, out: Quantized | None = None
) -> Quantized:
    """``QuantKernels.quantize``."""
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
    data = q if spec.bits == 8 else pack_int4(q)
    result = Quantized(data.reshape(*lead, spec.row_bytes(n)), scales.reshape(*lead, blocks), n, spec)
    return result if out is None else out.copy_(result)


def dequantize(q: Quantized, dtype: torch.dtype, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``QuantKernels.dequantize``."""
    values = _dequantize_fp32(q).to(dtype)
    return values if out is None else out.copy_(values)


def dequantize_reduce(
    q: Quantized, dtype: torch.dtype, *, divisor: int = 1, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``QuantKernels.dequantize_reduce``."""
    total = _sum_sources(q)
    if divisor != 1:
        total = total / torch.full_like(total, divisor)
    values = total.to(dtype)
    return values if out is None else out.copy_(values)


def dequantize_reduce_quantize(q: Quantized, spec: QuantSpec) -> Quantized:
    """``QuantKernels.dequantize_reduce_quantize``: the fp32 sum goes through memory."""
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
    codes = codes if spec.bits == 8 else unpack_int4(codes, n)
    block, blocks = spec.block(n), spec.blocks(n)
    padded = F.pad(codes.float(), (0, blocks * block - n)).view(-1, blocks, block)
    values = (padded * q.scales.reshape(-1, blocks, 1)).view(-1, blocks * block)[:, :n]
    return values.reshape(*lead, n)
