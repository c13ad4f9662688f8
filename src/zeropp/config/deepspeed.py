"""A DeepSpeed JSON config read as zeropp config keys (``zeropp train --deepspeed``, ``zeropp.zero_config_from_deepspeed``).

:func:`translate` maps each key to the zeropp key it sets (``deepspeed_keys.MAPPED`` lists them) and returns
them as dotted overrides for ``load_config``. Rules:

- A block the file has means what it means in DeepSpeed, defaults included: a ``zero_optimization``
  block without ``stage`` is stage 0, without the ZeRO++ keys plain ZeRO; an ``fp16`` block brings
  DeepSpeed's loss-scale defaults (2^16, window 1000, hysteresis 2); an ``optimizer`` block Adam's
  (betas 0.9, 0.999, eps 1e-8, weight decay 0); a ``scheduler`` block its own.
- A block the file leaves out, and every ``"auto"`` value, keeps zeropp's setting (its default, the
  ``--config`` file or a flag), as the Hugging Face integration fills ``"auto"`` from its trainer;
  the bucket sizes' ``"auto"`` come from the model's hidden size h: ``reduce_bucket_size`` h²,
  ``stage3_prefetch_bucket_size`` 0.9·h², ``stage3_param_persistence_threshold`` 10·h.
- DeepSpeed's bucket sizes count the elements of a whole collective, zeropp's one rank's part:
  they are divided by the data-parallel world size.
- Keys that change nothing here (``deepspeed_keys.NOTED``) are accepted and listed in one note; keys zeropp
  cannot honour are refused in one line saying why (``deepspeed_keys.REFUSED``, and values such as an NVMe
  offload); any other key is refused with the keys allowed there.
- ``train_batch_size`` must equal micro-batch × accumulation steps × world size; one of the three
  missing is derived from the others as DeepSpeed does.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zeropp.config.deepspeed_keys import AUTO, DEEPSPEED_DEFAULTS, DTYPES, NOTED, OPTIMIZERS, REFUSED, SCHEDULES
from zeropp.config.sections import Config, ZeroConfig, load_config
from zeropp.errors import ConfigError


@dataclass
class Translation:
    """What a DeepSpeed config sets: zeropp overrides (dotted keys), the keys noted, the "auto" values
    resolved, and the train_batch_size to check the final config against."""

    overrides: dict[str, Any] = field(default_factory=dict)
    noted: list[str] = field(default_factory=list)
    resolved: dict[str, Any] = field(default_factory=dict)
    train_batch_size: int | None = None
    world_size: int = 1

    def note(self) -> str | None:
        """One line for the user: the keys accepted without effect and the "auto" values resolved."""
        parts = []
        if self.noted:
            parts.append(f"accepted without effect here: {', '.join(self.noted)}")
        if self.resolved:
            parts.append("auto: " + ", ".join(f"{k} = {v}" for k, v in self.resolved.items()))
        return f"DeepSpeed config: {'; '.join(parts)}" if parts else None

    def check_batch(self, config: Config) -> None:
        """Refuse a final config (after the flags) whose global batch is not train_batch_size."""
        if self.train_batch_size is not None:
            micro, steps = config.train.micro_batch_size, config.zero.gradient_accumulation_steps
            _check_total(self.train_batch_size, micro, steps, self.world_size)

    def config(self, base: Config | Mapping[str, Any] | None = None) -> Config:
        """The Config these overrides give on top of `base` (a Config, a dict, or the defaults)."""
        source = dataclasses.asdict(base) if isinstance(base, Config) else base
        config = load_config(source, self.overrides)
        self.check_batch(config)
        return config


def read(source: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """A DeepSpeed config as a dict: a JSON file's contents, or the mapping itself."""
    if isinstance(source, Mapping):
        return dict(source)
    path = Path(source)
    where = f"DeepSpeed config {str(path)!r}"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{where} does not exist; expected a JSON file") from None
    except IsADirectoryError:
        raise ConfigError(f"{where} is a directory; expected a JSON file") from None
    except OSError as error:
        raise ConfigError(f"{where} cannot be read ({error.strerror})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"{where} does not parse as JSON: {error}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where} is not allowed; expected a JSON object at the top")
    return data


def translate(
    source: str | Path | Mapping[str, Any],
    *,
    world_size: int | None = None,
    hidden_size: int | None = None,
    base: Config | None = None,
) -> Translation:
    """The zeropp settings of a DeepSpeed config. `base` is the config "auto" and absent batch keys
    resolve from (default: zeropp's defaults); `hidden_size` resolves the "auto" bucket sizes;
    `world_size` is the data-parallel world (default: torch.distributed's, or 1 outside it)."""
    if world_size is None:
        import torch.distributed as dist

        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    reader = _Reader(read(source), world_size, hidden_size, base or Config())
    return reader.run()


def zero_config(
    source: str | Path | Mapping[str, Any], *, hidden_size: int | None = None, world_size: int | None = None
) -> ZeroConfig:
    """The ZeroConfig of a DeepSpeed config (a JSON file or its dict): `hidden_size` resolves the
    "auto" bucket sizes, `world_size` (the data-parallel ranks; default: torch.distributed's, or 1
    outside it) the per-rank bucket sizes and the batch-size check. Its optimizer and batch keys:
    ``translate(...).config()``."""
    return translate(source, world_size=world_size, hidden_size=hidden_size).config().zero


class _Reader:
    def __init__(self, data: dict[str, Any], world_size: int, hidden_size: int | None, base: Config) -> None:
        self.data, self.world, self.hidden, self.base = data, world_size, hidden_size, base
        self.out = Translation(world_size=world_size)

    # -- values ----------------------------------------------------------------------------------

    def set(self, dotted: str, value: Any) -> None:
        self.out.overrides[dotted] = value

    def integer(self, key: str, value: Any, minimum: int = 0) -> int:
        """DeepSpeed writes sizes as 5e8: an integral float is an integer."""
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise _refuse(key, value, f"an integer >= {minimum}")
        return value

    def number(self, key: str, value: Any) -> float:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
            raise _refuse(key, value, "a number >= 0")
        return float(value)

    def boolean(self, key: str, value: Any) -> bool:
        if not isinstance(value, bool):
            raise _refuse(key, value, "true or false")
        return value

    def block(self, *path: str) -> dict[str, Any]:
        value: Any = self.data
        for name in path:
            value = value.get(name, {})
        if not isinstance(value, dict):
            raise _refuse(".".join(path), value, "a JSON object")
        return value

    def auto_size(self, key: str, factor: float, power: int) -> int:
        if self.hidden is None:
            raise ConfigError(f"DeepSpeed {key} = \"auto\" needs the model's hidden size; pass hidden_size")
        value = int(factor * self.hidden**power)
        self.out.resolved[key] = value
        return value

    def check_keys(self, where: str, block: Mapping[str, Any], allowed: set[str], noted: tuple[str, ...] = ()) -> None:
        """Refuse REFUSED and unknown keys of `block`; note the NOTED ones."""
        prefix = f"{where}." if where else ""
        noted = noted or NOTED.get(where, ())
        for key in block:
            name = prefix + key
            if name in REFUSED:
                raise ConfigError(f"DeepSpeed {name} is not allowed: {REFUSED[name]}")
            if key in noted:
                self.out.noted.append(name)
            elif key not in allowed:
                known = ", ".join(sorted(allowed | set(noted)))
                raise ConfigError(f"DeepSpeed key {name!r} is not known to zeropp; allowed here: {known}")

    def refuse_unless(self, key: str, value: Any, harmless: Any, why: str) -> None:
        if value not in (harmless, AUTO):
            raise ConfigError(f"DeepSpeed {key} = {json.dumps(value, default=str)} is not allowed: {why}")

    # -- blocks, in this order (the scheduler reads the optimizer's lr) ------------------------------

    def run(self) -> Translation:
        handlers: dict[str, Callable[[], None]] = {
            "zero_optimization": self.zero, "fp16": self.precision, "bf16": self.precision,
            "bfloat16": self.precision, "optimizer": self.optimizer, "scheduler": self.scheduler,
            "gradient_clipping": self.clipping, "communication_data_type": self.grad_dtype,
            "data_types": self.grad_dtype, "train_batch_size": self.batch, "train_micro_batch_size_per_gpu": self.batch,
            "gradient_accumulation_steps": self.batch, "activation_checkpointing": self.activation_checkpointing,
            "sequence_parallel_size": self.sequence_parallel,
        }  # fmt: skip
        for key in self.data:
            if key in REFUSED:
                raise ConfigError(f"DeepSpeed {key} is not allowed: {REFUSED[key]}")
        self.check_keys("", self.data, set(handlers))
        done: list[Callable[[], None]] = []
        for key, handler in handlers.items():
            if key in self.data and handler not in done:
                done.append(handler)
                handler()
        return self.out

    def zero(self) -> None:
        given = self.block("zero_optimization")
        mapped = {*DEEPSPEED_DEFAULTS["zero_optimization"], "stage3_prefetch_bucket_size", "offload_optimizer",
                  "offload_param", "cpu_offload"}  # fmt: skip
        self.check_keys("zero_optimization", given, mapped)
        values = {**DEEPSPEED_DEFAULTS["zero_optimization"], **given}
        key = "zero_optimization."
        if values["stage"] != AUTO:
            stage = self.integer(key + "stage", values["stage"])
            if stage > 3:
                raise _refuse(key + "stage", stage, "one of 0, 1, 2, 3")
            self.set("zero.stage", stage)
        for ds, ours in (("reduce_bucket_size", "reduce_bucket_numel"), ("allgather_bucket_size", "allgather_bucket_numel")):
            value = values[ds]
            if value == AUTO and ds == "allgather_bucket_size":  # the HF integration leaves it: zeropp's
                continue
            size = self.auto_size(key + ds, 1.0, 2) if value == AUTO else self.integer(key + ds, value, 1)
            self.set(f"zero.{ours}", max(1, size // self.world))
        ds = "stage3_prefetch_bucket_size"
        if ds in given:
            size = self.auto_size(key + ds, 0.9, 2) if given[ds] == AUTO else self.integer(key + ds, given[ds])
            if size == 0:
                self.set("zero.prefetch", 0)
            else:
                self.out.noted.append(f"{key}{ds} (zero.prefetch counts units ahead)")
        ds = "stage3_param_persistence_threshold"
        value = values[ds]
        self.set("zero.persistence_threshold", self.auto_size(key + ds, 10, 1) if value == AUTO else self.integer(key + ds, value))
        self.set("zero.quantized_weights", self.boolean(key + "zero_quantized_weights", values["zero_quantized_weights"]))
        self.set("zero.quantized_gradients", self.boolean(key + "zero_quantized_gradients", values["zero_quantized_gradients"]))
        hpz = self.integer(key + "zero_hpz_partition_size", values["zero_hpz_partition_size"])
        self.set("zero.hpz_partition_size", max(1, hpz))  # DeepSpeed's 0 is off, as 1
        if self.boolean(key + "cpu_offload", values.get("cpu_offload", False)):  # the former name
            self.set("zero.offload_optimizer", "cpu")
        for ds, ours in (("offload_optimizer", "offload_optimizer"), ("offload_param", "offload_params")):
            self.offload(ds, ours)

    def offload(self, ds: str, ours: str) -> None:
        where = f"zero_optimization.{ds}"
        if ds not in self.block("zero_optimization"):
            return
        block = self.block("zero_optimization", ds)
        self.check_keys(where, block, {"device", "ratio"}, NOTED["offload"])
        self.refuse_unless(f"{where}.ratio", block.get("ratio", 1), 1, "partial offload is not implemented")
        device = block.get("device", "none")
        if device == "nvme":
            raise ConfigError(f'DeepSpeed {where}.device = "nvme" is not allowed: zeropp offloads to CPU memory only')
        if device not in ("cpu", "none"):
            raise _refuse(f"{where}.device", device, '"cpu" or "none"')
        self.set(f"zero.{ours}", device)

    def precision(self) -> None:
        enabled = {}
        present = [name for name in ("fp16", "bf16", "bfloat16") if name in self.data]
        for name in present:
            block = self.block(name)
            if name == "fp16":
                self.check_keys(name, block, {"enabled", *DEEPSPEED_DEFAULTS["fp16"], "fp16_master_weights_and_grads"})
                self.loss_scale({**DEEPSPEED_DEFAULTS["fp16"], **block})
            else:
                self.check_keys(name, block, {"enabled", "bf16_master_weights_and_grads", "bf16_optimizer_states"},
                                NOTED["bf16"])  # fmt: skip
            for key in ("fp16_master_weights_and_grads", "bf16_master_weights_and_grads", "bf16_optimizer_states"):
                self.refuse_unless(f"{name}.{key}", block.get(key, False), False, "zeropp keeps fp32 master weights")
            if block.get("enabled", False) != AUTO:
                enabled["fp16" if name == "fp16" else "bf16"] = self.boolean(f"{name}.enabled", block.get("enabled", False))
        on = [kind for kind, value in enabled.items() if value]
        if len(on) > 1:
            raise ConfigError("DeepSpeed fp16.enabled and bf16.enabled are both true; expected at most one")
        if on:
            self.set("zero.precision", on[0])
        elif len(enabled) == len(present):  # every block says false: DeepSpeed trains in fp32
            self.set("zero.precision", "fp32")

    def loss_scale(self, fp16: dict[str, Any]) -> None:
        """Set even when fp16 is off (zeropp ignores it then), so a later --precision fp16 uses it."""
        prefix, key = "zero.loss_scale.", "fp16."
        static = self.number(key + "loss_scale", fp16["loss_scale"])
        power = self.integer(key + "initial_scale_power", fp16["initial_scale_power"])
        self.set(prefix + "initial_scale", static if static > 0 else float(2**power))
        if static > 0:  # DeepSpeed's static scale: overflowing steps are skipped, the scale stays
            self.set(prefix + "growth_factor", 1.0)
        self.set(prefix + "growth_interval", self.integer(key + "loss_scale_window", fp16["loss_scale_window"], 1))
        self.set(prefix + "hysteresis", self.integer(key + "hysteresis", fp16["hysteresis"], 1))
        consecutive = self.boolean(key + "consecutive_hysteresis", fp16["consecutive_hysteresis"])
        self.set(prefix + "consecutive_hysteresis", consecutive)
        floor = static if static > 0 else self.number(key + "min_loss_scale", fp16["min_loss_scale"])
        self.set(prefix + "min_scale", floor)  # a static scale is its own floor: it never backs off

    def grad_dtype(self) -> None:
        values = {"communication_data_type": self.data.get("communication_data_type", AUTO)}
        if "data_types" in self.data:
            self.check_keys("data_types", self.block("data_types"), {"grad_accum_dtype"})
            values["data_types.grad_accum_dtype"] = self.block("data_types").get("grad_accum_dtype", AUTO)
        for key, value in values.items():
            if value == AUTO:
                continue
            if value not in DTYPES:
                raise _refuse(key, value, ", ".join(f'"{d}"' for d in DTYPES))
            self.set("zero.grad_dtype", DTYPES[value])

    def clipping(self) -> None:
        value = self.data["gradient_clipping"]
        if value != AUTO:
            norm = self.number("gradient_clipping", value)
            self.set("zero.max_grad_norm", norm if norm > 0 else None)

    def batch(self) -> None:
        """train_batch_size = micro x accumulation x world: "auto" takes zeropp's value; one absent is
        derived from the two others as DeepSpeed does (with only the total: accumulation 1)."""
        keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
        zeropp = {keys[1]: self.base.train.micro_batch_size, keys[2]: self.base.zero.gradient_accumulation_steps}
        given: dict[str, int | None] = {}
        for key in keys:
            value = self.data.get(key)
            given[key] = zeropp.get(key) if value == AUTO else None if value is None else self.integer(key, value, 1)
        total, micro, steps = given.values()
        if total is not None:
            if micro is None and steps is None:
                steps = 1
            if micro is None or steps is None:
                known, name = (steps, "gradient_accumulation_steps") if micro is None else (micro, "micro-batch")
                if total % (known * self.world):
                    raise ConfigError(
                        f"DeepSpeed train_batch_size = {total} is not allowed; expected a multiple of "
                        f"{name} {known} x {self.world} ranks"
                    )
                micro = micro or total // (steps * self.world)
                steps = steps or total // (micro * self.world)
            self.out.train_batch_size = total
            _check_total(total, micro, steps, self.world)
        for key, ours, value in ((keys[1], "train.micro_batch_size", micro),
                                 (keys[2], "zero.gradient_accumulation_steps", steps)):  # fmt: skip
            if value is not None and self.data.get(key) != AUTO:
                self.set(ours, value)

    def optimizer(self) -> None:
        block = self.block("optimizer")
        self.check_keys("optimizer", block, {"type", "params"})
        kind = str(block.get("type", "")).lower()
        if kind not in OPTIMIZERS:
            raise _refuse("optimizer.type", block.get("type"), '"Adam", "AdamW" or "SGD" (in any case)')
        params = self.block("optimizer", "params")
        adam = kind != "sgd"
        allowed = {"lr", "weight_decay", "amsgrad", "bias_correction", "adam_w_mode", "betas", "eps"} if adam else {
            "lr", "weight_decay", "momentum", "nesterov", "dampening"}  # fmt: skip
        self.check_keys("optimizer.params", params, allowed)
        where = "optimizer.params."
        self.refuse_unless(where + "amsgrad", params.get("amsgrad", False), False, "AMSGrad is not supported")
        self.refuse_unless(where + "bias_correction", params.get("bias_correction", True), True, "Adam here corrects its bias")
        self.refuse_unless(where + "nesterov", params.get("nesterov", False), False, "Nesterov momentum is not supported")
        self.refuse_unless(where + "dampening", params.get("dampening", 0), 0, "SGD's dampening is not supported")
        adam_w = self.boolean(where + "adam_w_mode", params.get("adam_w_mode", True)) or kind == "adamw"
        self.set("optim.optimizer", "adam" if adam and not adam_w else OPTIMIZERS[kind])
        values = {**DEEPSPEED_DEFAULTS["optimizer.params"], **params}
        for key in ("lr", "weight_decay", *(("eps",) if adam else ("momentum",))):
            if values.get(key, AUTO) != AUTO:
                self.set(f"optim.{key}", self.number(where + key, values[key]))
        betas = values["betas"]
        if adam and betas != AUTO:
            if not (isinstance(betas, list) and len(betas) == 2):
                raise _refuse(where + "betas", betas, "a list of two numbers")
            for i, beta in enumerate(betas):
                self.set(f"optim.beta{i + 1}", self.number(f"{where}betas[{i}]", beta))

    def scheduler(self) -> None:
        block = self.block("scheduler")
        self.check_keys("scheduler", block, {"type", "params"})
        kind = block.get("type")
        if kind not in SCHEDULES:
            raise _refuse("scheduler.type", kind, ", ".join(f'"{k}"' for k in SCHEDULES))
        given = self.block("scheduler", "params")
        allowed = {*DEEPSPEED_DEFAULTS[kind], "last_batch_iteration"} | ({"warmup_max_lr"} if kind == "WarmupLR" else set())
        self.check_keys("scheduler.params", given, allowed | ({"total_num_steps"} if kind != "WarmupLR" else set()))
        params = {**DEEPSPEED_DEFAULTS[kind], **given}
        key = "scheduler.params."
        self.refuse_unless(key + "last_batch_iteration", params.get("last_batch_iteration", -1), -1,
                           "zeropp resumes a schedule from its checkpoint's step")  # fmt: skip
        self.set("optim.schedule", SCHEDULES[kind])
        if params["warmup_num_steps"] != AUTO:
            self.set("optim.warmup_steps", self.integer(key + "warmup_num_steps", params["warmup_num_steps"], 1))
        if params["warmup_type"] not in ("log", "linear"):
            raise _refuse(key + "warmup_type", params["warmup_type"], '"log" or "linear"')
        self.set("optim.warmup_type", params["warmup_type"])
        if params.get("total_num_steps", AUTO) != AUTO:
            self.set("optim.decay_steps", self.integer(key + "total_num_steps", params["total_num_steps"], 1))
        if kind == "WarmupCosineLR":  # ratios of the optimizer's lr
            for ds, ours in (("warmup_min_ratio", "warmup_start_ratio"), ("cos_min_ratio", "min_lr_ratio")):
                if params[ds] != AUTO:
                    self.set(f"optim.{ours}", self.number(key + ds, params[ds]))
            return
        peak = params.get("warmup_max_lr", AUTO)  # WarmupLR without it: the optimizer's lr, as in DeepSpeed
        if peak == AUTO:
            peak = self.out.overrides.get("optim.lr", self.base.optim.lr)
        peak = self.number(key + "warmup_max_lr", peak)
        self.set("optim.lr", peak)
        low = params["warmup_min_lr"]
        ratio = 0.0 if low == AUTO else self.number(key + "warmup_min_lr", low) / peak  # "auto": 0, as HF sets it
        if ratio > 1:
            raise _refuse(key + "warmup_min_lr", low, f"at most warmup_max_lr ({peak:g})")
        self.set("optim.warmup_start_ratio", ratio)
        if kind == "WarmupDecayLR":  # decays back to warmup_min_lr
            self.set("optim.min_lr_ratio", ratio)

    def activation_checkpointing(self) -> None:
        """DeepSpeed's block configures deepspeed.checkpointing, which a model calls per layer; zeropp
        checkpoints every block itself, so the block turns that on and its switches map one to one."""
        block = self.block("activation_checkpointing")
        features = ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization")
        self.check_keys("activation_checkpointing", block, set(features))
        self.set("zero.activation_checkpointing", True)
        for key in features:
            value = block.get(key, False)
            if value != AUTO:
                self.set(f"zero.{key}", self.boolean(f"activation_checkpointing.{key}", value))

    def sequence_parallel(self) -> None:
        size = self.data["sequence_parallel_size"]
        self.refuse_unless(
            "sequence_parallel_size", size, 1,
            "zeropp has no Ulysses sequence parallelism (topology.sequence_parallel is Megatron's, inside tensor parallelism)",
        )  # fmt: skip


def _check_total(total: int, micro: int, steps: int, world: int) -> None:
    if micro * steps * world != total:
        raise ConfigError(
            f"DeepSpeed train_batch_size = {total} is not allowed; expected micro-batch {micro} x gradient "
            f"accumulation {steps} x {world} ranks = {micro * steps * world}"
        )


def _refuse(key: str, value: Any, expected: str) -> ConfigError:
    return ConfigError(f"DeepSpeed {key} = {json.dumps(value, default=str)} is not allowed; expected {expected}")
