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
- ``one_cycle``: DeepSpeed's ``OneCycle``, stepped the same way. The lr rises from the cycle's lowest
  (``warmup_start_ratio``) to the peak over ``warmup_steps``, falls back over ``cycle_down_steps``
  (by ``cycle_stairs`` / ``cycle_down_stairs`` steps where set), then stays at the lowest or decays
  as ``lowest / (1 + decay_rate x k / decay_interval)`` (k: scheduler steps since the cycle). With
  ``cycle_momentum``, Adam's betas follow: beta1 from ``max_momentum`` down to ``min_momentum`` as
  the lr rises and back, beta2 0.99 throughout, both DeepSpeed's; before its first step the betas are
  ``(min_momentum, 0.99)``, as DeepSpeed's constructor sets them.
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
    if optim.schedule == "one_cycle":
        low = optim.warmup_start_ratio
        if step == 0:  # built, not yet stepped: the constructor's lowest lr
            return low
        after = _one_cycle_decay_steps(optim, step - 1)
        if after is None:
            return low + (1 - low) * _one_cycle_scale(optim, step - 1)
        if not (optim.decay_rate and optim.decay_interval):
            return low
        return low / (1 + optim.decay_rate * after / optim.decay_interval)
    return _deepspeed(optim, total, step - 1)


def adam_betas(optim: OptimConfig, step: int) -> tuple[float, float] | None:
    """Adam's betas for optimizer step `step` where the schedule sets them (one_cycle with
    cycle_momentum), else None."""
    if optim.schedule != "one_cycle" or not optim.cycle_momentum:
        return None
    low, high = optim.min_momentum, optim.max_momentum
    if step == 0:
        return (low, 0.99)
    after = _one_cycle_decay_steps(optim, step - 1)
    if after is None:
        return (high - (high - low) * _one_cycle_scale(optim, step - 1), 0.99)
    if not (optim.momentum_decay_rate and optim.decay_interval):
        return (high, 0.99)
    return (high * (1 + optim.momentum_decay_rate * after / optim.decay_interval), 0.99)


def apply(groups: list[dict[str, Any]], optim: OptimConfig, train_steps: int, step: int) -> None:
    """Set the schedule's learning rate (and betas, where it sets them) of step `step` on `groups`."""
    lr, betas = learning_rate(optim, train_steps, step), adam_betas(optim, step)
    for group in groups:
        set_rate(group, lr)
        if betas is not None and "betas" in group:
            group["betas"] = betas


def _one_cycle_decay_steps(optim: OptimConfig, iteration: int) -> int | None:
    """Scheduler steps since OneCycle's cycle ended (at `iteration`, its last_batch_iteration), None
    within the cycle."""
    total = optim.warmup_steps + (optim.warmup_steps if optim.cycle_down_steps is None else optim.cycle_down_steps)
    return None if iteration < total else iteration - total + 1


def _one_cycle_scale(optim: OptimConfig, iteration: int) -> float:
    """OneCycle's position in its cycle at `iteration`: 0 at the lowest lr, 1 at the peak."""
    up = float(optim.warmup_steps)
    down = up if optim.cycle_down_steps is None else float(optim.cycle_down_steps)
    total, batch = up + down, iteration + 1
    x = 1.0 + batch / total - math.floor(1 + batch / total)
    rising = x <= up / total
    scale = x / (up / total) if rising else (x - 1) / (up / total - 1)
    down_stairs = optim.cycle_stairs if optim.cycle_down_stairs is None else optim.cycle_down_stairs
    stairs = optim.cycle_stairs if rising else down_stairs
    if stairs > 0:  # held flat over each stair, counted from the integer position (as DeepSpeed does)
        position = batch % total
        steps = position * stairs / up if position <= up else (total - position) * stairs / down
        scale = math.floor(steps) / stairs
    return scale


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
