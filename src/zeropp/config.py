"""Typed configuration, loaded from TOML / JSON / dict and validated before any process group exists.

Every error is a one-line :class:`ConfigError` naming the key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


class ConfigError(ValueError):
    """A configuration value is not allowed. The message is one line: key, value, what is allowed."""


Precision = Literal["fp32", "bf16", "fp16"]

MAX_TIMEOUT_S = 1e7  # ~115 days; torch.distributed's timeouts overflow far above
MAX_SHARD_ALIGNMENT = 2**16  # elements; padding costs up to world size x this per unit

# ZeroConfig keys that turn on all three ZeRO++ switches (qwZ, hpZ over each node, qgZ): zeropp train's
# default at stage 3, the estimator's ZeRO++ column, the benchmarks' "ZeRO++" configuration
ZEROPP_SWITCHES: dict[str, Any] = {"quantized_weights": True, "hpz_partition_size": 0, "quantized_gradients": True}


def setting(default: Any, meaning: str) -> Any:
    """A config key: its default and its one-line meaning (the flag's help, ``leaf_keys``)."""
    return field(default=default, metadata={"help": meaning})


@dataclass
class LossScaleConfig:
    """Dynamic loss scaling for fp16 (ignored for fp32 and bf16)."""

    initial_scale: float = setting(2.0**16, "fp16 loss scale to start from")
    growth_factor: float = setting(2.0, "multiply the scale by this after growth_interval steps without overflow")
    backoff_factor: float = setting(0.5, "multiply the scale by this after an overflow (the step is skipped)")
    growth_interval: int = setting(1000, "steps without overflow before the scale grows")
    min_scale: float = setting(1.0, "the scale never falls below this")

    def validate(self) -> None:
        _require(self.initial_scale > 0, "zero.loss_scale.initial_scale", self.initial_scale, "a number > 0")
        _require(self.growth_factor >= 1, "zero.loss_scale.growth_factor", self.growth_factor, "a number >= 1")
        _require(
            0 < self.backoff_factor < 1, "zero.loss_scale.backoff_factor", self.backoff_factor, "a number in (0, 1)"
        )
        _require(self.growth_interval >= 1, "zero.loss_scale.growth_interval", self.growth_interval, "an integer >= 1")
        _require(self.min_scale > 0, "zero.loss_scale.min_scale", self.min_scale, "a number > 0")
        _check_finite(self, "zero.loss_scale")  # last: a range check names nan's range first


@dataclass
class ZeroConfig:
    """What the engine partitions and how it communicates."""

    # other names accepted for a key (in files, dicts and as flags): DeepSpeed's, and former names
    ALIASES: ClassVar[dict[str, str]] = {
        "zero_quantized_weights": "quantized_weights",
        "zero_hpz_partition_size": "hpz_partition_size",
        "zero_quantized_gradients": "quantized_gradients",
        "qgz_pipeline_stages": "qgz_pipeline_chunks",
    }

    stage: int = setting(3, "ZeRO stage: 0 replicates everything, 1 shards optimizer states, 2 and gradients, 3 and weights")
    precision: Precision = setting("fp32", "compute dtype of weights and activations (masters stay fp32)")
    grad_dtype: Precision | None = setting(
        None, "dtype gradients are reduced and accumulated in; unset: the compute dtype (the ZeRO paper's 2 bytes)"
    )
    reduce_bucket_numel: int = setting(2**24, "most elements per rank in one reduce-scatter call (constant-size buffers)")
    allgather_bucket_numel: int = setting(2**24, "most elements per rank in one all-gather call")
    prefetch: int = setting(1, "stage 3: how many units ahead, in recorded execution order, to all-gather asynchronously")
    persistence_threshold: int = setting(
        0, "stage 3: units of at most this many elements stay gathered (not re-gathered every pass)"
    )
    shard_alignment: int = setting(32, "every rank's shard is a multiple of this many elements")
    gradient_accumulation_steps: int = setting(1, "micro-batches per optimizer step")
    max_grad_norm: float | None = setting(None, "clip the global gradient norm to this; unset: no clipping")
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    quantized_weights: bool = setting(False, "qwZ (ZeRO++, stage 3): all-gather weights block-quantized")
    weight_bits: Literal[8, 4] = setting(8, "qwZ: bits per quantized weight")
    weight_block_size: int = setting(256, "qwZ: weights per quantization block (one scale each)")
    weight_quantization: Literal["block", "tensor"] = setting(
        "block", "qwZ: block, one scale per block; tensor, one per shard (the comparison baseline)"
    )
    hpz_partition_size: int = setting(
        1, "hpZ (ZeRO++): secondary weight partition over groups of this many consecutive ranks (1: off, 0: a node)"
    )
    quantized_gradients: bool = setting(False, "qgZ (ZeRO++, stage 3): reduce gradients by a quantized two-hop all-to-all")
    gradient_bits: Literal[4, 8] = setting(4, "qgZ: bits per quantized gradient")
    gradient_block_size: int = setting(256, "qgZ: gradients per quantization block")
    qgz_pipeline_chunks: int = setting(2, "qgZ: chunks per bucket, pipelined (the paper's pipeline stages)")
    quant_backend: Literal["auto", "torch", "triton"] = setting(
        "auto", "quantization kernels: auto (Triton on CUDA when available, else torch), or force one"
    )
    offload_optimizer: Literal["none", "cpu"] = setting(
        "none", "ZeRO-Offload: cpu keeps the fp32 master shard and optimizer state in host memory and steps there"
    )
    offload_params: Literal["none", "cpu"] = setting(
        "none", "ZeRO-Offload (stage 3, with offload_optimizer): cpu keeps the compute-dtype shards in host memory"
    )
    compile: bool = setting(
        False, "torch.compile every unit's forward that calls no other unit (the blocks); hooks stay eager"
    )

    def validate(self) -> None:
        _check_choices(self, "zero")
        _require(self.stage in (0, 1, 2, 3), "zero.stage", self.stage, "one of 0, 1, 2, 3")
        for key in ("reduce_bucket_numel", "allgather_bucket_numel", "shard_alignment", "gradient_accumulation_steps"):
            value = getattr(self, key)
            _require(value >= 1, f"zero.{key}", value, "an integer >= 1")
        _require(
            self.shard_alignment <= MAX_SHARD_ALIGNMENT,
            "zero.shard_alignment",
            self.shard_alignment,
            f"an integer from 1 to {MAX_SHARD_ALIGNMENT} (every shard is padded to a multiple of it)",
        )
        for key in ("prefetch", "persistence_threshold"):
            value = getattr(self, key)
            _require(value >= 0, f"zero.{key}", value, "an integer >= 0")
        if self.max_grad_norm is not None:
            _require(self.max_grad_norm > 0, "zero.max_grad_norm", self.max_grad_norm, "a number > 0, or unset")
        if self.grad_dtype not in (None, "fp32", self.precision):  # fp16 gradients need the fp16 loss scaler
            _require(False, "zero.grad_dtype", self.grad_dtype, f"unset, 'fp32' or {self.precision!r} (the precision)")
        for key in ("weight_block_size", "gradient_block_size", "qgz_pipeline_chunks"):
            value = getattr(self, key)
            _require(value >= 1, f"zero.{key}", value, "an integer >= 1")
        _require(
            self.hpz_partition_size >= 0,
            "zero.hpz_partition_size",
            self.hpz_partition_size,
            "an integer >= 0 (1: off, 0: the ranks of one node, N: groups of N ranks)",
        )
        if self.stage != 3:
            for key, off in (("quantized_weights", False), ("quantized_gradients", False), ("hpz_partition_size", 1)):
                value = getattr(self, key)
                _require(
                    value == off, f"zero.{key}", value, f"{off!r} unless zero.stage = 3 (ZeRO++ builds on stage 3)"
                )
        if self.offload_params != "none":
            _require(self.stage == 3, "zero.offload_params", self.offload_params, "'none' unless zero.stage = 3")
            _require(
                self.offload_optimizer != "none",
                "zero.offload_params",
                self.offload_params,
                "'none' unless zero.offload_optimizer is 'cpu' too",
            )
        _check_finite(self, "zero")
        self.loss_scale.validate()


@dataclass
class TopologyConfig:
    """How ranks map to nodes. Real nodes come from torchrun; `nodes` simulates them on one machine."""

    nodes: int | None = setting(
        None, "simulate this many nodes on one machine (consecutive ranks share a node); unset: torchrun's nodes"
    )
    backend: Literal["auto", "gloo", "nccl"] = setting("auto", "collective backend; auto: NCCL with CUDA, else gloo")
    timeout_s: float = setting(300.0, "seconds a collective may wait for the other ranks before a one-line error")

    def validate(self) -> None:
        _check_choices(self, "topology")
        if self.nodes is not None:
            _require(self.nodes >= 1, "topology.nodes", self.nodes, "an integer >= 1, or unset")
        _require(
            0 < self.timeout_s <= MAX_TIMEOUT_S,
            "topology.timeout_s",
            self.timeout_s,
            f"a number of seconds > 0 and <= {MAX_TIMEOUT_S:g}",
        )
        _check_finite(self, "topology")


@dataclass
class ModelConfig:
    """The embedded byte-level GPT (see zeropp.models.gpt)."""

    preset: Literal["tiny", "small", "medium"] = setting("small", "model size; the keys below override its values")
    n_layer: int | None = setting(None, "transformer blocks; unset: the preset's")
    n_head: int | None = setting(None, "attention heads, a divisor of d_model; unset: the preset's")
    d_model: int | None = setting(None, "width; unset: the preset's")
    block_size: int | None = setting(None, "context length in bytes; unset: the preset's")

    def validate(self) -> None:
        _check_choices(self, "model")
        for key in ("n_layer", "n_head", "d_model", "block_size"):
            value = getattr(self, key)
            if value is not None:
                _require(value >= 1, f"model.{key}", value, "an integer >= 1, or unset for the preset's value")


@dataclass
class OptimConfig:
    lr: float = setting(3e-3, "peak learning rate (linear warm-up, then cosine decay to a tenth)")
    weight_decay: float = setting(0.1, "AdamW's decoupled weight decay")
    beta1: float = setting(0.9, "AdamW's first-moment decay")
    beta2: float = setting(0.95, "AdamW's second-moment decay")
    warmup_steps: int = setting(20, "steps of linear learning-rate warm-up")

    def validate(self) -> None:
        _require(self.lr > 0, "optim.lr", self.lr, "a number > 0")
        _require(self.weight_decay >= 0, "optim.weight_decay", self.weight_decay, "a number >= 0")
        _require(0 <= self.beta1 < 1, "optim.beta1", self.beta1, "a number in [0, 1)")
        _require(0 <= self.beta2 < 1, "optim.beta2", self.beta2, "a number in [0, 1)")
        _require(self.warmup_steps >= 0, "optim.warmup_steps", self.warmup_steps, "an integer >= 0")
        _check_finite(self, "optim")


@dataclass
class TrainConfig:
    steps: int = setting(200, "optimizer steps to train")
    micro_batch_size: int = setting(4, "sequences per rank per micro-batch")
    seed: int = setting(0, "seed of the weights and the data order")
    eval_interval: int = setting(50, "evaluate the validation loss every this many steps, and after the last")
    eval_batches: int = setting(8, "validation micro-batches per evaluation, per rank")
    init: Literal["meta", "eager"] = setting(
        "meta", "meta: build the model on the meta device, each rank initializes it unit by unit (seeded per unit); "
        "eager: build it whole on every rank and synchronize it from rank 0"
    )
    init_from: str | None = setting(
        None, "start from these weights: a safetensors file, or a folder with model.safetensors or its index"
    )
    max_consecutive_skipped_steps: int = setting(
        50, "fp16: stop the run after this many optimizer steps in a row skipped for overflowing gradients"
    )

    def validate(self) -> None:
        _check_choices(self, "train")
        for key in ("steps", "micro_batch_size", "eval_interval", "eval_batches", "max_consecutive_skipped_steps"):
            value = getattr(self, key)
            _require(value >= 1, f"train.{key}", value, "an integer >= 1")


@dataclass
class CheckpointConfig:
    """Sharded checkpoints of `zeropp train` (see zeropp.checkpoint)."""

    checkpoint_dir: str | None = setting(None, "folder of the sharded checkpoints (step-NNNNNNNN)")
    save_interval: int = setting(
        0, "with checkpoint_dir: save every this many steps and after the last one (0: after the last one only)"
    )
    resume: str | None = setting(
        None, "auto: the latest checkpoint in checkpoint_dir, or a fresh start if none; PATH: that checkpoint"
    )
    keep_last: int = setting(3, "published checkpoints to keep (0: all)")

    def validate(self) -> None:
        for key in ("save_interval", "keep_last"):
            value = getattr(self, key)
            _require(value >= 0, f"checkpoint.{key}", value, "an integer >= 0")
        if self.save_interval or self.resume == "auto":
            what = "checkpoint.save_interval" if self.save_interval else "checkpoint.resume = 'auto'"
            _require(self.checkpoint_dir is not None, "checkpoint.checkpoint_dir", None, f"a directory when {what}")


@dataclass
class Config:
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def validate(self) -> Config:
        for section in dataclasses.fields(self):
            getattr(self, section.name).validate()
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_choices(section: Any, prefix: str) -> None:
    """Refuse a value outside its Literal type, also for configs built in code rather than loaded."""
    for name, hint in typing.get_type_hints(type(section)).items():
        options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        for option in options:
            if typing.get_origin(option) is Literal:
                value = getattr(section, name)
                allowed = typing.get_args(option)
                if value not in allowed and not (value is None and type(None) in options):
                    expected = f"one of {', '.join(map(repr, allowed))}"
                    _require(False, f"{prefix}.{name}", value, expected)


def _check_finite(section: Any, prefix: str) -> None:
    """Refuse inf and nan in every float key (``--lr inf`` parses, and would train to nan)."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            _require(False, f"{prefix}.{f.name}", value, "a finite number")


def _require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key} = {value!r} is not allowed; expected {allowed}")


def from_dict(cls: type, data: Mapping[str, Any], prefix: str = "") -> Any:
    """Build dataclass `cls` from a (nested) mapping, checking every key and type; does not validate ranges."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} = {data!r} is not allowed; expected a table")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    aliases = getattr(cls, "ALIASES", {})
    for key, value in data.items():
        key = aliases.get(key, key)
        if key not in names:
            raise ConfigError(f"unknown key '{prefix}{key}'; allowed keys: {', '.join(names)}")
        kwargs[key] = _coerce(f"{prefix}{key}", value, hints[key])
    return cls(**kwargs)


def _coerce(key: str, value: Any, hint: Any) -> Any:
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, prefix=f"{key}.")
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in (o for o in options if o is not type(None)):
            try:
                return _coerce(key, value, option)
            except ConfigError as error:
                errors.append(str(error))
        raise ConfigError(errors[0] + (", or unset" if type(None) in options else ""))
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            raise ConfigError(f"{key} = {value!r} is not allowed; expected one of {', '.join(map(repr, allowed))}")
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, bool, str) and (type(value) is not hint):
        raise ConfigError(f"{key} = {value!r} has type {type(value).__name__}; expected {hint.__name__}")
    return value


def load_config(
    source: str | Path | Mapping[str, Any] | None = None,
    overrides: Mapping[str, Any] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> Config:
    """Load a Config from a TOML/JSON file or a dict, apply dotted-key overrides, validate, return it.

    `defaults` (dotted keys) replace the dataclass defaults where neither the source nor the
    overrides set the key.
    """
    if source is None:
        data: dict[str, Any] = {}
    elif isinstance(source, Mapping):
        data = _deep_copy(source)
    else:
        data = _read_config_file(Path(source))
    for dotted, value in (defaults or {}).items():
        *sections, leaf = dotted.split(".")
        node = data
        for section in sections:
            node = node.get(section) if isinstance(node.get(section), dict) else node.setdefault(section, {})
        node.setdefault(leaf, value)
    for dotted, value in (overrides or {}).items():
        *sections, leaf = dotted.split(".")
        node = data
        for depth, section in enumerate(sections):
            node = node.setdefault(section, {})
            if not isinstance(node, dict):
                where = ".".join(sections[: depth + 1])
                raise ConfigError(f"override {dotted!r} goes through {where} = {node!r}, which is not a table")
        node[leaf] = value
    return from_dict(Config, data).validate()


def _read_config_file(path: Path) -> dict[str, Any]:
    """A TOML or JSON config file's contents; every way it can be unreadable is one ConfigError."""
    where = f"config file {str(path)!r}"
    if path.suffix not in (".toml", ".json"):
        raise ConfigError(f"{where} is not allowed; expected a .toml or .json file")
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise ConfigError(f"{where} {what}; expected a .toml or .json file")
    try:
        text = path.read_text(encoding="utf-8")
        return tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except OSError as error:
        raise ConfigError(f"{where} cannot be read ({error.strerror})") from None
    except UnicodeDecodeError as error:
        raise ConfigError(f"{where} is not UTF-8 text (byte {error.start}); expected UTF-8") from None
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"{where} does not parse: {error}") from None


def _deep_copy(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in data.items()}


class Key(typing.NamedTuple):
    """A leaf config key as the command line shows it."""

    dotted: str  # zero.stage
    hint: Any  # its type
    meaning: str  # one line
    default: Any


def leaf_keys(cls: type = Config, prefix: str = "") -> dict[str, Key]:
    """Map each leaf field name to its Key: the CLI's flags mirror these names."""
    out: dict[str, Key] = {}
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(hint):
            out.update(leaf_keys(hint, f"{prefix}{f.name}."))
        else:
            out[f.name] = Key(f"{prefix}{f.name}", hint, f.metadata.get("help", ""), f.default)
    return out
