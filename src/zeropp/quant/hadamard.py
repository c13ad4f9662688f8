"""Random Hadamard rotation of quantization blocks (qgZ's ``gradient_hadamard``).

Each full block of b elements (b a power of 2) along a row's last dimension becomes ``H (s * x)``
with ``H`` the normalized Sylvester-Hadamard matrix (``H = H^T``, ``H H = I``) and ``s`` a fixed
vector of random signs (seeded: the same on every rank). The rotation spreads a block's outliers
over all its elements, so the absmax that sets the quantization step shrinks towards the block's
root-mean-square. Being linear and the same on every rank, it commutes with qgZ's sums: gradients
are rotated once before the first quantization and the reduced result rotated back once
(``x = s * (H y)``). A trailing block shorter than b is left as it is.
"""

from __future__ import annotations

import functools

import torch

SEED = 0x5EED


@functools.lru_cache(maxsize=8)
def _matrix_and_signs(block: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    h = torch.ones(1, 1)
    while h.shape[0] < block:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    signs = torch.randint(0, 2, (block,), generator=torch.Generator().manual_seed(SEED)) * 2 - 1
    return (h / block**0.5).to(device), signs.to(device, torch.float32)


def rotate(x: torch.Tensor, block: int, *, inverse: bool = False) -> torch.Tensor:
    """The rotated (or with `inverse`, un-rotated) fp32 copy of `x` [rows, n], block by block along n."""
    out = x.to(torch.float32, copy=True)
    full = out.shape[-1] // block * block
    if full:
        h, signs = _matrix_and_signs(block, x.device)
        blocks = out[..., :full].reshape(-1, block)
        blocks = blocks @ h * signs if inverse else (blocks * signs) @ h
        out[..., :full] = blocks.reshape(*out.shape[:-1], full)
    return out
