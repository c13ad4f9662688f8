"""ZeroConfig's switches grouped into policies, the way FSDP2 groups ``MixedPrecisionPolicy`` / ``OffloadPolicy``.

- ``zero.qwz``: :class:`QuantizedWeights`, ZeRO++'s quantized weight all-gather;
- ``zero.qgz``: :class:`QuantizedGradients`, ZeRO++'s quantized gradient reduction (and LoCo error feedback);
- ``zero.offload``: :class:`OffloadPolicy`, ZeRO-Offload of the optimizer and the parameters;
- ``zero.activations``: :class:`ActivationCheckpointPolicy`, activation checkpointing and ZeRO-R's Pa, Pa+cpu;
- ``zero.outer``: :class:`OuterLoop`, DiLoCo's outer loop over nodes.

hpZ stays one key of ZeroConfig (``hpz_partition_size``): a policy of one field would add a level and no meaning.

Every field of a policy also has its flat spelling, the key it had before the grouping (``FLAT_KEYS``:
``weight_bits`` is ``qwz.bits``, ``offload_optimizer`` is ``offload.optimizer``). The flat keys are accepted
everywhere: as ZeroConfig keywords, in config files and dicts, as ``zeropp train`` flags (the flags are the
flat keys only), through ``ZeroConfig.ALIASES`` and DeepSpeed's keys. A flat key is applied on top of its
policy (a flag overrides a file's ``[zero.qwz]``), and an error names the key as it was written.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from zeropp.config.schema import check_choices, check_finite, require, setting

Name = Callable[[str], str]  # a policy field -> the dotted key an error names


@dataclass
class QuantizedWeights:
    """qwZ (ZeRO++, stage 3): all-gather weights block-quantized."""

    FLAT: ClassVar[dict[str, str]] = {
        "enabled": "quantized_weights",
        "bits": "weight_bits",
        "block_size": "weight_block_size",
        "quantization": "weight_quantization",
    }

    enabled: bool = setting(False, "qwZ (ZeRO++, stage 3): all-gather weights block-quantized")
    bits: Literal[8, 4] = setting(8, "qwZ: bits per quantized weight")
    block_size: int = setting(256, "qwZ: weights per quantization block (one scale each)")
    quantization: Literal["block", "tensor", "delta"] = setting(
        "block",
        "qwZ: block, one scale per block; tensor, one per shard (the comparison baseline); delta, qWD: the change "
        "since the last gathered weights in blocks (needs hpZ), the first gather after construction or a load unquantized",
    )

    @property
    def block(self) -> int | None:
        """Weights per scale: the block size, or None for one scale per shard."""
        return None if self.quantization == "tensor" else self.block_size

    @property
    def delta(self) -> bool:
        """Whether qwZ gathers the weights' change since the last gather (qWD) instead of the weights."""
        return self.enabled and self.quantization == "delta"

    def validate(self, name: Name) -> None:
        check_choices(self, "", name)
        require(self.block_size >= 1, name("block_size"), self.block_size, "an integer >= 1")
        check_finite(self, "", name)
        # qWD quantizes what qwZ gathers: without qwZ it would be ignored without a word
        require(self.enabled or self.quantization != "delta", name("quantization"), "delta",
                f"'block' or 'tensor' unless {name('enabled')} is on (qWD quantizes qwZ's gathers)")  # fmt: skip


@dataclass
class QuantizedGradients:
    """qgZ (ZeRO++, stage 3): reduce gradients by a quantized two-hop all-to-all."""

    FLAT: ClassVar[dict[str, str]] = {
        "enabled": "quantized_gradients",
        "bits": "gradient_bits",
        "block_size": "gradient_block_size",
        "pipeline_chunks": "qgz_pipeline_chunks",
        "pipeline_min_chunk": "qgz_pipeline_min_chunk",
        "intra_node_bits": "gradient_intra_node_bits",
        "hadamard": "gradient_hadamard",
        "error_feedback": "gradient_error_feedback",
        "error_beta": "gradient_error_beta",
        "error_reset_steps": "gradient_error_reset_steps",
        "until": "quantized_gradients_until",
    }

    enabled: bool = setting(False, "qgZ (ZeRO++, stage 3): reduce gradients by a quantized two-hop all-to-all")
    bits: Literal[4, 8] = setting(4, "qgZ: bits per quantized gradient")
    block_size: int = setting(256, "qgZ: gradients per quantization block")
    pipeline_chunks: int = setting(2, "qgZ: chunks per bucket, pipelined (the paper's pipeline stages)")
    pipeline_min_chunk: int = setting(
        2**16, "qgZ: fewest columns (elements of a rank's shard) a pipelined chunk holds: a bucket too small for "
        "qgz_pipeline_chunks chunks of this many is cut into fewer (1: no minimum)",
    )  # fmt: skip
    intra_node_bits: Literal[0, 4, 8] | None = setting(
        None,
        "qgZ: bits on the intra-node hop (8: two-level qgZ, int8 inside a node, gradient_bits across; 0: unquantized "
        "inside the node, the gradients as they are, summed in fp32, quantized once, across nodes); unset: gradient_bits",
    )
    hadamard: bool = setting(
        False,
        "qgZ: rotate every gradient block by a seeded random Hadamard transform before quantizing (block size a power of 2)",
    )
    error_feedback: Literal["off", "loco"] = setting(
        "off", "qgZ: loco keeps what each quantization dropped and adds it to the next one (LoCo error feedback)"
    )
    error_beta: float = setting(
        0.8, "qgZ error feedback: residual <- beta * residual + (1 - beta) * new error (DeepSpeed's err_beta; 0: plain)"
    )
    error_reset_steps: int = setting(
        1024, "qgZ error feedback: zero the residuals every this many optimizer steps (DeepSpeed's reset_T; 0: never)"
    )
    until: float = setting(
        1.0, "qgZ for this fraction of the run's steps, a full-precision reduce-scatter after (1.0: always)"
    )

    @property
    def feedback(self) -> bool:
        """Whether qgZ is on with LoCo error feedback."""
        return self.enabled and self.error_feedback != "off"

    @property
    def intra_node_quantized(self) -> bool:
        """Whether the intra-node hop is quantized (``intra_node_bits`` 0: it carries the gradients as they are)."""
        return self.intra_node_bits != 0

    def validate(self, name: Name) -> None:
        check_choices(self, "", name)
        require(0 <= self.error_beta < 1, name("error_beta"), self.error_beta, "a number in [0, 1)")
        require(
            self.error_reset_steps >= 0,
            name("error_reset_steps"),
            self.error_reset_steps,
            "an integer >= 0 (0: never reset)",
        )
        require(0 < self.until <= 1, name("until"), self.until, "a fraction of the run's steps in (0, 1]")
        if self.hadamard:
            require(
                self.intra_node_bits != 0,
                name("hadamard"),
                self.hadamard,
                f"false when {name('intra_node_bits')} is 0 (the rotation serves quantization, and the "
                "intra-node hop is then unquantized)",
            )
            block = self.block_size
            require(
                block >= 2 and block & (block - 1) == 0,
                name("block_size"),
                block,
                f"a power of 2 when {name('hadamard')} is on (the Hadamard transform's size)",
            )
        for key in ("block_size", "pipeline_chunks", "pipeline_min_chunk"):
            require(getattr(self, key) >= 1, name(key), getattr(self, key), "an integer >= 1")
        check_finite(self, "", name)


@dataclass
class OffloadPolicy:
    """ZeRO-Offload: what lives and steps in host memory."""

    FLAT: ClassVar[dict[str, str]] = {
        "optimizer": "offload_optimizer",
        "params": "offload_params",
        "path": "offload_path",
        "buffer_count": "offload_buffer_count",
        "delayed_update": "offload_delayed_update",
        "delayed_update_warmup": "offload_delayed_update_warmup",
    }

    optimizer: Literal["none", "cpu", "nvme"] = setting(
        "none",
        "ZeRO-Offload: cpu keeps the fp32 master shard and optimizer state in host memory and steps there; "
        "nvme keeps them in files under offload_path and streams them through host memory unit by unit",
    )
    params: Literal["none", "cpu", "nvme"] = setting(
        "none",
        "ZeRO-Offload (stage 3): cpu keeps the compute-dtype shards in host memory (the optimizer stays where "
        "offload_optimizer puts it); "
        "nvme keeps them in files under offload_path, read ahead of their gathers in the recorded order",
    )
    path: str | None = setting(None, "an nvme offload: the folder (on a fast disk) for each rank's files")
    buffer_count: int = setting(
        2,
        "an nvme offload: units whose states are read ahead of the optimizer, and whose parameter shards are "
        "read ahead of their gathers (at least prefetch) or written back after the step (1: no overlap)",
    )
    delayed_update: bool = setting(
        False,
        "ZeRO-Offload's delayed parameter update (with optimizer cpu; not exact): each host optimizer step runs on "
        "a thread while the next forward and backward use the weights from before it, published one step late",
    )
    delayed_update_warmup: int = setting(
        40, "delayed_update: the first this many optimizer steps are not delayed (the paper's warm-up)"
    )

    def validate(self, name: Name, stage: int) -> None:
        check_choices(self, "", name)
        nvme = "nvme" in (self.optimizer, self.params)
        either = f"{name('optimizer')} or {name('params')}"
        require(self.path is not None or not nvme, name("path"), self.path, f"a folder when {either} is 'nvme'")
        require(self.path is None or nvme, name("path"), self.path, f"unset unless {either} is 'nvme'")
        require(self.buffer_count >= 1, name("buffer_count"), self.buffer_count, "an integer >= 1")
        if nvme:  # before any rank starts: the folder the files go to
            folder = os.path.expanduser(self.path)
            require(
                os.path.isdir(folder), name("path"), self.path, "an existing folder (the disk tier's files go there)"
            )
            require(os.access(folder, os.W_OK), name("path"), self.path, "a folder this user can write to")
        if self.params != "none":
            require(stage == 3, name("params"), self.params, "'none' unless zero.stage = 3")
        require(
            self.delayed_update_warmup >= 0,
            name("delayed_update_warmup"),
            self.delayed_update_warmup,
            "an integer >= 0",
        )
        if self.delayed_update:  # See [Note: the delayed parameter update]
            allowed = f"false unless {name('optimizer')} = 'cpu' (the host step it overlaps)"
            require(self.optimizer == "cpu", name("delayed_update"), True, allowed)


@dataclass
class ActivationCheckpointPolicy:
    """Activation checkpointing, and ZeRO-R's partitioned (Pa) and host-resident (Pa+cpu) checkpoints."""

    FLAT: ClassVar[dict[str, str]] = {
        "enabled": "activation_checkpointing",
        "partition_activations": "partition_activations",
        "cpu_checkpointing": "cpu_checkpointing",
    }

    enabled: bool = setting(
        False, "recompute every block's forward in backward (non-reentrant, per unit): only its input is kept"
    )
    partition_activations: bool = setting(
        False,
        "Pa (ZeRO-R, with activation_checkpointing): each tensor-parallel rank keeps 1/tp of every "
        "checkpointed input; an all-gather rebuilds it before recomputation",
    )
    cpu_checkpointing: bool = setting(
        False,
        "Pa+cpu (with partition_activations): the checkpoint partitions wait in host memory, fetched one block ahead",
    )

    def validate(self, name: Name) -> None:
        check_switches(self.enabled, self.partition_activations, self.cpu_checkpointing, name)


def check_switches(checkpointing: bool, partition: bool, cpu: bool, name: Name) -> None:
    """ZeRO-R's switches, each building on the one before (Pa on checkpointing, Pa+cpu on Pa): the one
    rule for ZeroConfig and :class:`zeropp.costs.memory.Activations`."""
    if partition:
        require(checkpointing, name("partition_activations"), True, f"false unless {name('enabled')} is true too")
    if cpu:
        require(partition, name("cpu_checkpointing"), True, f"false unless {name('partition_activations')} is true too")


@dataclass
class OuterLoop:
    """DiLoCo: every node trains a replica of its own (ZeRO inside the node); every `sync_every` steps the
    nodes average their change since the last synchronization, and an outer optimizer applies it."""

    FLAT: ClassVar[dict[str, str]] = {
        "sync_every": "outer_sync_every",
        "lr": "outer_lr",
        "momentum": "outer_momentum",
        "nesterov": "outer_nesterov",
        "bits": "outer_bits",
        "block_size": "outer_block_size",
        "fragments": "outer_fragments",
    }

    sync_every: int = setting(
        0,
        "DiLoCo: synchronize the nodes every this many optimizer steps (0: off, every step's gradients are "
        "reduced over all ranks); each node trains alone in between, ZeRO sharding inside the node",
    )
    lr: float = setting(0.7, "DiLoCo: the outer optimizer's learning rate (SGD on the nodes' mean change)")
    momentum: float = setting(0.9, "DiLoCo: the outer optimizer's momentum")
    nesterov: bool = setting(True, "DiLoCo: Nesterov momentum for the outer optimizer")
    bits: Literal[0, 8, 4] = setting(
        0,
        "DiLoCo: bits per value of the exchanged change (0: fp32; 8, 4: blocks quantized with error feedback, "
        "what each rank's quantization dropped added to its next change)",
    )
    block_size: int = setting(256, "DiLoCo with outer_bits: values per quantization block (one fp32 scale each)")
    fragments: int = setting(
        1,
        "Streaming DiLoCo: the model's units cut into this many contiguous fragments of about equal size, "
        "synchronized one at a time, staggered over the sync_every steps (1: the whole model at once)",
    )

    @property
    def enabled(self) -> bool:
        return self.sync_every > 0

    def synced_after(self, step: int) -> tuple[int, ...]:
        """The fragments synchronized after inner step `step` (from 1): fragment f where step % H ==
        ((f + 1) H // F) % H, so the last one on plain DiLoCo's schedule and at most one a step (F <= H)."""
        every, count = self.sync_every, self.fragments
        if not self.enabled:
            return ()
        return tuple(f for f in range(count) if step % every == (f + 1) * every // count % every)

    def validate(self, name: Name) -> None:
        check_choices(self, "", name)
        require(self.sync_every >= 0, name("sync_every"), self.sync_every, "an integer >= 0 (0: off)")
        require(self.block_size >= 1, name("block_size"), self.block_size, "an integer >= 1")
        require(self.fragments >= 1, name("fragments"), self.fragments, "an integer >= 1")
        require(
            not self.enabled or self.fragments <= self.sync_every,
            name("fragments"),
            self.fragments,
            f"at most {name('sync_every')} ({self.sync_every}): one fragment synchronized a step at most",
        )
        require(self.lr > 0, name("lr"), self.lr, "a number > 0")
        require(0 <= self.momentum < 1, name("momentum"), self.momentum, "a number from 0 to below 1")
        require(
            not self.nesterov or self.momentum > 0,
            name("nesterov"),
            self.nesterov,
            f"false when {name('momentum')} is 0",
        )
        check_finite(self, "", name)


# ZeroConfig's policy fields and their classes
POLICIES: dict[str, type] = {
    "qwz": QuantizedWeights,
    "qgz": QuantizedGradients,
    "offload": OffloadPolicy,
    "activations": ActivationCheckpointPolicy,
    "outer": OuterLoop,
}

# flat key -> (policy field of ZeroConfig, field of the policy)
FLAT_KEYS: dict[str, tuple[str, str]] = {
    flat: (group, name) for group, cls in POLICIES.items() for name, flat in cls.FLAT.items()
}


def flat_name(group: str, name: str) -> str:
    """A policy field's flat key: ('qwz', 'bits') -> 'weight_bits'."""
    return POLICIES[group].FLAT[name]


def accepts_flat_keys(cls: type) -> type:
    """Let dataclass `cls` (ZeroConfig) take every policy field by its flat key too, applied on top of the
    policy given (or the default one), and remember how each key was written for its errors (``_spelled``)."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        changes: dict[str, dict[str, Any]] = {}
        spelled = {f"{g}.{n}": flat for flat, (g, n) in FLAT_KEYS.items() if g not in kwargs}
        for key in [k for k in kwargs if k in FLAT_KEYS]:
            group, name = FLAT_KEYS[key]
            changes.setdefault(group, {})[name] = kwargs.pop(key)
            spelled[f"{group}.{name}"] = key
        for group, values in changes.items():
            kwargs[group] = dataclasses.replace(kwargs.get(group) or POLICIES[group](), **values)
        init(self, *args, **kwargs)
        self._spelled = spelled

    cls.__init__ = __init__
    return cls
