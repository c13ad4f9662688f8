"""Random Hadamard rotation of quantization blocks (qgZ's ``gradient_hadamard``).

Each full block of b elements (b a power of 2) along a row's last dimension becomes ``H (s * x)``
with ``H`` the normalized Sylvester-Hadamard matrix (``H = H^T``, ``H H = I``) and ``s`` a fixed
vector of random signs (seeded: the same on every rank). The rotation spreads a block's outliers
over all its elements, so the absmax that sets the quantization step shrinks towards the block's
root-mean-square. Being linear and the same on every rank, it commutes with qgZ's sums: gradients
are rotated once before the first quantization and the reduced result rotated back once
(``x = s * (H y)``). A trailing block shorter than b is left as it is.

Order of operations (the fast Walsh-Hadamard transform; every backend follows it bit for bit)::

    forward:  x = s * x                       exact (signs are +-1)
              for stride in 1, 2, 4, ..., b/2:  pairs (u, v) = (x[i], x[i + stride]), i with bit
                  (u, v) -> (u + v, u - v)      `stride` clear, each rounded once to fp32
              x = x * fp32(b ** -0.5)
    inverse:  the butterflies, the scale, then the signs.

O(b log b) a block instead of the b x b matrix product; in real arithmetic the same transform,
in fp32 the roundings differ from a matmul's (both stay within a few ulps of the exact values).
:mod:`zeropp.quant.triton.hadamard` is the Triton kernel (:mod:`zeropp.quant.backends` picks one).
"""

from __future__ import annotations

import functools

import torch

SEED = 0x5EED


@functools.lru_cache(maxsize=8)
def signs(block: int, device: torch.device) -> torch.Tensor:
    """The seeded random signs (+-1, fp32) of a block of `block` elements."""
    drawn = torch.randint(0, 2, (block,), generator=torch.Generator().manual_seed(SEED)) * 2 - 1
    return drawn.to(device, torch.float32)


def scale(block: int) -> float:
    """The normalization ``b ** -0.5``, rounded to fp32 (the factor every backend multiplies by)."""
    return torch.tensor(block**-0.5, dtype=torch.float32).item()


def _butterflies(blocks: torch.Tensor) -> torch.Tensor:
    """The unnormalized Sylvester-Hadamard transform of `blocks` [m, b], strides 1, 2, ..., b/2, in a
    new tensor (two buffers in turn: each stage writes its sums and differences into the other)."""
    m, block = blocks.shape
    stages = block.bit_length() - 1
    buffers = [torch.empty_like(blocks) for _ in range(min(2, stages))]
    source = blocks
    for stage in range(stages):
        stride, target = 1 << stage, buffers[stage % 2]
        pairs, out = (t.view(m, block // (2 * stride), 2, stride) for t in (source, target))
        torch.add(pairs[:, :, 0], pairs[:, :, 1], out=out[:, :, 0])
        torch.sub(pairs[:, :, 0], pairs[:, :, 1], out=out[:, :, 1])
        source = target
    return source if stages else blocks.clone()


def rotate(x: torch.Tensor, block: int, *, inverse: bool = False) -> torch.Tensor:
    """The rotated (or with `inverse`, un-rotated) fp32 copy of `x` [rows, n], block by block along n."""
    out = x.to(torch.float32, copy=True)
    full = out.shape[-1] // block * block
    if full:
        s = signs(block, x.device)
        blocks = out[..., :full].reshape(-1, block)
        if inverse:
            blocks = _butterflies(blocks).mul_(scale(block)).mul_(s)
        else:
            blocks = _butterflies(blocks * s).mul_(scale(block))
        out[..., :full] = blocks.view(*out.shape[:-1], full)
    return out
