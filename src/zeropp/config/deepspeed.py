"""A DeepSpeed JSON config read as zeropp config keys (``zeropp train --deepspeed``, ``zeropp.zero_config_from_deepspeed``).

:func:`translate` gives each key what its row in :mod:`zeropp.config.deepspeed_keys` says, under any of
DeepSpeed's names for it, and returns the zeropp keys set as dotted overrides for ``load_config``. Rules:

- A block the file has means what it means in DeepSpeed, defaults included (a ``zero_optimization`` block
  without ``stage`` is stage 0 and plain ZeRO; ``fp16`` brings DeepSpeed's loss-scale defaults, ``optimizer``
  Adam's). A block the file leaves out, and every ``"auto"``, keeps zeropp's setting (its default, the
  ``--config`` file or a flag), as the Hugging Face integration fills ``"auto"`` from its trainer; the
  bucket sizes' ``"auto"`` come from the model's hidden size h: ``reduce_bucket_size`` h²,
  ``stage3_prefetch_bucket_size`` 0.9·h², ``stage3_param_persistence_threshold`` 10·h.
- DeepSpeed's bucket sizes count a whole collective's elements, zeropp's one rank's: divided by the world size.
- Keys that change nothing here (``NOTED``; ZeRO++ and parameter offload below stage 3, which DeepSpeed
  ignores too) are listed in one note; keys zeropp cannot honour are refused in one line saying why
  (``REFUSED``, and values such as two different NVMe folders); any other key with the keys allowed there.
- Every error names the key as the file wrote it; one that zeropp's own checks raise later (a range, hpZ's
  node layout) names the zeropp key it set too (:meth:`Translation.worded`).
- ``train_batch_size`` must equal micro-batch × accumulation steps × world size; one of the three
  missing is derived from the others as DeepSpeed does.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from zeropp.config import deepspeed_keys as tables
from zeropp.config.deepspeed_keys import AUTO
from zeropp.config.deepspeed_optim import OptimizerBlocks
from zeropp.config.deepspeed_translation import Translation, check_total, shown
from zeropp.config.sections import Config, ZeroConfig
from zeropp.errors import ConfigError


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


class _Reader(OptimizerBlocks):
    def __init__(self, data: dict[str, Any], world_size: int, hidden_size: int | None, base: Config) -> None:
        self.world, self.hidden, self.base = world_size, hidden_size, base
        self.readers = world_size  # the ranks reading different rows: the batch keys count them
        self.written: dict[str, str] = {}  # a key's path in the tables' names -> as the file wrote it
        self.data = self.canonical("", data)
        self.out = Translation(world_size=world_size)

    def canonical(self, where: str, block: dict[str, Any]) -> dict[str, Any]:
        """`block` with DeepSpeed's other names for a key (ALIASES) renamed to the tables' (recorded in `written`)."""
        out: dict[str, Any] = {}
        for key, value in block.items():
            path, written = f"{where}.{key}".lstrip("."), f"{self.name(where)}.{key}".lstrip(".")
            name = tables.ALIASES.get(path, path)
            short = name.rpartition(".")[2]
            if short in out:
                raise ConfigError(f"DeepSpeed {written} and {self.name(name)} are one key; expected one of them")
            if name != path:
                self.written[name] = written
            out[short] = self.canonical(name, value) if name in tables.BLOCKS and isinstance(value, dict) else value
        return out

    def name(self, path: str) -> str:
        """`path` as the file wrote it (an alias where it used one)."""
        for prefix in sorted(self.written, key=len, reverse=True):
            if path == prefix or path.startswith(prefix + "."):
                return self.written[prefix] + path[len(prefix) :]
        return path

    def refuse(self, path: str, value: Any, expected: str) -> ConfigError:
        return ConfigError(f"DeepSpeed {self.name(path)} = {shown(value)} is not allowed; expected {expected}")

    # -- values ----------------------------------------------------------------------------------

    def set(self, dotted: str, value: Any, source: str) -> None:
        """Set zeropp key `dotted` from DeepSpeed key `source` (remembered where the file has it)."""
        self.out.overrides[dotted] = value
        given = self.value_at(source)
        if given is not None:
            self.out.sources[dotted] = (self.name(source), given)

    def value_at(self, path: str) -> Any:
        node: Any = self.data
        for name in path.split("."):
            node = node.get(name) if isinstance(node, dict) else None
        return node

    def integer(self, key: str, value: Any, minimum: int = 0) -> int:
        """DeepSpeed writes sizes as 5e8: an integral float is an integer."""
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise self.refuse(key, value, f"an integer >= {minimum}")
        return value

    def number(self, key: str, value: Any) -> float:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
            raise self.refuse(key, value, "a number >= 0")
        return float(value)

    def boolean(self, key: str, value: Any) -> bool:
        if not isinstance(value, bool):
            raise self.refuse(key, value, "true or false")
        return value

    def block(self, *path: str) -> dict[str, Any]:
        value: Any = self.data
        for name in path:
            value = value.get(name, {})
        if not isinstance(value, dict):
            raise self.refuse(".".join(path), value, "a JSON object")
        return value

    def auto_size(self, key: str, factor: float, power: int) -> int:
        if self.hidden is None:
            raise ConfigError(f'DeepSpeed {self.name(key)} = "auto" needs the model\'s hidden size; pass hidden_size')
        value = int(factor * self.hidden**power)
        self.out.resolved[self.name(key)] = value
        return value

    def note(self, path: str, why: str = "") -> None:
        self.out.noted.append(self.name(path) + (f" ({why})" if why else ""))

    def check_keys(self, where: str, block: Mapping[str, Any], only: set[str] | None = None) -> None:
        """Every key of `block` by its row in the tables: refused ones (unless their value changes nothing) in one line,
        noted ones named in the note, unknown ones (or, with `only`, read keys outside it) with the keys allowed."""
        for key, value in block.items():
            path = f"{where}.{key}".lstrip(".")
            kind = (tables.row(path) or ("unknown",))[0]
            if kind == "refused":
                why, harmless = tables.REFUSED[path]
                if harmless is tables.NEVER or not (
                    value in (harmless, AUTO) or harmless == tables.OFF and _off(value)
                ):
                    raise ConfigError(f"DeepSpeed {self.name(path)} = {shown(value)} is not allowed: {why}")
                if harmless == tables.OFF:
                    self.note(path)
            elif kind == "noted":
                self.note(path)
            elif kind == "unknown" or only is not None and key not in only:
                allowed = (
                    sorted(only | set(tables.NOTED.get(where, ()))) if only is not None else tables.keys_under(where)
                )
                raise ConfigError(
                    f"DeepSpeed key {self.name(path)!r} is not known to zeropp; allowed here: {', '.join(allowed)}"
                )

    # -- blocks, in this order (the scheduler reads the optimizer's lr) ------------------------------

    def run(self) -> Translation:
        handlers: dict[str, Callable[[], None]] = {
            "sequence_parallel_size": self.sequence_parallel, "zero_optimization": self.zero, "fp16": self.precision, "bf16": self.precision,
            "optimizer": self.optimizer, "scheduler": self.scheduler,
            "gradient_clipping": self.clipping, "communication_data_type": self.grad_dtype,
            "data_types": self.grad_dtype, "train_batch_size": self.batch, "train_micro_batch_size_per_gpu": self.batch,
            "gradient_accumulation_steps": self.batch, "activation_checkpointing": self.activation_checkpointing,
            "tensor_parallel": self.tensor_parallel, "expert_parallel": self.expert_parallel,
        }  # fmt: skip
        self.check_keys("", self.data)
        done: list[Callable[[], None]] = []
        for key, handler in handlers.items():
            if key in self.data and handler not in done:
                done.append(handler)
                handler()
        return self.out

    def sequence_parallel(self) -> None:
        """DeepSpeed-Ulysses' size is zeropp's context-parallel size; its ranks share rows, so the batch
        keys count the data-parallel world divided by it (read before them)."""
        value = self.data["sequence_parallel_size"]
        if value != AUTO:
            size = self.integer("sequence_parallel_size", value, 1)
            ours = self.base.topology.context_parallel_size  # the world counted its runs already
            if ours not in (1, size):
                raise ConfigError(
                    f"DeepSpeed sequence_parallel_size = {size} is not allowed with topology.context_parallel_size "
                    f"= {ours}; expected {ours} (or leave one of them out)"
                )
            self.set("topology.context_parallel_size", size, "sequence_parallel_size")
            if ours == 1:
                self.readers = self.out.world_size = max(1, self.world // size)

    def expert_parallel(self) -> None:
        """DeepSpeed's AutoEP block: its size, where enabled, is zeropp's expert-parallel size."""
        block = self.block("expert_parallel")
        self.check_keys("expert_parallel", block)
        size = block.get("autoep_size", 1)
        if block.get("enabled", False) and size != AUTO:
            size = self.integer("expert_parallel.autoep_size", size, 1)
            self.set("topology.expert_parallel_size", size, "expert_parallel.autoep_size")

    def tensor_parallel(self) -> None:
        """DeepSpeed's AutoTP block: its size is zeropp's tensor-parallel size, from transformers' plans."""
        block = self.block("tensor_parallel")
        self.check_keys("tensor_parallel", block)
        size = block.get("autotp_size", AUTO)
        if size != AUTO:
            self.set("topology.tensor_parallel_size", size, "tensor_parallel.autotp_size")

    def zero(self) -> None:
        given = self.block("zero_optimization")
        self.check_keys("zero_optimization", given)
        values = {**tables.DEEPSPEED_DEFAULTS["zero_optimization"], **given}
        key = "zero_optimization."
        stage = self.base.zero.stage
        if values["stage"] != AUTO:
            stage = self.integer(key + "stage", values["stage"])
            if stage > 3:
                raise self.refuse(key + "stage", stage, "one of 0, 1, 2, 3")
            self.set("zero.stage", stage, key + "stage")
        for ds, ours in (
            ("reduce_bucket_size", "reduce_bucket_numel"),
            ("allgather_bucket_size", "allgather_bucket_numel"),
        ):
            value = values[ds]
            if value == AUTO and ds == "allgather_bucket_size":  # the HF integration leaves it: zeropp's
                continue
            size = self.auto_size(key + ds, 1.0, 2) if value == AUTO else self.integer(key + ds, value, 1)
            self.set(f"zero.{ours}", max(1, size // self.world), key + ds)
        ds = "stage3_prefetch_bucket_size"
        if ds in given:
            size = self.auto_size(key + ds, 0.9, 2) if given[ds] == AUTO else self.integer(key + ds, given[ds])
            if size == 0:
                self.set("zero.prefetch", 0, key + ds)
            else:
                self.note(key + ds, "zero.prefetch counts units ahead")
        ds = "stage3_param_persistence_threshold"
        value = values[ds]
        threshold = self.auto_size(key + ds, 10, 1) if value == AUTO else self.integer(key + ds, value)
        self.set("zero.persistence_threshold", threshold, key + ds)
        zeropp = {
            "zero_quantized_weights": ("zero.quantized_weights", self.boolean, False),
            "zero_hpz_partition_size": ("zero.hpz_partition_size", self.integer, 1),
            "zero_quantized_gradients": ("zero.quantized_gradients", self.boolean, False),
            "zero_quantized_nontrainable_weights": ("zero.quantized_nontrainable_weights", self.boolean, False),
        }
        for ds, (ours, read, off) in zeropp.items():
            value = read(key + ds, values[ds])
            value = max(1, value) if ds == "zero_hpz_partition_size" else value  # DeepSpeed's 0 is off, as 1
            if stage < 3 and value != off:  # DeepSpeed reads ZeRO++ at stage 3 only
                self.note(key + ds, f"stage {stage}: ZeRO++ works at stage 3")
                value = off
            self.set(ours, value, key + ds)
        for ds, ours in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_params")):  # former names
            if self.boolean(key + ds, values.get(ds, False)):
                self.offload_device(key + ds, ours, "cpu", stage)
        for ds, ours in (("offload_optimizer", "offload_optimizer"), ("offload_param", "offload_params")):
            if ds in given:
                self.offload(ds, ours, stage)

    def offload(self, ds: str, ours: str, stage: int) -> None:
        where = f"zero_optimization.{ds}"
        block = self.block("zero_optimization", ds)
        self.check_keys(where, block)
        device = block.get("device", "none")
        if device not in ("cpu", "none", "nvme"):
            raise self.refuse(f"{where}.device", device, '"cpu", "nvme" or "none"')
        for key, flat in (("nvme_path", "offload_path"), ("buffer_count", "offload_buffer_count")):
            if key not in block:
                continue
            if device != "nvme":  # DeepSpeed reads them for nvme only
                self.note(f"{where}.{key}", f'device "{device}"')
                continue
            earlier = self.out.overrides.get(f"zero.{flat}")  # offload_optimizer's: zeropp keeps one folder and count
            if earlier is None or earlier == block[key]:
                self.set(f"zero.{flat}", block[key], f"{where}.{key}")
            elif key == "nvme_path":
                raise self.refuse(
                    f"{where}.{key}", block[key], f"{shown(earlier)}, offload_optimizer's: one offload_path"
                )
            else:
                self.note(f"{where}.{key}", f"zero.offload_buffer_count = {earlier}, offload_optimizer's")
        self.offload_device(f"{where}.device", ours, device, stage)

    def offload_device(self, path: str, ours: str, device: str, stage: int) -> None:
        if ours == "offload_params" and stage < 3 and device != "none":  # DeepSpeed offloads parameters at stage 3 only
            self.note(path, f"stage {stage}: parameters are offloaded at stage 3")
            device = "none"
        self.set(f"zero.{ours}", device, path)

    def precision(self) -> None:
        enabled = {}
        present = [name for name in ("fp16", "bf16") if name in self.data]
        for name in present:
            block = self.block(name)
            self.check_keys(name, block)
            if name == "fp16":
                self.loss_scale({**tables.DEEPSPEED_DEFAULTS["fp16"], **block})
            else:
                self.bf16_states(block)
            if block.get("enabled", False) != AUTO:
                enabled[name] = self.boolean(f"{name}.enabled", block.get("enabled", False))
        on = [kind for kind, value in enabled.items() if value]
        if len(on) > 1:
            raise ConfigError(
                f"DeepSpeed fp16.enabled and {self.name('bf16')}.enabled are both true; expected at most one"
            )
        if on:
            self.set("zero.precision", on[0], f"{on[0]}.enabled")
        elif len(enabled) == len(present):  # every block says false: DeepSpeed trains in fp32
            self.set("zero.precision", "fp32", f"{present[0]}.enabled")

    def bf16_states(self, bf16: dict[str, Any]) -> None:
        """DeepSpeed's bf16 masters (and gradients, bf16 already here) and bf16 optimizer states, which
        DeepSpeed allows only with them."""
        masters = self.boolean("bf16.bf16_master_weights_and_grads", bf16.get("bf16_master_weights_and_grads", False))
        states = self.boolean("bf16.bf16_optimizer_states", bf16.get("bf16_optimizer_states", False))
        if states and not masters:
            raise self.refuse(
                "bf16.bf16_optimizer_states", True, "false unless bf16.bf16_master_weights_and_grads is true"
            )
        for key, ours, on in (("bf16_master_weights_and_grads", "master_dtype", masters),
                              ("bf16_optimizer_states", "optimizer_state_dtype", states)):  # fmt: skip
            if on:
                self.set(f"zero.{ours}", "bf16", f"bf16.{key}")

    def loss_scale(self, fp16: dict[str, Any]) -> None:
        """Set even when fp16 is off (zeropp ignores it then), so a later --precision fp16 uses it."""
        prefix, key = "zero.loss_scale.", "fp16."
        static = self.number(key + "loss_scale", fp16["loss_scale"])
        power = self.integer(key + "initial_scale_power", fp16["initial_scale_power"])
        initial = key + ("loss_scale" if static > 0 else "initial_scale_power")
        self.set(prefix + "initial_scale", static if static > 0 else float(2**power), initial)
        if static > 0:  # DeepSpeed's static scale: overflowing steps are skipped, the scale stays
            self.set(prefix + "growth_factor", 1.0, key + "loss_scale")
        window = self.integer(key + "loss_scale_window", fp16["loss_scale_window"], 1)
        self.set(prefix + "growth_interval", window, key + "loss_scale_window")
        self.set(prefix + "hysteresis", self.integer(key + "hysteresis", fp16["hysteresis"], 1), key + "hysteresis")
        consecutive = self.boolean(key + "consecutive_hysteresis", fp16["consecutive_hysteresis"])
        self.set(prefix + "consecutive_hysteresis", consecutive, key + "consecutive_hysteresis")
        floor = static if static > 0 else self.number(key + "min_loss_scale", fp16["min_loss_scale"])
        self.set(
            prefix + "min_scale", floor, key + ("loss_scale" if static > 0 else "min_loss_scale")
        )  # a static scale never backs off

    def grad_dtype(self) -> None:
        values = {"communication_data_type": self.data.get("communication_data_type", AUTO)}
        if "data_types" in self.data:
            self.check_keys("data_types", self.block("data_types"))
            values["data_types.grad_accum_dtype"] = self.block("data_types").get("grad_accum_dtype", AUTO)
        for key, value in values.items():
            if value == AUTO:
                continue
            if value not in tables.DTYPES:
                raise self.refuse(key, value, ", ".join(f'"{d}"' for d in tables.DTYPES))
            self.set("zero.grad_dtype", tables.DTYPES[value], key)

    def clipping(self) -> None:
        value = self.data["gradient_clipping"]
        if value != AUTO:
            norm = self.number("gradient_clipping", value)
            self.set("zero.max_grad_norm", norm if norm > 0 else None, "gradient_clipping")

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
                if total % (known * self.readers):
                    raise ConfigError(
                        f"DeepSpeed train_batch_size = {total} is not allowed; expected a multiple of "
                        f"{name} {known} x {self.readers} ranks"
                    )
                micro = micro or total // (steps * self.readers)
                steps = steps or total // (micro * self.readers)
            self.out.train_batch_size = total
            check_total(total, micro, steps, self.readers)
        for key, ours, value in ((keys[1], "train.micro_batch_size", micro),
                                 (keys[2], "zero.gradient_accumulation_steps", steps)):  # fmt: skip
            if value is not None and self.data.get(key) != AUTO:
                self.set(ours, value, key)

    def activation_checkpointing(self) -> None:
        """DeepSpeed's block configures deepspeed.checkpointing, which a model calls per layer; zeropp
        checkpoints every block itself, so the block turns that on and its switches map one to one."""
        block = self.block("activation_checkpointing")
        self.check_keys("activation_checkpointing", block)
        self.set("zero.activation_checkpointing", True, "activation_checkpointing")
        for key in ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization"):
            value = block.get(key, False)
            if value != AUTO:
                path = f"activation_checkpointing.{key}"
                self.set(f"zero.{key}", self.boolean(path, value), path)


def _off(value: Any) -> bool:
    """A block that turns its feature off (``{"enabled": false}``)."""
    return isinstance(value, dict) and value.get("enabled") is False
