"""Triton kernel of qgZ's error feedback (:mod:`zeropp.comm.feedback`): the residual update in one pass.

After the compensated values ``c`` are quantized, the torch path updates the residual in four passes
over memory (dequantize, subtract, scale the residual, add). This kernel reads ``c``, the codes,
their scales and the residual once and writes the residual once::

    e = beta * e + (1 - beta) * (c - code * scale)        beta = 0: e = c - code * scale

bit for bit as the torch path computes it: every product and difference is rounded once to fp32
(the kernel is built without fp fusion, and the torch path multiplies and adds in separate ops).
Blocks, int4 unpacking and the launch geometry are those of :mod:`zeropp.quant.triton.kernels`,
whose device helpers it calls, so it runs under the same CPU interpreter (``TRITON_INTERPRET=1``
before the first import).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from zeropp.quant.spec import Quantized
from zeropp.quant.triton.kernels import (
    TILE,
    Geometry,
    lane_mask,
    launch,
    program_units,
    read_codes,
    sum_sources,
    valid_lanes,
)


@triton.jit
def _residual_kernel(
    in_ptr, in_row_stride, in_source_stride, in_scales_ptr, in_scales_row_stride, in_scales_source_stride,
    c_ptr, c_row_stride, e_ptr, e_row_stride, beta, keep,
    n, block, blocks, blocks_magic, blocks_shift, units,
    BITS: tl.constexpr, MOVING: tl.constexpr, GROUP: tl.constexpr, CHUNK: tl.constexpr, FULL: tl.constexpr,
):  # fmt: skip
    """Chunk program_id(1) of GROUP units: the residual from the compensated values and their codes."""
    row, index, start, units_ok = program_units(GROUP, blocks, blocks_magic, blocks_shift, block, units)
    k = tl.program_id(1)
    first, valid = start + k * CHUNK, valid_lanes(start, units_ok, k, n, block, CHUNK)
    sent = sum_sources(
        in_ptr, row * in_row_stride, in_source_stride, in_scales_ptr, row * in_scales_row_stride + index,
        in_scales_source_stride, first, valid, 1, BITS, CHUNK, FULL,
    )  # fmt: skip
    offset = first[:, None] + tl.arange(0, CHUNK)[None, :]
    mask = lane_mask(valid, 1, CHUNK, FULL)
    dropped = tl.load(c_ptr + row[:, None] * c_row_stride + offset, mask=mask, other=0) - sent
    residual = e_ptr + row[:, None] * e_row_stride + offset
    if MOVING:
        dropped = tl.load(residual, mask=mask, other=0) * beta + dropped * keep
    tl.store(residual, dropped, mask=mask)


def update_residual(residual: torch.Tensor, compensated: torch.Tensor, quantized: Quantized, beta: float) -> None:
    """``residual`` [rows, n] (fp32, rows may be strided, last dim contiguous) from ``compensated``
    [rows, n] (fp32, contiguous) and ``quantized``, its quantization; in place."""
    rows, n = compensated.shape
    if rows == 0 or n == 0:
        return
    in_args, bits = read_codes(quantized, lead=0)
    geometry = Geometry.of(quantized.spec, rows, n, TILE)
    launch(
        _residual_kernel, (geometry.programs, geometry.chunks),
        *in_args, compensated, compensated.stride(0), residual, residual.stride(0), beta, 1 - beta,
        *geometry.scalars(), BITS=bits, MOVING=beta != 0, **geometry.constexprs(),
    )  # fmt: skip
