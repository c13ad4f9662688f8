"""Compute dtypes and dynamic loss scaling."""

from __future__ import annotations

import torch

from zeropp.config import LossScaleConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class LossScaler:
    """fp16 dynamic loss scaling: an overflowing step is skipped and the scale backs off;
    after `growth_interval` clean steps it grows. For fp32 and bf16 the scale is fixed at 1."""

    def __init__(self, config: LossScaleConfig, enabled: bool) -> None:
        self.config = config
        self.enabled = enabled
        self.scale = config.initial_scale if enabled else 1.0
        self._clean_steps = 0

    def update(self, overflow: bool) -> None:
        if not self.enabled:
            return
        if overflow:
            self.scale = max(self.scale * self.config.backoff_factor, self.config.min_scale)
            self._clean_steps = 0
            return
        self._clean_steps += 1
        if self._clean_steps % self.config.growth_interval == 0:
            self.scale *= self.config.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self._clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self._clean_steps = state["scale"], state["clean_steps"]
