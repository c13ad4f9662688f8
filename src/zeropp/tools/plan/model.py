"""The configurations of a training run, simulated (:func:`zeropp.tools.simulate.simulate`), the ones that
do not fit a GPU's memory dropped, the rest ranked by predicted throughput (tokens per second).

Enumerated: DDP, ZeRO-1, ZeRO-2, and ZeRO-3 with hpZ (off, or over each node), qwZ (off, 8 or 4 bits) and
qgZ (off, 4 or 8 bits) in every combination; each micro-batch size; activation checkpointing on and
off. ZeRO-Offload (``offload_optimizer = "cpu"``) where it is needed: a ZeRO-1/2/3 configuration that
does not fit the GPU's memory is simulated again with it, and ranked so (slower) if it then fits; one
that fits is never offloaded (on the host the step is slower). Not enumerated: tensor parallelism (the
simulator does not price it yet).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zeropp.app.flags import as_flags
from zeropp.config.model import ModelConfig
from zeropp.errors import ConfigError
from zeropp.tools.bench.runs import ZEROPP_OFF
from zeropp.tools.simulate.model import Simulation, gpu_named, simulate

OFFLOAD = {"offload_optimizer": "cpu"}

GATED_ACTIVATIONS = ("silu", "swish", "swiglu")  # Llama, Mistral, Qwen: three MLP matrices


@dataclass(frozen=True)
class Model:
    """Ψ and, where known, the shape, the units (as the engine wraps them) and the sequence length."""

    name: str
    params: int
    n_layer: int | None = None
    d_model: int | None = None
    units: tuple[Any, ...] | None = None
    sequence: int | None = None


def preset_model(preset: str) -> Model:
    """The embedded GPT (``zeropp train --preset``), with its own units and sequence."""
    from zeropp.app.models.gpt import gpt_config
    from zeropp.tools.estimate.gpt import gpt_unit_numels

    gpt = gpt_config(ModelConfig(preset=preset))  # type: ignore[arg-type]
    units = tuple(tuple(u) for u in gpt_unit_numels(ModelConfig(preset=preset)))  # type: ignore[arg-type]
    return Model(f"GPT {preset}", sum(map(sum, units)), gpt.n_layer, gpt.d_model, units, gpt.block_size)


def _first(config: dict[str, Any], *keys: str) -> Any:
    return next((config[k] for k in keys if config.get(k) is not None), None)


def hf_model(path: Path) -> Model:
    """A Hugging Face config.json: hidden_size, num_hidden_layers, vocab_size, intermediate_size (GPT-2's
    names too); per block attention 2H² + 2H·H_kv and two MLP matrices of H x I (three where gated),
    the embedding (and an untied head) as one more unit. Raises ConfigError naming what is missing."""
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(f"--hf-config {path}: cannot read it as JSON ({error.__class__.__name__})") from None
    hidden = _first(config, "hidden_size", "n_embd", "d_model")
    layers = _first(config, "num_hidden_layers", "n_layer", "num_layers")
    vocab = _first(config, "vocab_size")
    if not all(isinstance(v, int) and v > 0 for v in (hidden, layers, vocab)):
        raise ConfigError(f"--hf-config {path}: expected hidden_size, num_hidden_layers and vocab_size (integers)")
    inner = _first(config, "intermediate_size", "n_inner", "ffn_dim") or 4 * hidden
    heads = _first(config, "num_attention_heads", "n_head") or 1
    kv = _first(config, "num_key_value_heads") or heads
    gated = _first(config, "hidden_act", "activation_function") in GATED_ACTIVATIONS
    block = 2 * hidden**2 + 2 * hidden * (hidden * kv // heads) + (3 if gated else 2) * hidden * inner
    embedding = vocab * hidden * (1 if config.get("tie_word_embeddings", True) else 2)
    units = (*[block] * layers, embedding)
    return Model(config.get("model_type") or path.stem, sum(units), layers, hidden, units)


@dataclass(frozen=True)
class Candidate:
    name: str
    variant: str
    zero: dict[str, Any]
    micro_batch: int
    activation_checkpointing: bool

    @property
    def offloaded(self) -> bool:
        return self.zero.get("offload_optimizer", "none") != "none"

    def with_offload(self) -> Candidate:
        """The same with ZeRO-Offload."""
        return dataclasses.replace(self, name=f"{self.name} + offload", zero={**self.zero, **OFFLOAD})

    def flags(self, precision: str) -> list[str]:
        """``zeropp train``'s flags for it (stage 3's ZeRO++ switches always spelled: its defaults are on)."""
        switches = {"stage": 0} if self.variant == "ddp" else self.zero
        extra = {"activation_checkpointing": self.activation_checkpointing, "precision": precision}
        return [*as_flags(switches | extra), "--micro-batch-size", str(self.micro_batch)]


def stage3_options(nodes: int, per_node: int) -> list[tuple[str, dict[str, Any]]]:
    """ZeRO-3's combinations of hpZ, qwZ and qgZ (hpZ only where it differs from ZeRO-3: several nodes of several GPUs)."""
    hpz = [("", 1), (" + hpZ", 0)] if nodes > 1 and per_node > 1 else [("", 1)]
    qwz = [("", {}), *((f" + qwZ int{b}", {"quantized_weights": True, "weight_bits": b}) for b in (8, 4))]
    qgz = [("", {}), *((f" + qgZ int{b}", {"quantized_gradients": True, "gradient_bits": b}) for b in (4, 8))]
    options = []
    for (wn, w), (hn, h), (gn, g) in itertools.product(qwz, hpz, qgz):
        zero = {"stage": 3, **ZEROPP_OFF, **w, "hpz_partition_size": h, **g}
        options.append((f"ZeRO-3{wn}{hn}{gn}", zero))
    return options


def candidates(
    nodes: int, per_node: int, micro_batches: Sequence[int], checkpointing: Sequence[bool]
) -> list[Candidate]:
    configs = [("DDP", "ddp", {}), ("ZeRO-1", "zero3", {"stage": 1}), ("ZeRO-2", "zero3", {"stage": 2})]
    configs += [(name, "zero3", zero) for name, zero in stage3_options(nodes, per_node)]
    return [
        Candidate(name, variant, zero, mb, ac)
        for (name, variant, zero), mb, ac in itertools.product(configs, micro_batches, checkpointing)
    ]


@dataclass(frozen=True)
class Planned:
    candidate: Candidate
    simulation: Simulation | None
    tokens_per_gpu: int
    dropped: str | None = None  # why, where it is not ranked

    @property
    def tokens_per_s(self) -> float:
        assert self.simulation is not None
        return self.simulation.gpus * self.tokens_per_gpu / self.simulation.step_s

    def as_dict(self, precision: str) -> dict[str, Any]:
        c, sim = self.candidate, self.simulation
        entry: dict[str, Any] = {
            "name": c.name, "micro_batch_size": c.micro_batch, "activation_checkpointing": c.activation_checkpointing,
            "tokens_per_gpu": self.tokens_per_gpu, "zero": {"stage": 0} if c.variant == "ddp" else c.zero,
            "flags": c.flags(precision), "zero_flags": as_flags({"stage": 0} if c.variant == "ddp" else c.zero),
        }  # fmt: skip
        if self.dropped:
            entry["dropped"] = self.dropped
        if sim is not None:
            entry.update(
                step_seconds=sim.step_s, tokens_per_s=self.tokens_per_s, tflops_per_gpu=sim.tflops_per_gpu,
                memory_bytes_per_gpu=sim.memory_bytes, gpu_memory_bytes=sim.memory_capacity,
            )  # fmt: skip
        return entry


def plan(
    gpu: str,
    gpus: int,
    per_node: int,
    inter_bits_per_s: float,
    model: Model,
    *,
    sequence: int | None = None,
    micro_batches: Sequence[int] = (1, 2, 4, 8),
    tokens_per_gpu: int | None = None,
    checkpointing: Sequence[bool] = (False, True),
    intra_bits_per_s: float | None = None,
    pcie_bits_per_s: float | None = None,
    host_bits_per_s: float | None = None,
) -> tuple[list[Planned], list[Planned]]:
    """The ranked configurations (fastest first) and the dropped ones (with why), one entry per
    candidate: a ZeRO-1/2/3 one that fits only with ZeRO-Offload is ranked (or dropped) with it.
    `tokens_per_gpu` fixes the tokens (one micro-batch size: 1); else each micro-batch of `sequence`
    tokens (the model's)."""
    kind = gpu_named(gpu)
    if per_node < 1 or gpus % per_node:
        raise ConfigError(f"--gpus-per-node {per_node} does not divide --gpus {gpus}")
    sequence = sequence or model.sequence
    if tokens_per_gpu is None and sequence is None:
        raise ConfigError("--sequence-length is needed (or --tokens-per-gpu): the model does not give one")
    batches = [1] if tokens_per_gpu else list(micro_batches)
    cluster = dict(
        gpu=gpu, gpus=gpus, ranks_per_node=per_node, inter_bits_per_s=inter_bits_per_s, params=model.params,
        intra_bits_per_s=intra_bits_per_s, n_layer=model.n_layer, d_model=model.d_model, units=model.units,
        pcie_bits_per_s=pcie_bits_per_s, host_bits_per_s=host_bits_per_s,
    )  # fmt: skip
    ranked, dropped = [], []
    for c in candidates(gpus // per_node, per_node, batches, checkpointing):
        tokens = tokens_per_gpu or c.micro_batch * sequence  # type: ignore[operator]
        planned = _planned(c, tokens, cluster)
        if planned.dropped and planned.simulation and c.variant != "ddp" and kind.pcie_bytes_per_s:
            offloaded = _planned(c.with_offload(), tokens, cluster)
            planned = offloaded if not offloaded.dropped else dataclasses.replace(
                planned, dropped=f"{planned.dropped}; with offload: {offloaded.dropped}"
            )  # fmt: skip
        (dropped if planned.dropped else ranked).append(planned)
    ranked.sort(key=lambda p: -p.tokens_per_s)
    return ranked, dropped


def _planned(c: Candidate, tokens: int, cluster: dict[str, Any]) -> Planned:
    """`c` simulated on `cluster` (:func:`simulate`'s keywords): to rank, or dropped with why."""
    try:
        sim = simulate(
            **cluster, tokens_per_gpu=tokens, variant=c.variant, activation_checkpointing=c.activation_checkpointing,
            zero=c.zero,
        )  # fmt: skip
    except ConfigError as error:
        return Planned(c, None, tokens, f"not allowed: {error}")
    return Planned(c, sim, tokens, None if sim.fits else _too_big(sim))


def _too_big(sim: Simulation) -> str:
    """Why `sim` does not fit: its GPU's memory, or its node's host memory (offload)."""
    if sim.memory_bytes > sim.memory_capacity:
        return f"needs {sim.memory_bytes / 1e9:.3g} GB per GPU of {sim.memory_capacity / 1e9:.3g} GB"
    host = sim.host_memory_bytes * sim.ranks_per_node
    return f"needs {host / 1e9:.3g} GB of host memory per node of {(sim.gpu.host_memory_bytes or 0) / 1e9:.3g} GB"
