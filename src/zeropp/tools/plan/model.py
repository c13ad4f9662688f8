"""The configurations of a training run, simulated (:func:`zeropp.tools.simulate.simulate`), the ones that
do not fit a GPU's memory dropped, the rest ranked by predicted throughput (tokens per second).

Enumerated: DDP, ZeRO-1, ZeRO-2, and ZeRO-3 with hpZ (off, or over each node's data-parallel ranks), qwZ
(off, 8 or 4 bits) and qgZ (off, 4 or 8 bits) in every combination; each tensor-parallel size T of
:data:`TENSOR_PARALLEL_SIZES` that divides a node's GPUs and the attention heads (where known); each
micro-batch size (a tensor-parallel group's: its tokens over T per GPU); activation checkpointing on and
off. The remedies where they are needed, cheapest first: a T > 1 configuration that does not fit the
GPU's memory is simulated again with sequence parallelism, and a ZeRO-1/2/3 one that still does not fit
with ZeRO-Offload (``offload_optimizer = "cpu"``), each ranked so (slower) if it then fits; one that fits
never gets them (both only add time in the simulator).
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
from zeropp.tools.simulate.tensor_parallel import check_tensor_parallel

OFFLOAD = {"offload_optimizer": "cpu"}
TENSOR_PARALLEL_SIZES = (1, 2, 4, 8)

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
    heads: int | None = None  # attention heads: a tensor-parallel size must divide them
    kv_heads: int | None = None  # key/value heads (grouped-query attention), the same


def preset_model(preset: str) -> Model:
    """The embedded GPT (``zeropp train --preset``), with its own units and sequence."""
    from zeropp.app.models.gpt import gpt_config
    from zeropp.tools.estimate.gpt import gpt_unit_numels

    gpt = gpt_config(ModelConfig(preset=preset))  # type: ignore[arg-type]
    units = tuple(tuple(u) for u in gpt_unit_numels(ModelConfig(preset=preset)))  # type: ignore[arg-type]
    return Model(f"GPT {preset}", sum(map(sum, units)), gpt.n_layer, gpt.d_model, units, gpt.block_size, gpt.n_head)


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
    return Model(config.get("model_type") or path.stem, sum(units), layers, hidden, units, heads=heads, kv_heads=kv)


@dataclass(frozen=True)
class Candidate:
    name: str
    variant: str
    zero: dict[str, Any]
    micro_batch: int
    activation_checkpointing: bool
    tensor_parallel: int = 1
    sequence_parallel: bool = False

    @property
    def offloaded(self) -> bool:
        return self.zero.get("offload_optimizer", "none") != "none"

    def with_offload(self) -> Candidate:
        """The same with ZeRO-Offload."""
        return dataclasses.replace(self, name=f"{self.name} + offload", zero={**self.zero, **OFFLOAD})

    def with_sequence_parallel(self) -> Candidate:
        """The same with Megatron's sequence parallelism (T > 1)."""
        return dataclasses.replace(self, name=f"{self.name} + SP", sequence_parallel=True)

    @property
    def topology(self) -> dict[str, Any]:
        """Its ``topology`` keys (none at T = 1)."""
        if self.tensor_parallel == 1:
            return {}
        return {"tensor_parallel_size": self.tensor_parallel, "sequence_parallel": self.sequence_parallel}

    def flags(self, precision: str) -> list[str]:
        """``zeropp train``'s flags for it (stage 3's ZeRO++ switches always spelled: its defaults are on)."""
        switches = {"stage": 0} if self.variant == "ddp" else self.zero
        extra = {"activation_checkpointing": self.activation_checkpointing, "precision": precision}
        return [*as_flags(switches | self.topology | extra), "--micro-batch-size", str(self.micro_batch)]


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
    nodes: int,
    per_node: int,
    micro_batches: Sequence[int],
    checkpointing: Sequence[bool],
    tensor_parallel: Sequence[int] = (1,),
) -> list[Candidate]:
    """Every configuration at each tensor-parallel size (hpZ over a node's per_node / T data-parallel ranks)."""
    out = []
    for tp in tensor_parallel:
        configs = [("DDP", "ddp", {}), ("ZeRO-1", "zero3", {"stage": 1}), ("ZeRO-2", "zero3", {"stage": 2})]
        configs += [(name, "zero3", zero) for name, zero in stage3_options(nodes, per_node // tp)]
        named = [(f"{name} + TP {tp}" if tp > 1 else name, variant, zero) for name, variant, zero in configs]
        out += [
            Candidate(name, variant, zero, mb, ac, tp)
            for (name, variant, zero), mb, ac in itertools.product(named, micro_batches, checkpointing)
        ]
    return out


def tensor_parallel_sizes(gpu: str, per_node: int, model: Model) -> list[int]:
    """The sizes of :data:`TENSOR_PARALLEL_SIZES` zeropp can lay out: dividing a node's GPUs and the model's
    heads where known; on a shared host (``cpu-gloo``) 1 only: its ranks compute on one host and its
    loopback's per-call cost is in the calibrated compute, so a split prices nothing real."""
    if gpu_named(gpu).shared_host:
        return [1]
    heads = [h for h in (model.heads, model.kv_heads) if h]
    return [t for t in TENSOR_PARALLEL_SIZES if per_node % t == 0 and all(h % t == 0 for h in heads)]


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
            "tensor_parallel_size": c.tensor_parallel, "sequence_parallel": c.sequence_parallel,
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
    tensor_parallel: Sequence[int] | None = None,
) -> tuple[list[Planned], list[Planned]]:
    """The ranked configurations (fastest first) and the dropped ones (with why), one entry per
    candidate: one that fits only with sequence parallelism or ZeRO-Offload is ranked (or dropped) with
    them (:func:`_remedied`). `tokens_per_gpu` fixes the tokens per GPU (one micro-batch size: 1); else
    each micro-batch of `sequence` tokens (the model's) per tensor-parallel group, over its T GPUs.
    `tensor_parallel`: the sizes tried (default: :func:`tensor_parallel_sizes`; each must divide a
    node's GPUs and the heads where known)."""
    kind = gpu_named(gpu)
    if per_node < 1 or gpus % per_node:
        raise ConfigError(f"--gpus-per-node {per_node} does not divide --gpus {gpus}")
    sizes = tensor_parallel_sizes(gpu, per_node, model) if tensor_parallel is None else list(tensor_parallel)
    for tp in sizes:
        check_tensor_parallel(tp, per_node, model.heads, False)
        if model.kv_heads and model.kv_heads % tp:
            raise ConfigError(f"--tensor-parallel-size {tp} does not divide the {model.kv_heads} key/value heads")
    sequence = sequence or model.sequence
    if tokens_per_gpu is None and sequence is None:
        raise ConfigError("--sequence-length is needed (or --tokens-per-gpu): the model does not give one")
    batches = [1] if tokens_per_gpu else list(micro_batches)
    cluster = dict(
        gpu=gpu, gpus=gpus, ranks_per_node=per_node, inter_bits_per_s=inter_bits_per_s, params=model.params,
        intra_bits_per_s=intra_bits_per_s, n_layer=model.n_layer, d_model=model.d_model, units=model.units,
        pcie_bits_per_s=pcie_bits_per_s, host_bits_per_s=host_bits_per_s, heads=model.heads,
    )  # fmt: skip
    ranked, dropped = [], []
    for c in candidates(gpus // per_node, per_node, batches, checkpointing, sizes):
        # a micro-batch is a tensor-parallel group's: each of its T GPUs trains on a T-th of its tokens
        group_tokens = c.tensor_parallel * tokens_per_gpu if tokens_per_gpu else c.micro_batch * (sequence or 0)
        if group_tokens % c.tensor_parallel:
            planned = Planned(
                c, None, 0, f"not allowed: {group_tokens} tokens a micro-batch over T = {c.tensor_parallel}"
            )
        else:
            offload = c.variant != "ddp" and kind.pcie_bytes_per_s is not None
            planned = _remedied(c, group_tokens // c.tensor_parallel, cluster, sequence, offload)
        (dropped if planned.dropped else ranked).append(planned)
    ranked.sort(key=lambda p: -p.tokens_per_s)
    return ranked, dropped


def _remedied(c: Candidate, tokens: int, cluster: dict[str, Any], sequence: int | None, offload: bool) -> Planned:
    """`c` if it fits; else with sequence parallelism (T > 1, the sequence a multiple of T), else with
    ZeRO-Offload too (where `offload`): the first that fits, or `c` dropped with every reason."""
    remedies = []
    if c.tensor_parallel > 1 and not (sequence or 0) % c.tensor_parallel:
        remedies.append(("sequence parallelism", Candidate.with_sequence_parallel))
    if offload:
        remedies.append(("offload", Candidate.with_offload))
    first = planned = _planned(c, tokens, cluster)
    reasons = [first.dropped]
    for what, remedy in remedies:
        if not planned.dropped or planned.simulation is None:
            break
        planned = _planned(remedy(planned.candidate), tokens, cluster)
        reasons.append(f"with {what}: {planned.dropped}")
    return planned if not planned.dropped else dataclasses.replace(first, dropped="; ".join(map(str, reasons)))


def _planned(c: Candidate, tokens: int, cluster: dict[str, Any]) -> Planned:
    """`c` simulated on `cluster` (:func:`simulate`'s keywords): to rank, or dropped with why."""
    try:
        sim = simulate(
            **cluster, tokens_per_gpu=tokens, variant=c.variant, activation_checkpointing=c.activation_checkpointing,
            zero=c.zero, tensor_parallel=c.tensor_parallel, sequence_parallel=c.sequence_parallel,
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
