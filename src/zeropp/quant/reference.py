"""Torch reference implementation of ``zeropp.quant.QuantKernels`` (any device; the rounding rule of ``zeropp.quant``).

Few passes over memory: a row is viewed as its full blocks plus a shorter tail (no padded copy);
each block's ``max |x|`` is ``max(max x, -min x)`` (two vectorized reads, where ``|x|`` was a
written pass; ``aminmax`` is slower); the codes (divided, rounded, clamped and
masked where that can change them) live in one fp32 buffer; int4 is packed
and unpacked through int16 words (contiguous passes, no strided byte ones); dequantization
widens the int8 codes into its output and multiplies them by the scales there.
``row_order`` permutes the rows of the (small) quantized result, not of the input. ``out`` of
``quantize`` goes through a copy, which a fused kernel avoids. Temporaries that do not outlive a
call live in :mod:`zeropp.quant.scratch` (on the CPU, reused from call to call), five slots shared
by temporaries never alive at once: ``values`` (fp32: the codes; dequantized sources;
values cast afterwards), ``sum`` (the fp32 sum of sources), ``words`` (int4 packing's pairs and
words), ``shifted`` (their shifted copy), ``data`` (codes before ``row_order``). What a call returns
is always its own memory.
"""

from __future__ import annotations

import torch

from zeropp.quant import scratch
from zeropp.quant.spec import Quantized, QuantSpec

_HIGH_NIBBLES = 0xF0F0 - 0x10000  # the mask 0xF0F0 as an int16 value


def quantize(
    x: torch.Tensor, spec: QuantSpec, *, row_order: torch.Tensor | None = None, out: Quantized | None = None
) -> Quantized:
    """``QuantKernels.quantize``."""
    n = x.shape[-1]
    rows = x.reshape(-1, n).float()
    lead = (row_order.numel(),) if row_order is not None else tuple(x.shape[:-1])
    block, blocks = spec.block(n), spec.blocks(n)
    codes = scratch.empty("values", tuple(rows.shape), torch.float32, x.device)
    code_blocks, value_blocks = _block_views(codes, block), _block_views(rows, block)
    scales = torch.empty(rows.shape[0], blocks, dtype=torch.float32, device=x.device)
    for values, columns in value_blocks:  # max |x| = max(max x, -min x): two reads, no |x| written
        torch.maximum(torch.amax(values, dim=-1), torch.amin(values, dim=-1).neg_(), out=scales[:, columns])
    scales.abs_()  # +0.0, never -0.0, for a block of zeros, as |x| gives
    scales = scales / torch.full_like(scales, spec.qmax)  # a true division on CUDA too (not x * (1/q))
    usable = (scales > 0) & torch.isfinite(scales)
    divisor = torch.where(usable, scales, torch.ones_like(scales))
    for (values, columns), (into, _) in zip(value_blocks, code_blocks, strict=True):
        torch.div(values, divisor[:, columns, None], out=into)
    codes.round_()
    # On the CPU the check is cheaper than the passes it saves: with every scale usable and normal,
    # |x / scale| <= max|x| / scale rounds to at most qmax (two roundings off by 2^-24 each), so the
    # clamp changes nothing and no block is masked. A subnormal scale's quotient can exceed qmax.
    if x.device.type != "cpu" or not (usable & (scales >= torch.finfo(torch.float32).tiny)).all():
        codes.clamp_(-spec.qmax, spec.qmax)
        for into, columns in code_blocks:
            into.masked_fill_(~usable[:, columns, None], 0)
    permuted = row_order is not None  # the rows in storage order are a temporary then
    data = _pack_int4(codes, permuted) if spec.bits == 4 else _as_int8(codes, permuted)
    if permuted:
        data, scales = data.index_select(0, row_order), scales.index_select(0, row_order)
    result = Quantized(data.reshape(*lead, spec.row_bytes(n)), scales.reshape(*lead, blocks), n, spec)
    return result if out is None else out.copy_(result)


def dequantize(q: Quantized, dtype: torch.dtype, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``QuantKernels.dequantize``."""
    direct = out is not None and dtype == torch.float32 and out.dtype == dtype and out.is_contiguous()
    returned = out is None and dtype == torch.float32  # the fp32 values are the result itself
    values = _dequantize_fp32(q, out if direct else _result_or_scratch(returned, "values", _values_shape(q), q))
    if direct:
        return out
    values = values.to(dtype)
    return values if out is None else out.copy_(values)


def dequantize_reduce(
    q: Quantized, dtype: torch.dtype, *, divisor: int = 1, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``QuantKernels.dequantize_reduce``."""
    direct = out is not None and dtype == torch.float32 and out.dtype == dtype and out.is_contiguous()
    returned = out is None and dtype == torch.float32
    shape = _values_shape(q)[1:]
    total = _sum_sources(q, out.view(shape) if direct else _result_or_scratch(returned, "sum", shape, q))
    if divisor != 1:  # a one-element tensor: a true division on every device (not x * (1/divisor))
        total.div_(torch.full((1,), divisor, dtype=torch.float32, device=total.device))
    if direct:
        return out
    total = total.to(dtype)
    return total if out is None else out.copy_(total)


def dequantize_reduce_quantize(q: Quantized, spec: QuantSpec) -> Quantized:
    """``QuantKernels.dequantize_reduce_quantize``: the fp32 sum goes through (scratch) memory."""
    return quantize(_sum_sources(q, scratch.empty("sum", _values_shape(q)[1:], torch.float32, q.data.device)), spec)


def _values_shape(q: Quantized) -> tuple[int, ...]:
    return (*q.data.shape[:-1], q.n)


def _result_or_scratch(returned: bool, slot: str, shape: tuple[int, ...], q: Quantized) -> torch.Tensor:
    """fp32 memory of `shape`: fresh where it is what the call returns, else the scratch `slot`."""
    device = q.data.device
    return (
        torch.empty(shape, dtype=torch.float32, device=device)
        if returned
        else scratch.empty(slot, shape, torch.float32, device)
    )


def _sum_sources(q: Quantized, total: torch.Tensor) -> torch.Tensor:
    """``((x0 + x1) + x2) + ...`` over the sources (dimension 0) in fp32, into `total`; returns it."""
    values = _dequantize_fp32(q, scratch.empty("values", _values_shape(q), torch.float32, q.data.device))
    if values.shape[0] == 1:
        return total.copy_(values[0])
    torch.add(values[0], values[1], out=total)
    for source in range(2, values.shape[0]):
        total += values[source]
    return total


def _dequantize_fp32(q: Quantized, values: torch.Tensor) -> torch.Tensor:
    """fp32 values of `q`, shape [..., n], written into `values` (contiguous fp32); returns it."""
    spec, n = q.spec, q.n
    codes = q.data.reshape(-1, q.data.shape[-1])
    codes = codes.view(torch.int8) if spec.bits == 8 else _unpack_int4(codes, n)
    rows = values.view(codes.shape).copy_(codes)  # exact: every int8 is an fp32
    scales = q.scales.reshape(codes.shape[0], -1)
    for into, columns in _block_views(rows, spec.block(n)):  # in place: a mixed int8 * fp32 product
        into.mul_(scales[:, columns, None])  # would cast the codes into a temporary first
    return values


def _block_views(rows: torch.Tensor, block: int) -> list[tuple[torch.Tensor, slice]]:
    """Views [rows, k, b] of `rows` [rows, n]: its full blocks, then its shorter tail; each with its scales' columns."""
    n = rows.shape[-1]
    full = n // block
    views = [(rows[:, : full * block].unflatten(-1, (full, block)), slice(0, full))] if full else []
    if n % block:
        views.append((rows[:, full * block :].unsqueeze(1), slice(full, full + 1)))
    return views


def _as_int8(codes: torch.Tensor, temporary: bool) -> torch.Tensor:
    """Integral fp32 codes [rows, n] as int8: fresh, or in scratch memory where `temporary`."""
    if not temporary:
        return codes.to(torch.int8)
    return scratch.empty("data", tuple(codes.shape), torch.int8, codes.device).copy_(codes)


def _pack_int4(codes: torch.Tensor, temporary: bool) -> torch.Tensor:
    """``pack_int4`` of integral fp32 codes [rows, n] in [-8, 7]: fresh, or in scratch memory where
    `temporary`. Two int8 codes side by side are one little-endian int16 ``w`` (element 2i in the low
    byte); ``m = w & 0x0F0F`` keeps both nibbles (bits 0-3 and 8-11), and the low byte of
    ``m | (m >> 4)`` is the packed byte."""
    rows, n = codes.shape
    pairs = scratch.empty("words", (rows, n + n % 2), torch.int8, codes.device)
    pairs[:, :n] = codes
    pairs[:, n:] = 0
    words = pairs.view(torch.int16).bitwise_and_(0x0F0F)
    words |= torch.bitwise_right_shift(
        words, 4, out=scratch.empty("shifted", tuple(words.shape), torch.int16, codes.device)
    )
    if not temporary:
        return words.to(torch.uint8)
    return scratch.empty("data", tuple(words.shape), torch.uint8, codes.device).copy_(words)


def _unpack_int4(packed: torch.Tensor, n: int) -> torch.Tensor:
    """``unpack_int4`` of uint8 [rows, ceil(n / 2)]; a view [rows, n] of scratch memory. Each byte
    widened to an int16 ``w`` puts its low nibble at bits 4-7 and its high one at bits 12-15
    (``((w << 4) | (w << 8)) & 0xF0F0``); as two little-endian int8 bytes shifted right by 4, they are
    the sign-extended codes."""
    words = scratch.empty("words", tuple(packed.shape), torch.int16, packed.device).copy_(packed)
    low = torch.bitwise_left_shift(
        words, 4, out=scratch.empty("shifted", tuple(packed.shape), torch.int16, packed.device)
    )
    words.bitwise_left_shift_(8).bitwise_or_(low).bitwise_and_(_HIGH_NIBBLES)
    codes = words.view(torch.int8).view(packed.shape[0], -1)
    return codes.bitwise_right_shift_(4)[:, :n]
