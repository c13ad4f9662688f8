"""Learning-rate schedules of ``zeropp train``: its own warm-up + cosine, and DeepSpeed's three.

Every schedule is the peak ``optim.lr`` times a ratio of the optimizer step (0-based), so ``--lr``
scales a whole schedule. ``optim.schedule`` picks one:

- ``cosine`` (zeropp's): ``(step + 1) / warmup_steps`` during warm-up, then cosine decay to
  ``min_lr_ratio`` at ``decay_steps`` (unset: ``train.steps``).
- ``constant``: the peak at every step (DeepSpeed without a ``scheduler`` block).
- ``warmup``, ``warmup_decay``, ``warmup_cosine``: DeepSpeed's ``WarmupLR``, ``WarmupDecayLR`` and
  ``WarmupCosineLR`` (``deepspeed.runtime.lr_schedules``), stepped as DeepSpeed's engine steps them:
  the optimizer step ``s`` runs with the schedule at ``last_batch_iteration = s - 1`` (the scheduler
  is built before the first step and stepped after each). With ``W = max(2, warmup_steps)`` and
  ``i = s - 1``, the warm-up fraction is ``ln(i + 1) / ln(W)`` (``warmup_type = "log"``) or ``i / W``
  (``"linear"``) while ``i < W``; the ratio rises from ``warmup_start_ratio`` to 1, then stays at 1
  (``warmup``), falls linearly to ``min_lr_ratio`` at ``decay_steps`` (``warmup_decay``:
  ``(T - i) / max(1, T - W)``), or follows a cosine to ``min_lr_ratio`` (``warmup_cosine``:
  progress ``min(1, (i - W + 1) / max(1, T - W))``). Before its first step ``WarmupCosineLR`` gives
  0, the two others ``warmup_start_ratio``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from zeropp.config.sections import OptimConfig


def learning_rate(optim: OptimConfig, train_steps: int, step: int) -> float:
    """The learning rate of optimizer step `step` (0-based) of a run of `train_steps` steps."""
    return optim.lr * lr_ratio(optim, train_steps, step)


def lr_ratio(optim: OptimConfig, train_steps: int, step: int) -> float:
    total = optim.decay_steps if optim.decay_steps is not None else train_steps
    if optim.schedule == "constant":
        return 1.0
    if optim.schedule == "cosine":
        return _zeropp_cosine(optim, total, step)
    return _deepspeed(optim, total, step - 1)


def _zeropp_cosine(optim: OptimConfig, total: int, step: int) -> float:
    warmup = optim.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return _cosine(optim.min_lr_ratio, progress)


def _cosine(floor: float, progress: float) -> float:
    return floor + (1 - floor) * (1 + math.cos(math.pi * progress)) / 2


def _deepspeed(optim: OptimConfig, total: int, iteration: int) -> float:
    """DeepSpeed's WarmupLR / WarmupDecayLR / WarmupCosineLR after `iteration` scheduler steps."""
    start = optim.warmup_start_ratio
    if iteration < 0:  # built, not yet stepped
        return 0.0 if optim.schedule == "warmup_cosine" else start
    warmup = max(2, optim.warmup_steps)
    if iteration < warmup:
        rise = math.log(iteration + 1) / math.log(warmup) if optim.warmup_type == "log" else iteration / warmup
        return start + (1 - start) * rise
    floor = optim.min_lr_ratio
    if optim.schedule == "warmup_decay":
        return floor + (1 - floor) * max(0.0, (total - iteration) / max(1, total - warmup))
    if optim.schedule == "warmup_cosine":
        return max(0.0, _cosine(floor, min(1.0, (iteration - warmup + 1) / max(1, total - warmup))))
    return 1.0


def set_rate(group: dict[str, Any], lr: float) -> None:
    """Set a param group's learning rate; in place where the optimizer keeps it as a tensor (torchao's)."""
    if isinstance(group["lr"], torch.Tensor):
        group["lr"].fill_(lr)
    else:
        group["lr"] = lr
