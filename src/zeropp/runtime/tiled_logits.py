"""The output projection and cross-entropy in sequence tiles (ALST's tiled logits): the (tokens x vocab)
logits never exist whole, in forward or backward.

[Note: tiled logits]
A language model's last activation holds tokens x hidden values; its logits tokens x vocab, in fp32
for the loss: with a 128K vocabulary and 8K tokens, 4 GiB, more than the rest of a small model's
activations together. :func:`tiled_cross_entropy` takes the hidden states, the projection's weight and
the targets; forward computes one tile of logits at a time, keeps only its summed losses, and frees
it; backward computes each tile's logits again, turns them into their gradient (softmax minus the
one-hot target, scaled) and accumulates the hidden states' and weight's gradients from it. The peak
is one tile's logits (and its gradient), at the cost of the projection's matmul once more, plus
the weight's gradient accumulated in fp32 (vocab x hidden) where the weight is in half precision. The loss
is the mean over the targets that are not `ignore_index` (or the sum over `num_items`), as
``F.cross_entropy`` computes it, summed tile by tile in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def _logits(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One tile's logits, in fp32 at least (the loss of half-precision logits is computed in fp32)."""
    logits = h @ weight.t()
    return logits.float() if logits.element_size() < 4 else logits


class _TiledCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, tiles: int, divisor: float):  # type: ignore[override]
        ctx.save_for_backward(hidden, weight, targets)
        ctx.tiles, ctx.divisor = tiles, divisor
        total = 0
        for h, t in zip(hidden.chunk(tiles), targets.chunk(tiles), strict=True):
            total = total + F.cross_entropy(_logits(h, weight), t, ignore_index=IGNORE_INDEX, reduction="sum")
        return total / divisor

    @staticmethod
    def backward(ctx, grad_loss):  # type: ignore[override]
        hidden, weight, targets = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden)
        weighted = ctx.needs_input_grad[1]  # a frozen head (LoRA) needs no gradient of its own
        grad_weight = (
            torch.zeros_like(weight, dtype=torch.promote_types(weight.dtype, torch.float32)) if weighted else None
        )
        scale = grad_loss / ctx.divisor
        start = 0
        for h, t in zip(hidden.chunk(ctx.tiles), targets.chunk(ctx.tiles), strict=True):
            grad = torch.softmax(_logits(h, weight), dim=-1)
            kept = t != IGNORE_INDEX
            grad[kept, t[kept]] -= 1.0
            grad[~kept] = 0.0
            grad = (grad * scale).to(hidden.dtype)
            grad_hidden[start : start + len(h)] = grad @ weight
            if weighted:
                grad_weight += grad.t() @ h
            start += len(h)
        return grad_hidden, grad_weight.to(weight.dtype) if weighted else None, None, None, None


def tiled_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    tiles: int,
    num_items: float | None = None,
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T`` against `targets` (ignore_index -100) in `tiles` tiles of
    the tokens: the mean over counted targets, or their sum over `num_items` when given. `hidden`
    (..., hidden), `targets` (...). See [Note: tiled logits]."""
    hidden, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    divisor = float(num_items) if num_items is not None else float((targets != IGNORE_INDEX).sum())
    return _TiledCrossEntropy.apply(hidden, weight, targets, min(tiles, len(targets)), divisor)
