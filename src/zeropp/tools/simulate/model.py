"""One training step of a GPU cluster, simulated: the estimator's transfers and memory, timed.

What each collective sends and what each GPU holds are the estimator's (:func:`~zeropp.tools.estimate.estimate`:
:mod:`zeropp.costs.volume`'s transfers, :mod:`zeropp.costs.memory`'s formulas); this module adds their
time on a fabric (:mod:`zeropp.costs.collectives`: NCCL's ring and tree on alpha-beta links), the
compute from the GPU's datasheet peak and one achieved efficiency, the quantization kernels' time
(:mod:`~zeropp.tools.simulate.kernels`: their bytes at the GPU's measured rate, else a share of its memory
bandwidth), and stage 3's overlap (:func:`~zeropp.costs.step_time.pass_seconds`: each
pass a pipeline of per-unit communication and compute over the model's blocks, prefetch on), of the
share ``Assumptions.overlap`` of the communication (the rest exposed: the paper's runs hid less).

Compute: a step does 6 Ψ T FLOPs per GPU (T tokens), 8 Ψ T with activation checkpointing (the
forward recomputed in backward): forward 2 Ψ T, backward the rest. Achieved TFLOPs count the same
FLOPs over the step's time (the papers' TFLOPs, recomputation included), ``peak_fraction`` their
share of the datasheet peak. The quantization kernels (qwZ's dequantization of every gathered unit,
qgZ's two quantize / dequantize hops over the gradient) move each element's value in the compute
dtype, its int8 / int4 code and its share of an fp32 scale, and run on the GPU beside the matmuls:
their time adds to the pass's compute. The optimizer step (Adam on the rank's fp32 shard, about 32
bytes moved per element) follows the backward pass; with
ZeRO-Offload (``offload_optimizer = "cpu"`` among the ZeRO keys) it is :mod:`~zeropp.tools.simulate.offload`'s
step on the host instead, the memory per GPU the estimator's device bytes.

Variants: ZeRO-3 (FSDP2's full sharding sends the same), ZeRO++ and each of its parts alone, DDP
(stage 0: its bucketed all-reduce overlaps backward, priced like stage 3's reductions over the same
blocks), HSDP (FSDP2's hybrid sharding: ZeRO-3 inside each node, each rank's gradient shard
all-reduced with its peers on the other nodes, in the gradient dtype); any other ZeRO keys over a
variant's (``zero``: stage, bits, hpZ's group, ...), as ``zeropp plan`` enumerates them.

Tensor parallelism (``tensor_parallel`` T, :mod:`~zeropp.tools.simulate.tensor_parallel`): each unit is one
GPU's 1/T of it and ZeRO runs over the gpus / T data-parallel ranks (the estimator's layout); the
tensor-parallel collectives run on T GPUs of a node and nothing overlaps them; the activations are split
where Megatron's layout splits them.

The emulated cluster (``gpu="cpu-gloo"``): every rank shares one host, so its compute, kernels and
optimizer run at the host's rate over the world; gloo's collectives (:mod:`zeropp.costs.collectives`);
and :data:`PROFILE_ASSUMPTIONS`: the link's nominal rate, no latency, full overlap, as
:mod:`zeropp.tools.bench.cluster.bound` predicts its steps (docs/simulate.md).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from zeropp.comm.ledger import ring_bytes
from zeropp.config.sections import ZEROPP_SWITCHES, ZeroConfig
from zeropp.costs.collectives import Fabric, Group, Link, collective_seconds
from zeropp.costs.memory import BYTES, Activations
from zeropp.costs.step_time import pass_seconds
from zeropp.costs.volume import STEP_PHASES, Transfer
from zeropp.errors import ConfigError
from zeropp.tools.estimate.model import Estimate, estimate
from zeropp.tools.simulate.gpus import GPUS, Gpu
from zeropp.tools.simulate.kernels import kernel_seconds
from zeropp.tools.simulate.offload import OffloadStep, offload_step
from zeropp.tools.simulate.tensor_parallel import (
    block_activation_bytes,
    check_tensor_parallel,
    group_activations,
    on_tensor_parallel_group,
    split_units,
)

VARIANTS: dict[str, dict[str, Any]] = {
    "zero3": {"stage": 3},
    "zeropp": {"stage": 3, **ZEROPP_SWITCHES},
    "qwz": {"stage": 3, "quantized_weights": True},
    "hpz": {"stage": 3, "hpz_partition_size": 0},
    "qgz": {"stage": 3, "quantized_gradients": True},
    "ddp": {"stage": 0},
    "hsdp": {"stage": 3},  # on one node, plus the all-reduce between nodes (:func:`simulate`)
}
ADAM_BYTES_PER_ELEMENT = 32  # fp32 master, two moments read and written, the gradient read, the weight written
ASPECT = 128  # d_model / n_layer where the shape is not given (GPT-3: 12288 / 96)
# 12 L H^2 over Ψ for a shape given with it: embeddings make it less than 1 (Llama-3-8B: 0.80, Gemma-2B: 0.36), wider
# MLPs or grouped attention move it either way; outside these bounds the two do not describe one model
BLOCK_SHARE = (0.2, 1.5)


@dataclass(frozen=True)
class Assumptions:
    """What the simulation does not read from a datasheet. The defaults are calibrated once on the
    ZeRO++ paper's evaluation (docs/simulate.md); latencies and kernel efficiency are set, not fitted (the
    kernels' efficiency only where the GPU has no measured rate, ``Gpu.kernel_bytes_per_s``)."""

    compute_efficiency: float = 0.42  # achieved matmul FLOP/s over the datasheet peak
    nic_efficiency: float = 0.7  # NCCL's bus bandwidth over the NICs' line rate
    nvlink_efficiency: float = 0.8  # the same inside a node
    intra_latency_s: float = 2e-6  # α of one ring step inside a node
    inter_latency_s: float = 8e-6  # α of one ring step between nodes
    kernel_efficiency: float = 0.5  # quantization kernels of a GPU not measured: their share of the memory bandwidth
    overlap: float = 0.5  # share of a pass's communication prefetch can hide (1: the flow shop; 0: none)
    pcie_efficiency: float = 0.8  # ZeRO-Offload: pinned copies' rate over the PCIe link's
    host_memory_efficiency: float = 0.7  # ZeRO-Offload: the host step's bytes/s over the channels' rated rate


# the emulated cluster as bound.py prices it: nominal link rate, no latency (gloo's per-call cost is in the
# calibrated compute), loopback inside a node, stage 3's flow shop with all its communication
PROFILE_ASSUMPTIONS = {
    "cpu-gloo": Assumptions(
        compute_efficiency=1.0,
        nic_efficiency=1.0,
        nvlink_efficiency=1.0,
        intra_latency_s=0.0,
        inter_latency_s=0.0,
        kernel_efficiency=1.0,
        overlap=1.0,
    ),
}


def default_assumptions(gpu: str) -> Assumptions:
    return PROFILE_ASSUMPTIONS.get(gpu, Assumptions())


@dataclass(frozen=True)
class Shape:
    """Blocks and width of the transformer (its units: n_layer blocks of Ψ / n_layer)."""

    n_layer: int
    d_model: int
    given: bool

    @classmethod
    def of(cls, params: int, n_layer: int | None, d_model: int | None) -> Shape:
        """The given shape; the missing half from Ψ = 12 n_layer d_model²; neither given: d_model =
        128 n_layer (GPT-3's proportions)."""
        given = n_layer is not None and d_model is not None
        if given and not BLOCK_SHARE[0] <= 12 * n_layer * d_model**2 / params <= BLOCK_SHARE[1]:
            raise ConfigError(
                f"--n-layer {n_layer} --d-model {d_model} describe blocks of {12 * n_layer * d_model**2:.3g} parameters "
                f"(12 L H^2), {12 * n_layer * d_model**2 / params:.0%} of --params {params:.3g}; expected a shape whose "
                f"blocks hold {BLOCK_SHARE[0]:.0%}-{BLOCK_SHARE[1]:.0%} of them"
            )
        if n_layer is None and d_model is None:
            n_layer = max(1, round((params / (12 * ASPECT**2)) ** (1 / 3)))
        if d_model is None:
            d_model = max(1, round(math.sqrt(params / (12 * n_layer))))
        if n_layer is None:
            n_layer = max(1, round(params / (12 * d_model**2)))
        return cls(n_layer, d_model, given)


@dataclass(frozen=True)
class Simulation:
    gpu: Gpu
    gpus: int
    ranks_per_node: int
    variant: str
    params: int
    tokens_per_gpu: int
    shape: Shape
    activation_checkpointing: bool
    assumptions: Assumptions
    estimate: Estimate
    comm_s: dict[str, float]  # seconds on the wire per phase
    kernel_s: dict[str, float]  # quantization kernels per phase
    compute_s: dict[str, float]  # matmuls per pass
    optimizer_s: float
    memory: dict[str, float]  # bytes per GPU
    units: int  # what stage 3's overlap pipelines over
    zero: tuple[tuple[str, Any], ...] = ()  # ZeRO keys over the variant's
    offload: OffloadStep | None = None  # ZeRO-Offload's step (optimizer_s: what the GPU waits for after backward)
    tensor_parallel: int = 1  # GPUs of a node splitting every layer (each trains its group's micro-batch)
    sequence_parallel: bool = False
    # the tensor-parallel collectives per phase: on the critical path, not overlapped
    tensor_parallel_s: dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(STEP_PHASES, 0.0))

    @property
    def flops(self) -> float:
        """FLOPs per GPU and step, as the papers count them (recomputation included)."""
        return (8 if self.activation_checkpointing else 6) * self.params * self.tokens_per_gpu

    @property
    def passes_s(self) -> dict[str, float]:
        """Each pass: the flow shop over the blocks (:func:`~zeropp.costs.step_time.pass_seconds`) of its
        compute and the share `overlap` of ZeRO's communication, the rest exposed after it, and the
        tensor-parallel collectives, which nothing hides."""
        units, overlap = self.units, self.assumptions.overlap
        return {
            p: pass_seconds(self.compute_s[p] + self.kernel_s[p], overlap * self.comm_s[p], units)
            + (1 - overlap) * self.comm_s[p]
            + self.tensor_parallel_s[p]
            for p in ("forward", "backward")
        }

    @property
    def step_s(self) -> float:
        return sum(self.passes_s.values()) + self.comm_s["step"] + self.tensor_parallel_s["step"] + self.optimizer_s

    @property
    def tflops_per_gpu(self) -> float:
        return self.flops / self.step_s / 1e12

    @property
    def peak_flops(self) -> float:
        """One GPU's peak (a shared host's over its ranks)."""
        return self.gpu.peak_flops / (self.gpus if self.gpu.shared_host else 1)

    @property
    def peak_fraction(self) -> float:
        return self.flops / self.step_s / self.peak_flops

    @property
    def memory_bytes(self) -> float:
        return sum(self.memory.values())

    @property
    def memory_capacity(self) -> float:
        """One GPU's memory (a shared host's over its ranks)."""
        return self.gpu.memory_bytes / (self.gpus if self.gpu.shared_host else 1)

    @property
    def host_memory_bytes(self) -> float:
        """Host memory one GPU's offloaded states take (0 without offload)."""
        return self.offload.host_memory_bytes if self.offload else 0.0

    @property
    def fits(self) -> bool:
        """Within the GPU's memory, and its node's offloaded states within the host's."""
        host = self.gpu.host_memory_bytes
        return self.memory_bytes <= self.memory_capacity and (
            host is None or self.host_memory_bytes * self.ranks_per_node <= host
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "gpu": self.gpu.name, "gpus": self.gpus, "gpus_per_node": self.ranks_per_node,
            "nodes": self.gpus // self.ranks_per_node, "variant": self.variant, "params": self.params,
            "n_layer": self.shape.n_layer, "d_model": self.shape.d_model, "shape_given": self.shape.given,
            "units": self.units, "zero": dict(self.zero), "tensor_parallel_size": self.tensor_parallel,
            "sequence_parallel": self.sequence_parallel, "data_parallel_size": self.gpus // self.tensor_parallel,
            "tokens_per_gpu": self.tokens_per_gpu, "activation_checkpointing": self.activation_checkpointing,
            "assumptions": dataclasses.asdict(self.assumptions),
            "step_seconds": self.step_s, "passes_seconds": self.passes_s, "comm_seconds": self.comm_s,
            "tensor_parallel_seconds": self.tensor_parallel_s,
            "kernel_seconds": self.kernel_s, "compute_seconds": self.compute_s, "optimizer_seconds": self.optimizer_s,
            "flops_per_gpu": self.flops, "tflops_per_gpu": self.tflops_per_gpu, "peak_fraction": self.peak_fraction,
            "memory_bytes_per_gpu": self.memory_bytes, "memory_bytes_per_gpu_by_kind": self.memory,
            "gpu_memory_bytes": self.memory_capacity, "fits": self.fits,
            "offload": self.offload.as_dict() if self.offload else None,
        }  # fmt: skip


def gpu_named(name: str) -> Gpu:
    if name not in GPUS:
        raise ConfigError(f"gpu {name!r} is not known; expected one of {', '.join(GPUS)}")
    return GPUS[name]


def fabric_for(
    gpu: Gpu, ranks_per_node: int, inter_bits_per_s: float, intra_bits_per_s: float | None, a: Assumptions
) -> Fabric:
    """The links as NCCL drives them: line rates times its efficiencies (intra: the GPU's NVLink by default)."""
    intra = (intra_bits_per_s or gpu.nvlink_bits_per_s) * a.nvlink_efficiency / 8
    return Fabric(
        Link(intra, a.intra_latency_s), Link(inter_bits_per_s * a.nic_efficiency / 8, a.inter_latency_s), ranks_per_node
    )


def group_of(transfer: Transfer, gpus: int, nodes: int, tp: int = 1) -> Group:
    """The group a transfer's collective runs over: a tensor-parallel one's, its `tp` GPUs of a node; ZeRO's
    from its crossing share over the data-parallel ranks (gpus / tp): 0, inside one node (hpZ's group,
    qgZ's first hop, anything on one node); 1, one rank per node (qgZ's second hop, HSDP's all-reduce);
    between, the data-parallel ring (the world's, for the step's scalars over every rank)."""
    if on_tensor_parallel_group(transfer):
        return Group(tp)
    data_parallel = gpus // tp
    if transfer.crossing == 0:
        return Group(data_parallel // nodes)
    if transfer.crossing == 1:
        return Group(nodes, nodes)
    return Group(gpus if transfer.over_world else data_parallel, nodes)


def phase_seconds(
    transfers: Iterable[Transfer], gpus: int, nodes: int, fabric: Fabric, backend: str = "nccl", tp: int = 1
) -> dict[str, float]:
    """Seconds on the wire per phase, each collective one after the other (the ledger's ``tp.all_reduce``
    is an all-reduce)."""
    seconds = dict.fromkeys(STEP_PHASES, 0.0)
    for t in transfers:
        op = t.op.rpartition(".")[2]
        seconds[t.phase] += collective_seconds(op, t.sent, group_of(t, gpus, nodes, tp), fabric, backend)
    return seconds


def hsdp_transfers(est: Estimate, nodes: int) -> list[Transfer]:
    """HSDP's all-reduce of every unit's gradient shard (its node's 1/G) with its peers on the other nodes."""
    grad, per_node = BYTES[est.zero.grad_dtype or est.zero.precision], est.data_parallel.world_size
    return [
        Transfer("all_reduce", "backward", ring_bytes(u.padded // per_node * grad, nodes, 2), 1.0) for u in est.units
    ]


def simulate(
    gpu: str,
    gpus: int,
    ranks_per_node: int,
    inter_bits_per_s: float,
    params: int,
    tokens_per_gpu: int,
    variant: str,
    *,
    intra_bits_per_s: float | None = None,
    n_layer: int | None = None,
    d_model: int | None = None,
    activation_checkpointing: bool = True,
    assumptions: Assumptions | None = None,
    zero: Mapping[str, Any] | None = None,
    units: Sequence[int | Sequence[int]] | None = None,
    pcie_bits_per_s: float | None = None,
    host_bits_per_s: float | None = None,
    tensor_parallel: int = 1,
    sequence_parallel: bool = False,
    heads: int | None = None,
    partition_activations: bool = False,
) -> Simulation:
    """One step of `params` parameters on `gpus` GPUs of kind `gpu`, `ranks_per_node` per node joined by
    `inter_bits_per_s` per node, each training on `tokens_per_gpu` tokens, under `variant` (:data:`VARIANTS`)
    with the ZeRO keys `zero` over its own; `units`: the model's units as the engine wraps them (numels,
    or their parameters' numels; default: one per block). With ``offload_optimizer = "cpu"`` in `zero`:
    `pcie_bits_per_s` (a GPU's link, one direction) and `host_bits_per_s` (a node's host memory)
    override the GPU's datasheet. `tensor_parallel` GPUs of a node split every layer (Megatron's layout,
    with `sequence_parallel` or not; :mod:`~zeropp.tools.simulate.tensor_parallel`), each group training
    on `tensor_parallel` x `tokens_per_gpu` tokens; `heads`, where known, must be divisible by it;
    `partition_activations` (ZeRO-R's Pa, with activation checkpointing) splits each checkpoint over the
    group and all-gathers it before its recomputation. Raises ConfigError for what it does not know or cannot lay out."""
    kind, a = gpu_named(gpu), assumptions or default_assumptions(gpu)
    if variant not in VARIANTS:
        raise ConfigError(f"variant {variant!r} is not known; expected one of {', '.join(VARIANTS)}")
    if ranks_per_node < 1 or gpus % ranks_per_node:
        raise ConfigError(f"--gpus-per-node {ranks_per_node} does not divide --gpus {gpus}")
    if min(params, tokens_per_gpu, gpus) < 1:
        raise ConfigError("--params, --tokens-per-gpu and --gpus must be >= 1")
    efficiencies = (a.compute_efficiency, a.nic_efficiency, a.nvlink_efficiency, a.kernel_efficiency)
    if min(*efficiencies, a.pcie_efficiency, a.host_memory_efficiency) <= 0:
        raise ConfigError("the efficiencies must be > 0")
    _refuse_unmodelled_offload(zero or {})
    tp = tensor_parallel
    check_tensor_parallel(tp, ranks_per_node, heads, sequence_parallel)
    nodes, shape = gpus // ranks_per_node, Shape.of(params, n_layer, d_model)
    if units is None:
        block = params // shape.n_layer
        units = (*[block] * (shape.n_layer - 1), params - block * (shape.n_layer - 1))  # one unit per block
    units = split_units(units, tp)
    keys = tuple(sorted((zero or {}).items()))
    acts = group_activations(
        shape.n_layer, shape.d_model, tp * tokens_per_gpu, activation_checkpointing, sequence_parallel,
        partition_activations,
    )  # fmt: skip
    priced = (tp, acts if tp > 1 else None)  # at T = 1 the activations price no collective
    est = _estimate(units, ranks_per_node if variant == "hsdp" else gpus, variant, kind.precision, nodes, keys, *priced)
    fabric = fabric_for(kind, ranks_per_node, inter_bits_per_s, intra_bits_per_s, a)
    comm, tensor_parallel_s = _comm_seconds(
        units, variant, kind.precision, gpus, nodes, fabric, keys, kind.backend, *priced
    )
    sharing = gpus if kind.shared_host else 1  # ranks sharing one host's compute and memory bandwidth
    offload = offload_of(est, kind, ranks_per_node, a, pcie_bits_per_s, host_bits_per_s)
    rate = kind.peak_flops * a.compute_efficiency / sharing
    adam_s = est.shard_numel * ADAM_BYTES_PER_ELEMENT / kind.hbm_bytes_per_s
    forward = 2 * params * tokens_per_gpu / rate
    total = (8 if activation_checkpointing else 6) * params * tokens_per_gpu / rate
    sim = Simulation(
        kind, gpus, ranks_per_node, variant, params, tokens_per_gpu, shape, activation_checkpointing, a, est,
        comm_s=comm, kernel_s={p: s * sharing for p, s in kernel_seconds(est, kind, a).items()},
        compute_s={"forward": forward, "backward": total - forward},
        optimizer_s=offload.seconds if offload else adam_s * sharing,
        memory=memory_bytes(est, acts, tp), units=len(units), zero=keys, offload=offload,
        tensor_parallel=tp, sequence_parallel=sequence_parallel, tensor_parallel_s=tensor_parallel_s,
    )  # fmt: skip
    if offload and est.zero.step_in_backward:  # the host's step inside backward: priced against the pass
        offload = offload_of(est, kind, ranks_per_node, a, pcie_bits_per_s, host_bits_per_s, sim.passes_s["backward"])
        sim = dataclasses.replace(sim, optimizer_s=offload.seconds, offload=offload)
    return sim


def _refuse_unmodelled_offload(zero: Mapping[str, Any]) -> None:
    """ZeRO-Offload of the optimizer to the host is the one offload priced, and the step inside backward
    only with it (the host's); refuse the others in one line."""
    optimizer, params = zero.get("offload_optimizer", "none"), zero.get("offload_params", "none")
    if optimizer not in ("none", "cpu") or params != "none":
        raise ConfigError(
            f"offload_optimizer {optimizer!r}, offload_params {params!r} is not modelled; expected offload_optimizer "
            "'none' or 'cpu' and offload_params 'none'"
        )
    if zero.get("step_in_backward") and optimizer != "cpu":
        raise ConfigError(
            "step_in_backward (--step-in-backward) without offload_optimizer 'cpu' is not modelled (the GPU's step); "
            "expected it with --offload-optimizer cpu"
        )


def offload_of(
    est: Estimate,
    gpu: Gpu,
    ranks_per_node: int,
    a: Assumptions,
    pcie_bits_per_s: float | None = None,
    host_bits_per_s: float | None = None,
    backward_s: float | None = None,
) -> OffloadStep | None:
    """ZeRO-Offload's step where `est` offloads the optimizer (else None): the GPU's PCIe link and its
    node's host memory (the given rates, else the datasheet's) at the assumed efficiencies, the host's
    shared by the node's `ranks_per_node` GPUs; inside a backward pass of `backward_s` where given and
    `est` steps there."""
    if est.zero.offload.optimizer == "none":
        return None
    if gpu.pcie_bytes_per_s is None or gpu.host_bytes_per_s is None:
        raise ConfigError(f"offload_optimizer 'cpu' on {gpu.name}: its ranks are the host already; expected a GPU")
    pcie = (pcie_bits_per_s / 8 if pcie_bits_per_s else gpu.pcie_bytes_per_s) * a.pcie_efficiency
    host = (host_bits_per_s / 8 if host_bits_per_s else gpu.host_bytes_per_s) * a.host_memory_efficiency
    return offload_step(est, pcie, host / ranks_per_node, backward_s)


@functools.lru_cache(maxsize=256)
def _estimate(
    units: tuple[Any, ...],
    gpus: int,
    variant: str,
    precision: str,
    nodes: int,
    keys: tuple[tuple[str, Any], ...] = (),
    tp: int = 1,
    acts: Activations | None = None,
) -> Estimate:
    """The estimator's step (cached: a calibration simulates the same runs under many assumptions);
    HSDP's on one node (`gpus`: one node's); `units` on one of `tp` tensor-parallel GPUs, `acts` pricing
    their collectives."""
    zero = ZeroConfig(precision=precision, **{**VARIANTS[variant], **dict(keys)})
    return estimate(list(units), gpus, 1 if variant == "hsdp" else nodes, zero, tensor_parallel=tp, activations=acts)


@functools.lru_cache(maxsize=1024)
def _comm_seconds(
    units: tuple[Any, ...],
    variant: str,
    precision: str,
    gpus: int,
    nodes: int,
    fabric: Fabric,
    keys: tuple[tuple[str, Any], ...] = (),
    backend: str = "nccl",
    tp: int = 1,
    acts: Activations | None = None,
) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds on the wire per phase (cached beside :func:`_estimate`) of ZeRO's collectives, HSDP's
    all-reduce between nodes added, and of the tensor-parallel ones."""
    est = _estimate(
        units, fabric.ranks_per_node if variant == "hsdp" else gpus, variant, precision, nodes, keys, tp, acts
    )
    transfers = [*est.transfers, *(hsdp_transfers(est, nodes) if variant == "hsdp" else ())]
    zero = [t for t in transfers if not on_tensor_parallel_group(t)]
    tensor_parallel = [t for t in transfers if on_tensor_parallel_group(t)]
    return (
        phase_seconds(zero, gpus, nodes, fabric, backend, tp),
        phase_seconds(tensor_parallel, gpus, nodes, fabric, backend, tp),
    )


def memory_bytes(est: Estimate, acts: Activations, tp: int = 1) -> dict[str, float]:
    """Per GPU: the estimator's model states on the device and stage 3's transient buffers (one of `tp`
    tensor-parallel GPUs' share), the activation checkpoints (one block input per block, 1/tp of it with
    sequence parallelism) and the activations of the blocks held whole (one, recomputed, with
    checkpointing; all without), split as tensor parallelism splits them."""
    block = block_activation_bytes(acts.batch * acts.seq, acts.hidden, tp, acts.sequence_parallel)
    return {
        "model_states": est.model_state_bytes_on("device"),
        "stage3_transient": sum((est.transient_bytes() or {}).values()),
        "activation_checkpoints": acts.checkpoint_bytes(tp, BYTES[est.zero.precision]),
        "activations": block * (1 if acts.activation_checkpointing else acts.layers),
    }
