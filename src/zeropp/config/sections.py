"""Typed configuration, loaded from TOML / JSON / dict and validated before any process group exists.

Every error is a one-line :class:`ConfigError` naming the key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from zeropp.config.model import ModelConfig
from zeropp.config.policies import (
    FLAT_KEYS,
    POLICIES,
    ActivationCheckpointPolicy,
    OffloadPolicy,
    OuterLoop,
    QuantizedGradients,
    QuantizedWeights,
    accepts_flat_keys,
)
from zeropp.config.schema import check_choices, check_finite, deep_copy, from_dict, read_config_file, require, setting
from zeropp.errors import ConfigError

Precision = Literal["fp32", "bf16", "fp16"]

MAX_TIMEOUT_S = 1e7  # ~115 days; torch.distributed's timeouts overflow far above
MAX_SHARD_ALIGNMENT = 2**16  # elements; padding costs up to world size x this per unit

# ZeroConfig keys that turn on all three ZeRO++ switches (qwZ, hpZ over each node, qgZ): zeropp train's
# default at stage 3, the estimator's ZeRO++ column, the benchmarks' "ZeRO++" configuration
ZEROPP_SWITCHES: dict[str, Any] = {"quantized_weights": True, "hpz_partition_size": 0, "quantized_gradients": True}


@dataclass
class LossScaleConfig:
    """Dynamic loss scaling for fp16 (ignored for fp32 and bf16)."""

    initial_scale: float = setting(2.0**16, "fp16 loss scale to start from")
    growth_factor: float = setting(2.0, "multiply the scale by this after growth_interval steps without overflow")
    backoff_factor: float = setting(0.5, "multiply the scale by this after an overflow (the step is skipped)")
    growth_interval: int = setting(1000, "steps without overflow before the scale grows")
    min_scale: float = setting(1.0, "the scale never falls below this")
    hysteresis: int = setting(1, "overflows (each a skipped step) before the scale backs off; reset when it grows")
    consecutive_hysteresis: bool = setting(False, "reset the hysteresis after every step without overflow instead")

    def validate(self) -> None:
        require(self.initial_scale > 0, "zero.loss_scale.initial_scale", self.initial_scale, "a number > 0")
        require(self.growth_factor >= 1, "zero.loss_scale.growth_factor", self.growth_factor, "a number >= 1")
        require(
            0 < self.backoff_factor < 1, "zero.loss_scale.backoff_factor", self.backoff_factor, "a number in (0, 1)"
        )
        for key in ("growth_interval", "hysteresis"):
            value = getattr(self, key)
            require(value >= 1, f"zero.loss_scale.{key}", value, "an integer >= 1")
        require(self.min_scale > 0, "zero.loss_scale.min_scale", self.min_scale, "a number > 0")
        check_finite(self, "zero.loss_scale")  # last: a range check names nan's range first


@accepts_flat_keys
@dataclass
class ZeroConfig:
    """What the engine partitions and how it communicates; ZeRO++, offload and activation checkpointing as
    policies (:mod:`zeropp.config.policies`), each field also accepted by its flat key (``weight_bits=4``)."""

    # other names accepted for a key (in files, dicts and as flags): DeepSpeed's, and former names
    ALIASES: ClassVar[dict[str, str]] = {
        "zero_quantized_weights": "quantized_weights",
        "zero_hpz_partition_size": "hpz_partition_size",
        "zero_quantized_gradients": "quantized_gradients",
        "qgz_pipeline_stages": "qgz_pipeline_chunks",
        # DeepSpeed's zeropp_loco_param names (LoCo error feedback for qgZ)
        "err_beta": "gradient_error_beta",
        "reset_T": "gradient_error_reset_steps",
    }
    FLAT_KEYS: ClassVar[dict[str, tuple[str, str]]] = FLAT_KEYS  # weight_bits -> ("qwz", "bits"), ...

    stage: int = setting(
        3, "ZeRO stage: 0 replicates everything, 1 shards optimizer states, 2 and gradients, 3 and weights"
    )
    precision: Precision = setting("fp32", "compute dtype of weights and activations (masters stay fp32)")
    grad_dtype: Precision | None = setting(
        None, "dtype gradients are reduced and accumulated in; unset: the compute dtype (the ZeRO paper's 2 bytes)"
    )
    reduce_bucket_numel: int = setting(
        2**24, "most elements per rank in one reduce-scatter call (constant-size buffers)"
    )
    allgather_bucket_numel: int = setting(2**24, "most elements per rank in one all-gather call")
    prefetch: int = setting(
        1, "stage 3: how many units ahead, in recorded execution order, to all-gather asynchronously"
    )
    persistence_threshold: int = setting(
        0, "stage 3: units of at most this many elements stay gathered (not re-gathered every pass)"
    )
    shard_alignment: int = setting(32, "every rank's shard is a multiple of this many elements")
    gradient_accumulation_steps: int = setting(1, "micro-batches per optimizer step")
    max_grad_norm: float | None = setting(None, "clip the global gradient norm to this; unset: no clipping")
    step_in_backward: bool = setting(
        False, "step each unit's shard on a thread as soon as its last micro-batch's gradient is reduced, while backward "
        "goes on (the same weights; with max_grad_norm the step waits for the norm, after backward, as without it)",
    )  # fmt: skip
    optimizer_state_dtype: Literal["fp32", "bf16"] = setting(
        "fp32", "dtype of Adam's two moments (bf16: 12 bytes of model states per parameter instead of 16; Adam, AdamW)"
    )
    master_dtype: Literal["fp32", "bf16"] = setting(
        "fp32",
        "dtype of the master weights (bf16, with precision bf16: Kahan-compensated updates, a bf16 compensation "
        "per parameter; at stages 0 and 3 the master is the bf16 weights: 10 bytes per parameter with bf16 states)",
    )
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    qwz: QuantizedWeights = field(default_factory=QuantizedWeights)
    hpz_partition_size: int = setting(
        1, "hpZ (ZeRO++): secondary weight partition over groups of this many consecutive ranks (1: off, 0: a node)"
    )
    qgz: QuantizedGradients = field(default_factory=QuantizedGradients)
    quantized_nontrainable_weights: bool = setting(
        False,
        "stage 3: frozen parameters' shards (and hpZ's copy) stored quantized once (qwZ's block size), gathered as they are",
    )
    nontrainable_weight_bits: Literal[8, 4] = setting(
        8, "bits per stored frozen weight with quantized_nontrainable_weights"
    )
    quant_backend: Literal["auto", "torch", "triton"] = setting(
        "auto", "quantization kernels: auto (Triton on CUDA when available, else torch), or force one"
    )
    offload: OffloadPolicy = field(default_factory=OffloadPolicy)
    compile: bool = setting(
        False, "torch.compile every unit's forward that calls no other unit (the blocks); hooks stay eager"
    )
    activations: ActivationCheckpointPolicy = field(default_factory=ActivationCheckpointPolicy)
    outer: OuterLoop = field(default_factory=OuterLoop)
    contiguous_memory_optimization: bool = setting(
        False, "MD: gradient buffers (and Pa's checkpoint partitions) in buffers preallocated after the first step"
    )
    optimizer_path: Literal["auto", "flat", "whole"] = setting(
        "auto",
        "auto: an element-wise optimizer steps each parameter's piece of the shards in its own group, skipping a "
        "parameter no rank gave a gradient as torch does (the disk tier and bf16 states: flat), any other "
        "whole parameters on owner ranks; flat: one group on each unit's flat shard, a parameter without a "
        "gradient stepped with a zero one (DeepSpeed's way); whole: every optimizer on owner ranks",
    )
    sequence_check_interval: int = setting(
        100, "compare the ranks' collective sequences after the first optimizer step and every this many (0: never)"
    )
    flight_record_dir: str | None = setting(
        None, "folder where each rank writes its last collectives on a timeout, an error or a signal; unset: none"
    )

    def key(self, group: str) -> Callable[[str], str]:
        """How an error names policy `group`'s fields: as written (flat ``zero.weight_bits`` or grouped
        ``zero.qwz.bits``); flat where neither was written."""
        spelled = getattr(self, "_spelled", {})
        return lambda name: f"zero.{spelled.get(f'{group}.{name}', f'{group}.{name}')}"

    def as_flat(self) -> dict[str, Any]:
        """Every key by its flat name, as ``zeropp train``'s flags and ``ZEROPP_SWITCHES`` spell them:
        {'stage': 3, ..., 'quantized_weights': False, 'weight_bits': 8, ...}."""
        core = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in POLICIES}
        return core | {flat: getattr(getattr(self, group), name) for flat, (group, name) in FLAT_KEYS.items()}

    def validate(self) -> None:
        check_choices(self, "zero")
        require(self.stage in (0, 1, 2, 3), "zero.stage", self.stage, "one of 0, 1, 2, 3")
        for key in ("reduce_bucket_numel", "allgather_bucket_numel", "shard_alignment", "gradient_accumulation_steps"):
            value = getattr(self, key)
            require(value >= 1, f"zero.{key}", value, "an integer >= 1")
        require(
            self.shard_alignment <= MAX_SHARD_ALIGNMENT,
            "zero.shard_alignment",
            self.shard_alignment,
            f"an integer from 1 to {MAX_SHARD_ALIGNMENT} (every shard is padded to a multiple of it)",
        )
        for key in ("prefetch", "persistence_threshold", "sequence_check_interval"):
            value = getattr(self, key)
            require(value >= 0, f"zero.{key}", value, "an integer >= 0")
        if self.max_grad_norm is not None:
            require(self.max_grad_norm > 0, "zero.max_grad_norm", self.max_grad_norm, "a number > 0, or unset")
        if self.grad_dtype not in (None, "fp32", self.precision):  # fp16 gradients need the fp16 loss scaler
            require(False, "zero.grad_dtype", self.grad_dtype, f"unset, 'fp32' or {self.precision!r} (the precision)")
        if self.master_dtype != "fp32":
            require(self.precision == "bf16", "zero.master_dtype", self.master_dtype, "'fp32' unless zero.precision is 'bf16'")  # fmt: skip
            offload = self.offload.optimizer
            require(offload == "none", "zero.master_dtype", self.master_dtype, f"'fp32' with zero.offload_optimizer = {offload!r}")  # fmt: skip
        if self.step_in_backward:  # See [Note: the step inside backward]
            for clash, yes in (
                ("zero.precision = 'fp16' (its overflow check needs every gradient)", self.precision == "fp16"),
                ("zero.offload_delayed_update", self.offload.delayed_update),
                ("zero.offload_params = 'nvme', or the optimizer's at stages 1-2 or with persistence_threshold (a collective publication)", self.offload.params == "nvme" or (self.offload.optimizer == "nvme" and (self.stage < 3 or self.persistence_threshold > 0))),
            ):  # fmt: skip
                require(not yes, "zero.step_in_backward", True, f"false with {clash}")
        self.qgz.validate(self.key("qgz"))
        self.qwz.validate(self.key("qwz"))
        require(
            self.hpz_partition_size >= 0,
            "zero.hpz_partition_size",
            self.hpz_partition_size,
            "an integer >= 0 (1: off, 0: the ranks of one node, N: groups of N ranks)",
        )
        if self.qwz.delta:  # See [Note: qWD's reference] (docs/design.md)
            require(
                self.hpz_partition_size != 1,
                self.key("qwz")("quantization"),
                "delta",
                "'block' or 'tensor' unless hpZ is on (zero.hpz_partition_size 0 or > 1: qWD's reference is hpZ's copy)",
            )
        if self.stage != 3:
            for key, value, off in (
                (self.key("qwz")("enabled"), self.qwz.enabled, False),
                (self.key("qgz")("enabled"), self.qgz.enabled, False),
                ("zero.hpz_partition_size", self.hpz_partition_size, 1),
                ("zero.quantized_nontrainable_weights", self.quantized_nontrainable_weights, False),
            ):
                require(value == off, key, value, f"{off!r} unless zero.stage = 3 (ZeRO++ builds on stage 3)")
        if not self.quantized_nontrainable_weights:
            require(
                self.nontrainable_weight_bits == 8, "zero.nontrainable_weight_bits", self.nontrainable_weight_bits,
                "8 unless zero.quantized_nontrainable_weights = true (the bits of the stored frozen weights)",
            )  # fmt: skip
        self.offload.validate(self.key("offload"), self.stage)
        self.activations.validate(self.key("activations"))
        self.outer.validate(self.key("outer"))
        check_finite(self, "zero")
        self.loss_scale.validate()


@dataclass
class TopologyConfig:
    """How ranks map to nodes and the mesh. Real nodes come from torchrun; `nodes` simulates them on one machine."""

    # Megatron's and DeepSpeed's names for the tensor-parallel size, and the short flag
    ALIASES: ClassVar[dict[str, str]] = {
        "tensor_parallel": "tensor_parallel_size",
        "tensor_model_parallel_size": "tensor_parallel_size",
        "model_parallel_size": "tensor_parallel_size",
        "context_parallel": "context_parallel_size",
        "expert_parallel": "expert_parallel_size",
    }

    nodes: int | None = setting(
        None, "simulate this many nodes on one machine (consecutive ranks share a node); unset: torchrun's nodes"
    )
    backend: Literal["auto", "gloo", "nccl"] = setting("auto", "collective backend; auto: NCCL with CUDA, else gloo")
    timeout_s: float = setting(300.0, "seconds a collective may wait for the other ranks before a one-line error")
    context_parallel_size: int = setting(
        1,
        "split every sequence over this many consecutive data-parallel ranks of a node (Ulysses: attention by "
        "all-to-all between sequence and heads); ZeRO shards over them too",
    )
    tensor_parallel_size: int = setting(
        1,
        "split weight matrices over this many consecutive ranks of a node (Megatron-style, DTensor); ZeRO shards over the rest",
    )
    expert_parallel_size: int = setting(
        1,
        "split each mixture-of-experts layer's experts over this many consecutive data-parallel ranks of a node, "
        "tokens sent to their experts by all-to-all; each expert sharded over the ranks holding it",
    )
    sequence_parallel: bool = setting(
        False,
        "with tensor parallelism, shard the activations between the split layers (residual stream, norms) over the "
        "sequence across the tensor-parallel ranks (Megatron's sequence parallelism)",
    )

    def validate(self) -> None:
        check_choices(self, "topology")
        if self.nodes is not None:
            require(self.nodes >= 1, "topology.nodes", self.nodes, "an integer >= 1, or unset")
        require(
            self.tensor_parallel_size >= 1,
            "topology.tensor_parallel_size",
            self.tensor_parallel_size,
            "an integer >= 1",
        )
        require(
            self.context_parallel_size >= 1,
            "topology.context_parallel_size",
            self.context_parallel_size,
            "an integer >= 1",
        )
        require(
            self.expert_parallel_size >= 1,
            "topology.expert_parallel_size",
            self.expert_parallel_size,
            "an integer >= 1",
        )
        if self.expert_parallel_size > 1:  # tensor parallelism composes: the experts run whole on every tp rank
            for key, alone in (("context_parallel_size", 1), ("sequence_parallel", False)):
                require(
                    getattr(self, key) == alone,
                    "topology.expert_parallel_size",
                    self.expert_parallel_size,
                    f"1 with topology.{key} = {getattr(self, key)} (not composed yet)",
                )
        if self.sequence_parallel:
            require(
                self.tensor_parallel_size > 1,
                "topology.sequence_parallel",
                True,
                "false unless topology.tensor_parallel_size > 1 (it shards over the tensor-parallel ranks)",
            )
        require(
            0 < self.timeout_s <= MAX_TIMEOUT_S,
            "topology.timeout_s",
            self.timeout_s,
            f"a number of seconds > 0 and <= {MAX_TIMEOUT_S:g}",
        )
        check_finite(self, "topology")


@dataclass
class OptimConfig:
    """The optimizer and learning-rate schedule of `zeropp train` (schedules: zeropp.app.schedule)."""

    optimizer: Literal["adamw", "adam", "sgd", "adafactor", "muon", "adamw8bit", "adamw4bit"] = setting(
        "adamw",
        "adamw (decoupled weight decay), adam (L2 weight decay), sgd, adafactor, or muon (the blocks' matrices, "
        "its lr matched to AdamW's RMS, with AdamW for the rest), from torch.optim; adamw8bit, adamw4bit: "
        "torchao's AdamW with 8- or 4-bit states (the lowbit extra); all but adamw, adam and sgd step whole "
        "parameters on owner ranks",
    )
    lr: float = setting(
        1e-3, "peak learning rate of the schedule (with 50 warm-up steps: no plateau lottery, docs/benchmarks.md)"
    )
    weight_decay: float = setting(0.1, "weight decay (decoupled for adamw)")
    beta1: float = setting(0.9, "Adam's first-moment decay")
    beta2: float = setting(0.95, "Adam's second-moment decay")
    eps: float = setting(1e-8, "Adam's epsilon")
    bias_correction: bool = setting(True, "Adam's bias correction; false: m / (sqrt(v) + eps), as DeepSpeed's false")
    momentum: float = setting(0.0, "SGD's momentum")
    schedule: Literal["cosine", "constant", "warmup", "warmup_decay", "warmup_cosine", "one_cycle"] = setting(
        "cosine",
        "cosine: linear warm-up, then cosine decay to min_lr_ratio; constant; warmup, warmup_decay, "
        "warmup_cosine, one_cycle: DeepSpeed's WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle",
    )
    warmup_steps: int = setting(50, "steps of learning-rate warm-up (one_cycle: of the cycle's rising half)")
    warmup_type: Literal["log", "linear"] = setting("log", "DeepSpeed's schedules: the warm-up curve")
    warmup_start_ratio: float = setting(0.0, "DeepSpeed's schedules: the first lr / lr (one_cycle: the lowest)")
    min_lr_ratio: float = setting(0.1, "the decay's last learning rate / lr (cosine, warmup_decay, warmup_cosine)")
    decay_steps: int | None = setting(None, "steps at which the decay ends; unset: train.steps")
    cycle_down_steps: int | None = setting(None, "one_cycle: steps of the cycle's falling half; unset: warmup_steps")
    cycle_stairs: int = setting(0, "one_cycle: stairs of the rising half (0: a straight line)")
    cycle_down_stairs: int | None = setting(None, "one_cycle: stairs of the falling half; unset: cycle_stairs")
    decay_rate: float = setting(0.0, "one_cycle: after it, lowest lr / (1 + decay_rate x steps / decay_interval)")
    decay_interval: int = setting(0, "one_cycle: steps per unit of decay after the cycle (0: no decay)")
    cycle_momentum: bool = setting(
        False,
        "one_cycle: cycle Adam's beta1 against the lr from max_momentum down to min_momentum and back, with "
        "beta2 0.99, as DeepSpeed's OneCycle does (SGD's momentum is left alone, as there)",
    )
    min_momentum: float = setting(0.8, "one_cycle with cycle_momentum: the lowest beta1")
    max_momentum: float = setting(0.9, "one_cycle with cycle_momentum: the highest beta1")
    momentum_decay_rate: float = setting(
        0.0, "cycle_momentum: after the cycle, beta1 = max_momentum x (1 + this x steps / decay_interval)"
    )

    def validate(self) -> None:
        check_choices(self, "optim")
        require(self.lr > 0, "optim.lr", self.lr, "a number > 0")
        require(self.weight_decay >= 0, "optim.weight_decay", self.weight_decay, "a number >= 0")
        for key in ("beta1", "beta2", "momentum"):
            value = getattr(self, key)
            require(0 <= value < 1, f"optim.{key}", value, "a number in [0, 1)")
        require(self.eps > 0, "optim.eps", self.eps, "a number > 0")
        require(self.warmup_steps >= 0, "optim.warmup_steps", self.warmup_steps, "an integer >= 0")
        for key in ("warmup_start_ratio", "min_lr_ratio"):
            value = getattr(self, key)
            require(0 <= value <= 1, f"optim.{key}", value, "a number in [0, 1]")
        if self.decay_steps is not None:
            require(self.decay_steps >= 1, "optim.decay_steps", self.decay_steps, "an integer >= 1, or unset")
        if self.schedule == "one_cycle":
            require(self.warmup_steps >= 1, "optim.warmup_steps", self.warmup_steps, "an integer >= 1 (one_cycle)")
            for key in ("cycle_down_steps", "cycle_stairs", "cycle_down_stairs", "decay_interval"):
                value = getattr(self, key)
                require(value is None or value >= 0, f"optim.{key}", value, "an integer >= 0")
            for key in ("min_momentum", "max_momentum"):
                value = getattr(self, key)
                require(0 <= value < 1, f"optim.{key}", value, "a number in [0, 1)")
        check_finite(self, "optim")


@dataclass
class TrainConfig:
    steps: int = setting(200, "optimizer steps to train")
    micro_batch_size: int = setting(4, "sequences per rank per micro-batch")
    seed: int = setting(0, "seed of the weights and the data order")
    eval_interval: int = setting(50, "evaluate the validation loss every this many steps, and after the last")
    eval_batches: int = setting(8, "validation micro-batches per evaluation, per rank")
    init: Literal["meta", "eager"] = setting(
        "meta",
        "meta: build the model on the meta device, each rank initializes it unit by unit (seeded per unit); "
        "eager: build it whole on every rank and synchronize it from rank 0",
    )
    init_from: str | None = setting(
        None, "start from these weights: a safetensors file, or a folder with model.safetensors or its index"
    )
    max_consecutive_skipped_steps: int = setting(
        50, "fp16: stop the run after this many optimizer steps in a row skipped for overflowing gradients"
    )
    data: str | None = setting(
        None,
        "train on this local text: a file, a folder of files, or .jsonl with a text field; unset: the embedded corpus",
    )
    tokenizer: str | None = setting(None, "a local Hugging Face tokenizer folder for train.data; unset: UTF-8 bytes")

    def validate(self) -> None:
        check_choices(self, "train")
        for key in ("steps", "micro_batch_size", "eval_interval", "eval_batches", "max_consecutive_skipped_steps"):
            value = getattr(self, key)
            require(value >= 1, f"train.{key}", value, "an integer >= 1")


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
            require(value >= 0, f"checkpoint.{key}", value, "an integer >= 0")
        if self.save_interval or self.resume == "auto":
            what = "checkpoint.save_interval" if self.save_interval else "checkpoint.resume = 'auto'"
            require(self.checkpoint_dir is not None, "checkpoint.checkpoint_dir", None, f"a directory when {what}")


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
        data = deep_copy(source)
    else:
        data = read_config_file(Path(source))
    for dotted, value in (defaults or {}).items():
        *sections, leaf = dotted.split(".")
        node = data
        for section in sections:
            node = node.get(section) if isinstance(node.get(section), dict) else node.setdefault(section, {})
        if not _written(node, leaf, sections):
            node[leaf] = value
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


def _written(node: Mapping[str, Any], leaf: str, sections: list[str]) -> bool:
    """Whether a section's table sets key `leaf` in any spelling: its own, an alias, its policy's grouped one."""
    cls: Any = Config
    for section in sections:
        cls = typing.get_type_hints(cls).get(section) if dataclasses.is_dataclass(cls) else None
    aliases = getattr(cls, "ALIASES", {})
    if any(key == leaf or aliases.get(key) == leaf for key in node):
        return True
    group, name = getattr(cls, "FLAT_KEYS", {}).get(leaf, (None, None))
    return group is not None and isinstance(node.get(group), Mapping) and name in node[group]
