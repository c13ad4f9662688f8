"""Compute dtypes, the masters' dtype and dynamic loss scaling."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from zeropp.config.sections import LossScaleConfig

if TYPE_CHECKING:
    from zeropp.zero.unit import FlatUnit

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class LossScaler:
    """fp16 dynamic loss scaling: an overflowing step is skipped and, after `hysteresis` such
    overflows, the scale backs off; after `growth_interval` clean steps it grows (and the hysteresis
    is restored, or after every clean step with `consecutive_hysteresis`), as DeepSpeed's
    DynamicLossScaler does. For fp32 and bf16 the scale is fixed at 1."""

    def __init__(self, config: LossScaleConfig, enabled: bool) -> None:
        self.config = config
        self.enabled = enabled
        self.scale = config.initial_scale if enabled else 1.0
        self._clean_steps = 0
        self._hysteresis = config.hysteresis  # overflows left before the next back-off

    def update(self, overflow: bool) -> None:
        if not self.enabled:
            return
        if overflow:
            if self._hysteresis <= 1:
                self.scale = max(self.scale * self.config.backoff_factor, self.config.min_scale)
            else:
                self._hysteresis -= 1
            self._clean_steps = 0
            return
        self._clean_steps += 1
        if self.config.consecutive_hysteresis:
            self._hysteresis = self.config.hysteresis
        if self._clean_steps % self.config.growth_interval == 0:
            self.scale *= self.config.growth_factor
            self._hysteresis = self.config.hysteresis

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self._clean_steps, "hysteresis": self._hysteresis}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self._clean_steps = state["scale"], state["clean_steps"]
        self._hysteresis = state.get("hysteresis", self.config.hysteresis)  # checkpoints from before hysteresis


def keep_master_in(unit: FlatUnit, dtype: torch.dtype) -> None:
    """Store `unit`'s master in `dtype` (``master_dtype``; the optimizer compensates its rounding,
    :mod:`zeropp.zero.optim.low_precision_adam`): the compute weights themselves where they are this rank's
    whole master in that dtype (a sharded unit's compute shard at stage 3; the unit's weights where one
    rank holds its whole master), else a copy rounded to nearest. Before the optimizer is built."""
    for weights in (unit.compute_shard, unit.compute_flat):
        held = weights is not None and weights.untyped_storage().nbytes() > 0
        if held and weights.dtype == dtype and weights.numel() == unit.master.numel():
            unit.master.data = weights
            return
    unit.master.data = unit.master.data.to(dtype)
