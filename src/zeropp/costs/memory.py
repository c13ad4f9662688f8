"""Model-state memory per rank: the ZeRO paper's analytic formula (Table 1) and what a process uses.

Analytic bytes per rank for Ψ parameters on N ranks (p = compute-dtype bytes, g = gradient bytes,
K = fp32 master (4, unless the compute dtype is fp32 and the master is the parameter itself) +
optimizer state (8 for Adam)):

========  ==============================
stage 0   pΨ + gΨ + KΨ
stage 1   pΨ + gΨ + KΨ/N
stage 2   pΨ + gΨ/N + KΨ/N
stage 3   pΨ/N + gΨ/N + KΨ/N
========  ==============================

With bf16/fp16 and Adam this is the paper's 16Ψ, 4Ψ+12Ψ/N, 2Ψ+14Ψ/N and 16Ψ/N. With fp32,
stages 1 and 2 keep a separate fp32 master shard beside the full fp32 parameters (K = 12).
hpZ adds the secondary copy of the compute-dtype weights, pΨ/H for secondary groups of H ranks
(ZeRO++ Fig. 4: 16Ψ/N + 2Ψ/H in bf16); qWD keeps this rank's rows of its reference beside it, pΨ/N
more (the whole reference is hpZ's copy). ZeRO-Offload moves KΨ/N (the master and optimizer state;
the master never aliases the parameters then) to host memory, and offload_params the compute-dtype
shard pΨ/N too: stage 3 with both keeps only gΨ/N of gradients on the device between uses, plus the
units being gathered. offload_params alone (DeepSpeed's ``offload_param`` without ``offload_optimizer``)
keeps the master and optimizer state on the device and moves pΨ/N to the host: the master is then a
copy of its own in fp32 too. ZeRO-Infinity's disk tiers (``"nvme"``) move the same bytes to disk instead,
and the optimizer's at stages 2-3 the reduced gradients gΨ/N too: in host memory only their rings stay (a
few units' worth, :func:`disk_tier_ring_bytes`, :func:`disk_gradients_ring_bytes`,
:func:`disk_params_ring_bytes`, whatever the model's size), and each step moves
:func:`disk_tier_step_bytes`, :func:`disk_gradients_step_bytes` and :func:`disk_params_step_bytes` through them.

Frozen parameters (Ψf of them, ``requires_grad`` False: a LoRA run's base) cost their compute-dtype
bytes only, pΨf at stages 0-2 (whole on every rank) and pΨf/N at stage 3 (sharded in their units),
plus hpZ's copy pΨf/H: no gradient, master or optimizer state (Ψ above counts trainable parameters).
With ``quantized_nontrainable_weights`` the stage-3 shard and hpZ's copy are b/8 bytes a weight (b =
``nontrainable_weight_bits``, 8 or 4) plus an fp32 scale per block of B: (b/8 + 4/B)Ψf/N and
(b/8 + 4/B)Ψf/H (:func:`frozen_weight_bytes`).

qgZ's error feedback (:mod:`zeropp.comm.feedback`) keeps fp32 residuals: 4Ψ for the first hop (each
rank quantizes its own whole gradient) and, across Y > 1 nodes, 4Ψ/X for the second (the node's
partial sums, split over its X ranks): :func:`qgz_residual_bytes`, while qgZ is on; the schedule
that turns qgZ off (``quantized_gradients_until``) frees them.

Activation checkpoints (ZeRO-R, the SC20 ZeRO paper §6.1): with activation checkpointing each
transformer block keeps its input, b x s x h elements in the compute dtype, from its forward to its
recomputation in backward. Tensor parallelism replicates that input on every tensor-parallel rank;
Pa keeps 1/tp of it per rank (padded to a multiple of tp), Pa+cpu keeps that partition in host
memory: :class:`Activations`.

While a step runs, stage 3 also holds the units it has gathered and the whole gradients of the units
being reduced: :func:`stage3_transient_bytes`.
"""

from __future__ import annotations

import math
import resource
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from zeropp.config.policies import OuterLoop, check_switches, flat_name
from zeropp.errors import ConfigError
from zeropp.index.flat import node_chunk_numel, outer_fragments
from zeropp.quant.spec import QuantSpec
from zeropp.runtime.reductions import MAX_IN_FLIGHT
from zeropp.zero.weights.dtensor_params import local_tensor

if TYPE_CHECKING:
    from zeropp.config.sections import ZeroConfig
    from zeropp.zero.unit import FlatUnit

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
RUNTIME_RECOMPUTED_ALL_REDUCES = 1  # zeropp's activation checkpointing (see Activations)
PAPER_RECOMPUTED_ALL_REDUCES = 2  # the ZeRO paper's (SC20 §8): the whole forward again


def analytic_model_state_bytes(
    psi: int,
    world: int,
    stage: int,
    precision: str = "bf16",
    grad_dtype: str | None = None,
    optimizer_bytes: int = 8,
    hpz_group_size: int = 1,
    *,
    offload_optimizer: bool = False,
    offload_params: bool = False,
    optimizer_on_disk: bool = False,
    params_on_disk: bool = False,
    master_dtype: str = "fp32",
    where: Literal["all", "memory", "device", "host", "disk"] = "all",
    qgz_residuals: tuple[int, int, bool] | None = None,
    frozen: int = 0,
    frozen_quant: QuantSpec | None = None,
    qwd_reference: bool = False,
    outer: tuple[OuterLoop, int] | tuple[OuterLoop, int, Sequence[int]] | None = None,
) -> float:
    """Model-state bytes per rank (the table above), `where` they live ("memory": device and host, not
    disk); with ZeRO-Offload the master and optimizer state
    (and with offload_params the compute-dtype shard) are host bytes, the rest device bytes; with the
    disk tier (`optimizer_on_disk`, offload_optimizer = "nvme") the master and optimizer state are disk
    bytes, and at stages 2-3 the gradient shard gΨ/N (See [Note: gradients on disk]), and the host holds
    the rings (:func:`disk_tier_ring_bytes`, :func:`disk_gradients_ring_bytes`), not counted here; with
    `params_on_disk` (offload_params = "nvme") the compute-dtype shard pΨ/N too (its ring:
    :func:`disk_params_ring_bytes`). `optimizer_bytes`: 8 for Adam, 4 with its moments in bf16
    (``optimizer_state_dtype = "bf16"``: bf16 weights and gradients, fp32 master, bf16 moments are
    2 + 2 + 4 + 4 = 12 bytes per parameter, 12Ψ/N at stage 3, where Table 1 counts 16). `master_dtype`
    "bf16" (``master_dtype = "bf16"``): a bf16 master plus its bf16 Kahan compensation, 2 + 2 bytes;
    where the master is the bf16 weights themselves (stages 0 and 3) only the compensation is added:
    2 (weights = master) + 2 (gradients) + 2 (compensation) + 4 (bf16 moments) = 10 bytes per parameter,
    14 with fp32 moments.
    `qgz_residuals`: (ranks per node, nodes, whether the intra-node hop is quantized) when qgZ's error
    feedback is on; `frozen`: Ψf; `frozen_quant`: how the frozen shards are stored at stage 3 (None: the
    compute dtype); `qwd_reference`: qWD's own rows of the reference, p Ψ/N on top of hpZ's copy (See
    [Note: qWD's reference]); `outer`: (DiLoCo's policy, nodes) where its outer loop runs, which keeps
    :func:`outer_state_bytes` of this rank's master shard (Ψ/N, Ψ at stage 0) beside the master, `world`
    then being one node's data-parallel ranks (See [Note: the outer loop]); with ``outer_fragments``
    > 1, (policy, nodes, this rank's master numel of each unit), which the fragments are cut from. They
    do not add up over parts of Ψ with ``outer_bits`` (one exchange pads a whole fragment)."""
    offload_optimizer = offload_optimizer or optimizer_on_disk
    offload_params = offload_params or params_on_disk
    p = BYTES[precision]
    g = BYTES[grad_dtype or precision]
    master_aliases_params = precision == master_dtype and stage in (0, 3) and not (offload_optimizer or offload_params)
    compensation = 0 if master_dtype == "fp32" else BYTES[master_dtype]  # Kahan's, in the master's dtype
    k = optimizer_bytes + compensation + (0 if master_aliases_params else BYTES[master_dtype])
    n = world
    frozen_p = frozen_weight_bytes(frozen_quant) if frozen_quant and stage >= 3 else p
    params = (p * psi + frozen_p * frozen) / (n if stage >= 3 else 1)
    grads = g * psi / (n if stage >= 2 else 1)
    states = k * psi / (n if stage >= 1 else 1)
    if outer is not None:
        policy, nodes, *shards = outer  # the units' shards where given, else one of Ψ/N
        states += outer_state_bytes(shards[0] if shards else psi // (n if stage >= 1 else 1), policy, nodes)
    secondary = (p * psi + frozen_p * frozen) / hpz_group_size if hpz_group_size > 1 else 0
    secondary += p * psi / n if qwd_reference and stage >= 3 else 0
    disk = (states if optimizer_on_disk else 0) + (params if params_on_disk else 0)
    host = (states if offload_optimizer else 0) - disk + (params if offload_params else 0)
    disk += grads if optimizer_on_disk and stage >= 2 else 0
    residuals = qgz_residual_bytes(psi, *qgz_residuals) if qgz_residuals else 0
    total = params + grads + states + secondary + residuals
    return {"all": total, "memory": total - disk, "device": total - host - disk, "host": host, "disk": disk}[where]


def flat_numels(units: Sequence[FlatUnit], module: nn.Module) -> tuple[int, int]:
    """(Ψ, Ψf) of :func:`analytic_model_state_bytes` as this rank's flat buffers hold them: each unit's
    trainable and frozen parameters padded as laid out (the gaps that start each parameter on a
    quantization block, the last shard's pad), frozen parameters outside the units as they are."""
    inside = [u.frozen for u in units if u.frozen is not None]
    held = {id(p) for frozen in inside for p in frozen.params}
    outside = (p for p in module.parameters() if not p.requires_grad and id(p) not in held)
    trained = sum(u.layout.padded_numel for u in units)  # a unit of frozen parameters only: its pad
    return trained, sum(f.layout.padded_numel for f in inside) + sum(local_tensor(p).numel() for p in outside)


def frozen_weight_bytes(spec: QuantSpec) -> float:
    """Bytes a frozen weight stored quantized takes: its data and its share of the block's fp32 scale
    (one scale per shard, per-tensor quantization, is left out)."""
    return spec.bits / 8 + (4 / spec.block_size if spec.block_size else 0)


def disk_tier_ring_bytes(largest_unit: int, depth: int, optimizer_bytes: int = 8) -> int:
    """Host bytes the disk tier's ring holds at most during a step: ``depth + 1`` units' fp32 master and
    optimizer state, `largest_unit` parameters each on this rank (See [Note: the disk tier's ring])."""
    return (depth + 1) * (4 + optimizer_bytes) * largest_unit


def disk_tier_step_bytes(shard_numel: int, optimizer_bytes: int = 8) -> tuple[int, int]:
    """(read, written) bytes of the optimizer's disk tier per optimizer step, for `shard_numel` master
    elements on this rank: every unit's fp32 master and optimizer state read once and written once (the
    first step reads the masters only: the optimizer creates its state)."""
    per_step = (4 + optimizer_bytes) * shard_numel
    return per_step, per_step


def disk_gradients_ring_bytes(largest_shard: int, grad_dtype: str, depth: int) -> int:
    """Host bytes of reduced gradients the optimizer's disk tier holds at most (stages 2-3): in backward
    `depth` shards waiting to be written and one read back to add a micro-batch to, in the step the
    unit stepped and the `depth` read ahead of it, `largest_shard` elements each (See [Note: gradients on
    disk]); beside them the step's fp32 copy of one unit's gradient, as without the disk tier."""
    return (depth + 1) * BYTES[grad_dtype] * largest_shard


def disk_gradients_step_bytes(shard_numel: int, grad_dtype: str, micro_batches: int) -> tuple[int, int]:
    """(read, written) bytes of the reduced gradients on disk per optimizer step (stages 2-3): each
    micro-batch writes the shard, each after the first reads back the sum so far, the step reads it once."""
    shard = BYTES[grad_dtype] * shard_numel
    return micro_batches * shard, micro_batches * shard


def disk_params_ring_bytes(largest_shard: int, precision: str, window: int) -> int:
    """Host bytes of compute shards the parameters' disk tier (offload_params = "nvme") holds at most
    while the model runs: the unit being gathered and the `window` (``max(offload_buffer_count,
    prefetch)``) read ahead of it, `largest_shard` elements each on this rank (See [Note: the disk tier's ring])."""
    return (window + 1) * BYTES[precision] * largest_shard


def disk_params_step_bytes(shard_numel: int, precision: str, micro_batches: int, hpz: bool = False) -> tuple[int, int]:
    """(read, written) bytes of the parameters' disk tier per optimizer step, for `shard_numel` elements
    on disk on this rank: every gather reads the shard (a forward and a backward per micro-batch), but
    with hpZ only the first forward after the step does (later gathers read the secondary copy, valid
    until the weights change); the step writes each shard once."""
    shard = BYTES[precision] * shard_numel
    return (shard if hpz else 2 * micro_batches * shard), shard


def disk_tier_bytes(
    zero: ZeroConfig, shards: Sequence[tuple[int, bool]], optimizer_bytes: int, hpz: bool
) -> dict[str, int]:
    """The disk tiers of `zero` on one rank: the host bytes their rings hold at most and the bytes a
    step reads and writes (after the first, which creates the optimizer state), for each unit's
    (elements on this rank, whether sharded at stage 3: the parameters' tier holds only those)."""
    offload, steps = zero.offload, zero.gradient_accumulation_steps
    elements = [n for n, _ in shards]
    sharded = [n for n, is_sharded in shards if is_sharded]
    ring, read, written = 0, 0, 0
    if offload.optimizer == "nvme":
        ring += disk_tier_ring_bytes(max(elements), offload.buffer_count, optimizer_bytes)
        read, written = disk_tier_step_bytes(sum(elements), optimizer_bytes)
    if offload.optimizer == "nvme" and zero.stage >= 2:  # the reduced gradients too
        grad_dtype = zero.grad_dtype or zero.precision
        ring += disk_gradients_ring_bytes(max(elements), grad_dtype, offload.buffer_count)
        grads = disk_gradients_step_bytes(sum(elements), grad_dtype, steps)
        read, written = read + grads[0], written + grads[1]
    if offload.params == "nvme" and sharded:
        ring += disk_params_ring_bytes(max(sharded), zero.precision, max(offload.buffer_count, zero.prefetch))
        params = disk_params_step_bytes(sum(sharded), zero.precision, steps, hpz)
        read, written = read + params[0], written + params[1]
    return {"host_ring_bytes": ring, "read_bytes_per_step": read, "written_bytes_per_step": written}


def outer_state_bytes(shards: int | Sequence[int], outer: OuterLoop, nodes: int) -> int:
    """DiLoCo's fp32 state per rank for master `shards` (this rank's values of each unit, in unit order;
    an int: one unit): the anchor and the outer momentum (8 bytes a value) and, with ``outer_bits``, the
    residuals of its two quantizations per fragment (:func:`~zeropp.index.flat.outer_fragments`): the
    fragment's values cut into one chunk per node (whole blocks, padded) and the mean chunk it owns,
    4 (nodes + 1) bytes per value of a chunk, about 4 + 4 / nodes per value of the shard
    (:class:`~zeropp.zero.optim.outer.OuterStep`)."""
    shards = [shards] if isinstance(shards, int) else list(shards)
    fragments = [sum(shards[i] for i in f) for f in outer_fragments(shards, outer.fragments)]
    chunks = sum(node_chunk_numel(numel, nodes, outer.block_size) for numel in fragments)
    return 8 * sum(shards) + (4 * (nodes + 1) * chunks if outer.bits else 0)


def qgz_residual_bytes(psi: int, ranks_per_node: int, nodes: int, intra_node_quantized: bool = True) -> float:
    """fp32 residuals of qgZ's error feedback per rank: hop 1's 4Ψ (none where hop 1 is unquantized), and
    hop 2's 4Ψ/X across nodes."""
    return (4 * psi if intra_node_quantized else 0) + (4 * psi / ranks_per_node if nodes > 1 else 0)


def distinct_storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (views and aliases counted once); a tensor
    subclass (torchao's quantized optimizer states) by the plain tensors it is made of."""
    seen, total = set(), 0
    stack = list(tensors)
    while stack:
        tensor = stack.pop()
        if hasattr(tensor, "__tensor_flatten__") and type(tensor) is not torch.Tensor:
            stack.extend(getattr(tensor, name) for name in tensor.__tensor_flatten__()[0])
            continue
        storage = tensor.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def owner_state_bytes(psi: int, world: int) -> float:
    """The whole-parameter step's memory beside the model states above, per rank on average: the owned
    parameters' whole fp32 masters and, while a step runs, their fp32 gradients (See [Note: the
    whole-parameter step]); the optimizer's state is the optimizer's own (Adam's 8 bytes as above)."""
    return 8 * psi / world


def stage3_transient_bytes(
    largest_gathered: int, largest_trainable: int, world: int, compute_bytes: int, grad_bytes: int, prefetch: int
) -> dict[str, int]:
    """Stage 3's bytes per rank beside the model states while a step runs: the units gathered at once
    (the one running and `prefetch` ahead, of at most `largest_gathered` elements) and, on more than one
    rank, whole gradients (of at most `largest_trainable` elements): the unit computing its backward
    and the units whose reduce-scatters are in flight (:data:`~zeropp.runtime.reductions.MAX_IN_FLIGHT`;
    each holds its unit's gradient until it completes)."""
    whole_gradients = MAX_IN_FLIGHT + 1 if world > 1 else 0
    return {"units_gathered": (1 + prefetch) * compute_bytes * largest_gathered,
            "gradients_in_reduction": whole_gradients * grad_bytes * largest_trainable}  # fmt: skip


@dataclass(frozen=True)
class Activations:
    """A transformer's activations per micro-batch on one data-parallel rank: `layers` blocks whose input
    is batch x seq x hidden elements (what Megatron's layout all-reduces, :mod:`zeropp.costs.volume`,
    and what an activation checkpoint holds), and the ZeRO-R switches."""

    layers: int
    hidden: int
    seq: int
    batch: int
    activation_checkpointing: bool = False
    partition_activations: bool = False  # Pa: each checkpoint split over the tensor-parallel ranks
    cpu_checkpointing: bool = False  # Pa+cpu: the partitions kept in host memory
    # forward all-reduces per block that checkpointing's recomputation repeats in backward (Megatron's
    # layout has 2: attention's and the MLP's row-wise outputs): zeropp's runtime repeats 1, as torch's
    # non-reentrant checkpoint stops recomputing once backward has every tensor it needs, and the MLP's
    # all-reduce feeds none; the ZeRO paper (§8) counts the whole forward, 2
    recomputed_all_reduces: int = RUNTIME_RECOMPUTED_ALL_REDUCES
    # the sub-layers per block Megatron's layout splits (each all-reduces its row-wise output): attention
    # and the MLP; 1 where the MLP is a mixture of experts, whole on every tensor-parallel rank
    split_sublayers: int = 2
    # Megatron's sequence parallelism: each tensor-parallel rank holds 1/tp of the sequence between the
    # split layers (block inputs, so checkpoints, included); `norm_parameters` vectors of `hidden` elements
    # (the norms' weights and biases) are whole on every rank and get partial gradients there
    sequence_parallel: bool = False
    norm_parameters: int = 0
    # Ulysses context parallelism: each rank holds seq / context_parallel tokens of every sequence
    context_parallel: int = 1
    # the embedded GPT's attention heads, vocabulary and logit tiles, for what its forward saves
    # (:meth:`saved_bytes`; 0: not known, not priced)
    heads: int = 0
    vocab: int = 0
    logit_tiles: int = 1

    def __post_init__(self) -> None:
        for key in ("layers", "hidden", "seq", "batch", "context_parallel"):
            if getattr(self, key) < 1:
                raise ConfigError(f"activations: {key} = {getattr(self, key)} is not allowed; expected an integer >= 1")
        if self.recomputed_all_reduces not in (0, 1, 2):
            raise ConfigError(
                f"activations: recomputed_all_reduces = {self.recomputed_all_reduces} is not allowed; expected 0, 1 or 2"
            )
        check_switches(
            self.activation_checkpointing,
            self.partition_activations,
            self.cpu_checkpointing,
            lambda name: f"zero.{flat_name('activations', name)}",
        )

    @property
    def block_elements(self) -> int:
        """One block's input on one rank: batch x seq x hidden (seq / context_parallel of it)."""
        return self.batch * (self.seq // self.context_parallel) * self.hidden

    # See [Note: Pa under sequence parallelism] (docs/design.md)
    def checkpoint_elements(self, tp: int) -> int:
        """Elements of one block's checkpoint on one rank: the whole input, or with Pa its 1/tp (padded);
        with sequence parallelism the input is this rank's 1/tp of the sequence already (Pa keeps it)."""
        split = self.partition_activations or self.sequence_parallel
        return math.ceil(self.block_elements / tp) if split else self.block_elements

    def checkpoint_bytes(self, tp: int, element_bytes: int, where: Literal["device", "host"] = "device") -> int:
        """Activation-checkpoint bytes one rank holds between forward and backward (every block's), on
        the device or, with Pa+cpu, on the host; 0 without checkpointing."""
        if not self.activation_checkpointing or (where == "host") != self.cpu_checkpointing:
            return 0
        return self.layers * self.checkpoint_elements(tp) * element_bytes

    # [Note: the GPT's saved activations]
    # What the embedded GPT's forward saves for backward, per token of a rank (e: the activations' bytes),
    # counted from the tensors autograd saves (tests/costs/test_saved_activations.py): per block, the
    # first norm's input and output (2d), the q, k, v projection (3d), attention's output (d; the output
    # projection reads it as it is, sdpa's output being laid out token-major) and its log-sum-exp (4
    # bytes a head), the second norm's input and output (2d), the MLP's hidden before and after GELU
    # (8d), four norm statistics (e each on the CPU; 4 bytes on a GPU): 16d e + 4 heads + 4e. Under
    # Ulysses the heads traded back are a fresh tensor the projection reads through a copy (+d e). Then
    # the token ids and targets (8 each), the final norm (2d e + 2e), the positions (8 per position)
    # and with whole logits log-softmax's fp32 output (4 vocab) and the loss.
    def saved_bytes(self, element_bytes: int, tp: int = 1) -> int | None:
        """What the embedded GPT's forward saves for backward on one rank, at its end: the activations'
        high-water mark before backward (None where the heads or vocabulary are unknown, or with
        activation checkpointing or tensor parallelism: not modeled). See [Note: the GPT's saved
        activations]."""
        if not (self.heads and self.vocab) or tp > 1 or self.activation_checkpointing:
            return None
        positions = self.seq // self.context_parallel
        tokens, e = self.batch * positions, element_bytes
        block = 16 * self.hidden * e + 4 * self.heads + 4 * e
        if self.context_parallel > 1:
            block += self.hidden * e
        logits = 4 * tokens * self.vocab + 4 if self.logit_tiles == 1 else 0
        return self.layers * tokens * block + tokens * (2 * self.hidden * e + 2 * e + 16) + 8 * positions + logits


class PeakMeter:
    """Peak memory in use since a reset, above what was in use when the meter was made (the
    baseline: e.g. the process before the model was built).

    CUDA: the caching allocator's allocated bytes (``reset_peak_memory_stats``,
    ``max_memory_allocated``). CPU: the process's resident set, whose high-water mark (``VmHWM``)
    Linux resets when 5 is written to ``/proc/self/clear_refs``. Large host tensors are mmapped by
    the allocator and unmapped on free, so the resident set follows tensor memory closely; it also
    counts what else the process touches (lazily loaded libraries, the Python heap), and glibc may
    keep freed blocks resident once its dynamic mmap threshold has grown. Where the reset is
    unavailable the meter reports the process's whole peak (``ru_maxrss``) above the baseline.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.baseline = torch.cuda.memory_allocated(device) if device.type == "cuda" else _status_bytes("VmRSS")
        self.reset_peak()

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._resettable = _reset_host_peak()

    def peak(self) -> int:
        """Peak bytes in use since the last reset, above the baseline."""
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
        elif self._resettable:
            peak = _status_bytes("VmHWM")
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return max(0, peak - self.baseline)


def _reset_host_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_bytes("VmHWM") > 0
    except OSError:
        return False


def _status_bytes(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated bytes on a CUDA device; on CPU the process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
