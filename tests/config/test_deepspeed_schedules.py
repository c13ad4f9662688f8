"""DeepSpeed's learning-rate schedules and dynamic loss scaling, step by step against DeepSpeed's own
classes (on the CPU; skipped without DeepSpeed), and the loss scaler's hysteresis and static scale."""

from __future__ import annotations

import math
import os

import pytest
import torch

from zeropp.app import schedule
from zeropp.app.schedule import learning_rate
from zeropp.config.deepspeed import translate
from zeropp.config.sections import LossScaleConfig, OptimConfig
from zeropp.errors import ConfigError
from zeropp.zero.precision import LossScaler

SCHEDULE_CASES = {  # DeepSpeed's scheduler type and params; zeropp's optim keys follow from translate
    "WarmupLR": ("WarmupLR", {"warmup_min_lr": 1e-4, "warmup_max_lr": 2e-3, "warmup_num_steps": 10}),
    "WarmupDecayLR": ("WarmupDecayLR", {"warmup_min_lr": 1e-4, "warmup_max_lr": 2e-3, "warmup_num_steps": 5,
                                        "total_num_steps": 30, "warmup_type": "linear"}),
    "WarmupCosineLR": ("WarmupCosineLR", {"warmup_min_ratio": 0.1, "warmup_num_steps": 6, "total_num_steps": 25,
                                          "cos_min_ratio": 0.05}),
    # OneCycle: defaults, asymmetric halves, stairs, decay of lr and momentum, no momentum cycle
    "OneCycle-plain": ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 8}),
    "OneCycle-asymmetric-decay": ("OneCycle", {"cycle_min_lr": 2e-4, "cycle_max_lr": 3e-3, "cycle_first_step_size": 5,
                                               "cycle_second_step_size": 11, "decay_step_size": 4, "decay_lr_rate": 0.5,
                                               "decay_mom_rate": 0.01, "cycle_min_mom": 0.85, "cycle_max_mom": 0.95}),
    "OneCycle-stairs": ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 9,
                                     "cycle_second_step_size": 6, "cycle_first_stair_count": 3,
                                     "cycle_second_stair_count": 2}),
    "OneCycle-no-momentum": ("OneCycle", {"cycle_min_lr": 0.0, "cycle_max_lr": 1e-2, "cycle_first_step_size": 3,
                                          "cycle_momentum": False, "decay_step_size": 2, "decay_lr_rate": 0.1}),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(SCHEDULE_CASES))
def test_schedules_follow_deepspeeds_scheduler_step_by_step(case):
    """lr and Adam's betas at every step as DeepSpeed's own scheduler class sets them on an AdamW (built before
    the first step and stepped after each, as its engine does); only OneCycle with its momentum cycle
    changes the betas (beta1 cycled, beta2 0.99)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    lr_schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")
    kind, params = SCHEDULE_CASES[case]
    ds = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "scheduler": {"type": kind, "params": params}}
    optim = translate(ds).config().optim
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3, betas=(optim.beta1, optim.beta2))
    scheduler = getattr(lr_schedules, kind)(optimizer, **params)
    group = {"lr": 0.0, "betas": (optim.beta1, optim.beta2)}
    for step in range(50):
        schedule.apply([group], optim, 1000, step)
        expected = optimizer.param_groups[0]
        assert group["lr"] == pytest.approx(expected["lr"], rel=1e-12, abs=1e-15), step
        assert group["betas"] == pytest.approx(expected["betas"], rel=1e-12), step
        scheduler.step()


def test_one_cycle_without_its_bounds_is_one_line():
    ds = {"scheduler": {"type": "OneCycle", "params": {"cycle_max_lr": 1e-3}}}
    with pytest.raises(
        ConfigError, match='^DeepSpeed scheduler.type = "OneCycle" needs scheduler.params.cycle_min_lr$'
    ):
        translate(ds).config()


def test_zeropps_own_cosine_schedule_is_unchanged():
    optim = OptimConfig(lr=1.0, warmup_steps=4)
    for step in range(30):
        old = (step + 1) / 4 if step < 4 else 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (step - 4) / 16)))
        assert learning_rate(optim, 20, step) == pytest.approx(old, rel=1e-12)


def test_loss_scaler_hysteresis_and_static_scale():
    scaler = LossScaler(LossScaleConfig(initial_scale=64.0, growth_interval=2, hysteresis=2), enabled=True)
    scales = []
    for overflow in (True, True, True, False, False, True):
        scaler.update(overflow)
        scales.append(scaler.scale)
    # one overflow tolerated, then halved, then halved again (the hysteresis stays spent until growth)
    assert scales == [64.0, 32.0, 16.0, 16.0, 32.0, 32.0]
    consecutive = LossScaler(
        LossScaleConfig(initial_scale=64.0, growth_interval=100, hysteresis=2, consecutive_hysteresis=True), True
    )
    for overflow in (True, False, True, False, True, True):
        consecutive.update(overflow)
    assert consecutive.scale == 32.0  # a clean step restores the hysteresis: only the last pair backs off
    static = translate({"fp16": {"enabled": True, "loss_scale": 1024}}).config().zero.loss_scale
    fixed = LossScaler(static, enabled=True)
    for overflow in (True, False, True, True):
        fixed.update(overflow)
    assert fixed.scale == 1024.0


@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("hysteresis", [1, 2, 3])
def test_loss_scale_back_off_follows_deepspeeds_scaler_step_by_step(hysteresis, consecutive):
    """Overflows, hysteresis and the floor as DeepSpeed's DynamicLossScaler (no growth within the run:
    DeepSpeed 0.19 first grows after loss_scale_window + 1 clean steps, zeropp after the window)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    loss_scaler = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler")
    fp16 = {"enabled": True, "initial_scale_power": 20, "hysteresis": hysteresis, "consecutive_hysteresis": consecutive}
    ours = LossScaler(translate({"fp16": fp16}).config().zero.loss_scale, enabled=True)
    theirs = loss_scaler.DynamicLossScaler(
        init_scale=2.0**20, scale_window=1000, min_scale=1, delayed_shift=hysteresis,
        consecutive_hysteresis=consecutive, raise_error_at_min_scale=False,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(hysteresis)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loss_scaler.dist, "get_rank", lambda: 0)  # it only logs with it
        for overflow in (torch.rand(300, generator=generator) < 0.3).tolist():
            ours.update(overflow)
            theirs.update_scale(overflow)
            assert ours.scale == theirs.cur_scale
