"""DeepSpeed's ``optimizer`` and ``scheduler`` blocks as zeropp's ``optim`` keys: the part of the
reader of :mod:`zeropp.config.deepspeed` that knows DeepSpeed's optimizers and learning-rate schedules
(their step-by-step equivalents: :mod:`zeropp.app.schedule`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from zeropp.config import deepspeed_keys as tables
from zeropp.config.deepspeed_keys import AUTO
from zeropp.errors import ConfigError

if TYPE_CHECKING:
    from zeropp.config.deepspeed_translation import Translation
    from zeropp.config.sections import Config


class OptimizerBlocks:
    """Mixed into the reader, whose helpers (``block``, ``set``, ``number`` ...) these use."""

    out: Translation
    base: Config

    def optimizer(self) -> None:
        block = self.block("optimizer")
        self.check_keys("optimizer", block)
        kind = str(block.get("type", "")).lower()
        if kind not in tables.OPTIMIZERS:
            raise self.refuse("optimizer.type", block.get("type"), '"Adam", "AdamW" or "SGD" (in any case)')
        params = self.block("optimizer", "params")
        adam = kind != "sgd"
        read = {"lr", "weight_decay", *(("adam_w_mode", "betas", "eps", "bias_correction") if adam else ("momentum",))}
        self.check_keys("optimizer.params", params, read)
        where = "optimizer.params."
        adam_w = self.boolean(where + "adam_w_mode", params.get("adam_w_mode", True)) or kind == "adamw"
        self.set("optim.optimizer", "adam" if adam and not adam_w else tables.OPTIMIZERS[kind], "optimizer.type")
        values = {**tables.DEEPSPEED_DEFAULTS["optimizer.params"], **params}
        for key in ("lr", "weight_decay", *(("eps",) if adam else ("momentum",))):
            if values.get(key, AUTO) != AUTO:
                self.set(f"optim.{key}", self.number(where + key, values[key]), where + key)
        if adam and "bias_correction" in params:
            corrected = self.boolean(where + "bias_correction", params["bias_correction"])
            self.set("optim.bias_correction", corrected, where + "bias_correction")
        betas = values["betas"]
        if adam and betas != AUTO:
            if not (isinstance(betas, list) and len(betas) == 2):
                raise self.refuse(where + "betas", betas, "a list of two numbers")
            for i, beta in enumerate(betas):
                self.set(f"optim.beta{i + 1}", self.number(f"{where}betas[{i}]", beta), where + "betas")

    def scheduler(self) -> None:
        block = self.block("scheduler")
        self.check_keys("scheduler", block)
        kind = block.get("type")
        if kind not in tables.SCHEDULES:
            raise self.refuse("scheduler.type", kind, ", ".join(f'"{k}"' for k in tables.SCHEDULES))
        given = self.block("scheduler", "params")
        if kind == "OneCycle":
            self.one_cycle(given)
            return
        read = {*tables.DEEPSPEED_DEFAULTS[kind], *(("warmup_max_lr",) if kind == "WarmupLR" else ("total_num_steps",))}
        self.check_keys("scheduler.params", given, read)
        params = {**tables.DEEPSPEED_DEFAULTS[kind], **given}
        key = "scheduler.params."
        self.set("optim.schedule", tables.SCHEDULES[kind], "scheduler.type")
        if params["warmup_num_steps"] != AUTO:
            steps = self.integer(key + "warmup_num_steps", params["warmup_num_steps"], 1)
            self.set("optim.warmup_steps", steps, key + "warmup_num_steps")
        if params["warmup_type"] not in ("log", "linear"):
            raise self.refuse(key + "warmup_type", params["warmup_type"], '"log" or "linear"')
        self.set("optim.warmup_type", params["warmup_type"], key + "warmup_type")
        if params.get("total_num_steps", AUTO) != AUTO:
            total = self.integer(key + "total_num_steps", params["total_num_steps"], 1)
            self.set("optim.decay_steps", total, key + "total_num_steps")
        if kind == "WarmupCosineLR":  # ratios of the optimizer's lr
            for ds, ours in (("warmup_min_ratio", "warmup_start_ratio"), ("cos_min_ratio", "min_lr_ratio")):
                if params[ds] != AUTO:
                    self.set(f"optim.{ours}", self.number(key + ds, params[ds]), key + ds)
            return
        peak = params.get("warmup_max_lr", AUTO)  # WarmupLR without it: the optimizer's lr, as in DeepSpeed
        if peak == AUTO:
            peak = self.out.overrides.get("optim.lr", self.base.optim.lr)
        peak = self.number(key + "warmup_max_lr", peak)
        self.set("optim.lr", peak, key + "warmup_max_lr")
        low = params["warmup_min_lr"]
        ratio = 0.0 if low == AUTO else self.number(key + "warmup_min_lr", low) / peak  # "auto": 0, as HF sets it
        if ratio > 1:
            raise self.refuse(key + "warmup_min_lr", low, f"at most warmup_max_lr ({peak:g})")
        self.set("optim.warmup_start_ratio", ratio, key + "warmup_min_lr")
        if kind == "WarmupDecayLR":  # decays back to warmup_min_lr
            self.set("optim.min_lr_ratio", ratio, key + "warmup_min_lr")

    def one_cycle(self, given: dict[str, Any]) -> None:
        """DeepSpeed's OneCycle: its peak is the lr, its lowest a ratio of it (zeropp.app.schedule)."""
        key = "scheduler.params."
        self.check_keys(
            "scheduler.params", given, {*tables.DEEPSPEED_DEFAULTS["OneCycle"], "cycle_min_lr", "cycle_max_lr"}
        )
        params = {**tables.DEEPSPEED_DEFAULTS["OneCycle"], **given}
        self.set("optim.schedule", "one_cycle", "scheduler.type")
        for bound in ("cycle_min_lr", "cycle_max_lr"):  # OneCycle's constructor has no default for them
            if bound not in given:
                raise ConfigError(f'DeepSpeed {self.name("scheduler.type")} = "OneCycle" needs {key}{bound}')
        peak = self.number(key + "cycle_max_lr", params["cycle_max_lr"])
        low = self.number(key + "cycle_min_lr", params["cycle_min_lr"])
        if peak == 0 or low > peak:
            raise self.refuse(
                key + "cycle_max_lr", params["cycle_max_lr"], f"a number > 0 and >= cycle_min_lr ({low:g})"
            )
        self.set("optim.lr", peak, key + "cycle_max_lr")
        self.set("optim.warmup_start_ratio", low / peak, key + "cycle_min_lr")
        for ds, (ours, whole) in tables.ONE_CYCLE.items():
            if params[ds] is not None:
                value = (
                    self.integer(key + ds, params[ds], 1 if ds == "cycle_first_step_size" else 0)
                    if whole
                    else self.number(key + ds, params[ds])
                )
                self.set(f"optim.{ours}", value, key + ds)
        self.set(
            "optim.cycle_momentum",
            self.boolean(key + "cycle_momentum", params["cycle_momentum"]),
            key + "cycle_momentum",
        )
