"""Triton kernel of qgZ's random Hadamard rotation (:mod:`zeropp.quant.hadamard`), bit for bit.

A program holds ``GROUP`` blocks of b elements in registers and does the reference's operations in
its order: the sign flip, the butterflies at strides 1, 2, ..., b/2 (each stage views a block as
[b / (2 stride), 2, stride] and splits out the pairs), the multiplication by fp32 ``b ** -0.5``;
the inverse flips the signs last. Each sum, difference and product rounds once to fp32, as the
torch ops do (kernels are built without fp fusion; nothing here could fuse anyway). The input is
first copied to fp32 in torch, and the full blocks are rotated in place in that copy.

Kernels are decorated at import: as :mod:`zeropp.quant.triton.kernels`, under the CPU interpreter
``TRITON_INTERPRET=1`` must be set before this module is first imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from zeropp.quant import hadamard
from zeropp.quant.triton.kernels import TILE, launch

__all__ = ["rotate"]


@triton.jit
def _rotate_kernel(
    x_ptr, row_stride, signs_ptr, scale, blocks_per_row, units,
    BLOCK: tl.constexpr, STAGES: tl.constexpr, GROUP: tl.constexpr, INVERSE: tl.constexpr,
):  # fmt: skip
    """Blocks program_id(0) * GROUP ... of GROUP, unit u = row * blocks_per_row + block index."""
    unit = tl.program_id(0) * GROUP + tl.arange(0, GROUP)
    row, index = unit // blocks_per_row, unit % blocks_per_row
    offset = (row * row_stride + index * BLOCK)[:, None] + tl.arange(0, BLOCK)[None, :]
    mask = (unit < units)[:, None]
    x = tl.load(x_ptr + offset, mask=mask, other=0)
    signs = tl.load(signs_ptr + tl.arange(0, BLOCK))[None, :]
    if not INVERSE:
        x = x * signs
    for stage in tl.static_range(STAGES):  # stride 1 << stage, inline: the compiler refuses a constexpr redefined
        pairs = tl.permute(tl.reshape(x, (GROUP, BLOCK // (2 << stage), 2, 1 << stage)), (0, 1, 3, 2))
        u, v = tl.split(pairs)
        x = tl.reshape(tl.permute(tl.join(u + v, u - v), (0, 1, 3, 2)), (GROUP, BLOCK))
    x = x * scale
    if INVERSE:
        x = x * signs
    tl.store(x_ptr + offset, x, mask=mask)


def rotate(x: torch.Tensor, block: int, *, inverse: bool = False) -> torch.Tensor:
    """:func:`zeropp.quant.hadamard.rotate` on the Triton kernel: the same fp32 copy, bit for bit."""
    out = x.to(torch.float32, copy=True)
    n = out.shape[-1]
    rows, blocks_per_row = out.numel() // max(1, n), n // block
    units = rows * blocks_per_row
    if units == 0:
        return out
    group = max(1, min(TILE // block, triton.next_power_of_2(units)))
    launch(
        _rotate_kernel, (triton.cdiv(units, group),),
        out, n, hadamard.signs(block, out.device), hadamard.scale(block), blocks_per_row, units,
        BLOCK=block, STAGES=block.bit_length() - 1, GROUP=group, INVERSE=inverse,
    )  # fmt: skip
    return out
