"""Bytes of one optimizer step, per collective, without running it: the one traffic model.

Every collective the engine issues in a step (engine.py, units.py), priced with the ledger's byte
model (comm/ledger.py), so what it predicts is what the ledger records, unit for unit.
``zeropp estimate`` prices a whole step with it (:func:`step_transfers`); ``zeropp train`` prints
plain ZeRO-3's bytes on its own units, laid out as ZeRO-3 would (:func:`zero3_units`), beside the
ledger (:func:`zero3_step_bytes`, the baseline ZeRO++ and stages 1-2 are measured against). It
lives here, beside the ledger, rather than in the estimate package so that train.py imports it
without the estimator's command line.

Units are given as (padded numel, resident): padded as :class:`~zeropp.index.flat.FlatLayout` pads
them for the data-parallel ranks, resident when the unit is not gathered per use (stages 0-2, or
small enough: :meth:`~zeropp.zero.stages.StagePolicy.keeps_resident`).

With tensor parallelism (a data-parallel x tensor-parallel :class:`~zeropp.topology.Layout`) the
units are one tensor-parallel rank's local shards, and ZeRO's collectives run inside one
data-parallel group, priced on :meth:`~zeropp.topology.Layout.data_parallel_layout` (every group
sends the same). The tensor-parallel traffic is Megatron's (:func:`megatron_transfers`): per block
and micro-batch 2 all-reduces of b x s x h in forward and 2 in backward, plus, with activation
checkpointing, the forward all-reduces that recomputation repeats in backward
(:attr:`~zeropp.costs.memory.Activations.recomputed_all_reduces`: 1 in zeropp's runtime, 2 in the ZeRO
paper's layout), and with Pa one all-gather of the block's checkpoint before its recomputation
(:func:`activation_transfers`; the SC20 ZeRO paper §8). With sequence parallelism each all-reduce
becomes a reduce-scatter and an all-gather (the same bytes), plus an all-gather at each end of the
model, and the norms' partial gradients all-reduced with each unit's gradient reduction
(:func:`sequence_parallel_transfers`, :func:`sequence_parallel_ends`, :func:`norm_gradient_transfers`).
All stay inside a node (tensor-parallel groups are consecutive
ranks of one node).

Under DiLoCo's outer loop (``zero.outer`` on more than one node) each node trains a replica of its own:
the step's collectives are priced on one node (:meth:`~zeropp.index.ranks.Layout.one_node`: nothing
crosses a node, hpZ is off), and every ``outer_sync_every`` steps each rank exchanges its masters' change
with the other nodes (:func:`outer_transfers`: the only bytes between nodes) and the resident units'
new weights are gathered again inside the node; with ``outer_fragments`` one fragment of the units at a
time, staggered over those steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from zeropp.comm.ledger import PA_GATHER, ring_bytes
from zeropp.config.sections import ZeroConfig
from zeropp.costs.context_parallel import LEDGER_OP as ULYSSES_OP
from zeropp.costs.context_parallel import ulysses_bytes
from zeropp.costs.memory import BYTES, Activations
from zeropp.index.flat import FlatLayout, node_chunk_numel, outer_fragments, qgz_column_chunks
from zeropp.index.ranks import Layout
from zeropp.quant.spec import QuantSpec
from zeropp.zero.optim.owners import OWNER_OPS
from zeropp.zero.optim.spec import flat_only
from zeropp.zero.options import frozen_quant
from zeropp.zero.stages import StagePolicy

STEP_PHASES = ("forward", "backward", "step")
SCALE_BYTES = 4  # one fp32 scale per quantization block

UnitSize = tuple[int, bool]  # (padded numel, resident)


@dataclass(frozen=True)
class Transfer:
    """One collective call as one rank sees it: `sent` bytes under the ledger's byte model.

    `crossing` is the share of ranks whose bytes leave their node. A ring over consecutive ranks
    crosses at the last rank of each node it spans (the node's *edge* rank): (nodes spanned) / (group
    size), or 0 inside one node. An all-to-all hop is 0 (inside a node) or 1 (between nodes).
    `over_world`: the group is the world, else one data-parallel group (or, for ``tp.*`` and ``pa.*``
    ops, which never cross, one tensor-parallel group).
    """

    op: str
    phase: str
    sent: int
    crossing: float
    over_world: bool = False

    def crosses(self, rank: int, layout: Layout) -> bool:
        """Whether global `rank` sends this transfer's bytes off its node (to its ring successor)."""
        if self.crossing in (0, 1):
            return self.crossing == 1
        if not self.over_world:  # the rank's place in its data-parallel group, a node-major world of its own
            rank, layout = rank // layout.tensor_parallel_size, layout.data_parallel_layout()
        return rank % layout.ranks_per_node == layout.ranks_per_node - 1


def owner_transfers(psi: int, data_parallel: Layout) -> list[Transfer]:
    """The whole-parameter step's two exchanges (See [Note: the whole-parameter step]) as the mean rank
    sends them: its shard's pieces of the other ranks' parameters, fp32, to their owners and back, spread
    evenly over the other ranks of its data-parallel group; the share sent to other nodes crosses."""
    n, per_node = data_parallel.world_size, data_parallel.ranks_per_node
    if n == 1:
        return []
    sent, inter = 4 * psi / n * (n - 1) / n, (n - per_node) / (n - 1)
    shares = [(share, crossing) for share, crossing in ((1 - inter, 0.0), (inter, 1.0)) if share]
    return [Transfer(op, "step", round(sent * share), crossing) for op in OWNER_OPS for share, crossing in shares]


def ring_crossing(group_size: int, ranks_per_node: int) -> float:
    """Share of a ring's ranks (consecutive, node-major) whose successor lives on another node."""
    spanned = group_size // ranks_per_node if group_size > ranks_per_node else 1
    return spanned / group_size if spanned > 1 else 0.0


def quantized_row(spec: QuantSpec, n: int) -> tuple[int, int]:
    """Bytes of a row of `n` values block-quantized under `spec`: its int8/int4 data, its fp32 scales."""
    return spec.row_bytes(n), SCALE_BYTES * spec.blocks(n)


def master_numels(units: Iterable[UnitSize], data_parallel: Layout, zero: ZeroConfig) -> list[int]:
    """Master elements a rank holds of each unit: its padded numel over the `data_parallel` ranks where
    the optimizer state is sharded (stages 1-3), else whole."""
    ranks = data_parallel.world_size if zero.stage >= 1 else 1
    return [padded // ranks for padded, _ in units]


def master_numel(units: Iterable[UnitSize], data_parallel: Layout, zero: ZeroConfig) -> int:
    """Master elements a rank holds (:func:`master_numels`, summed)."""
    return sum(master_numels(units, data_parallel, zero))


def outer_transfers(
    units: Iterable[UnitSize], layout: Layout, zero: ZeroConfig, fragment: int | None = None
) -> list[Transfer]:
    """DiLoCo's synchronization on the (data-parallel x tensor-parallel) `layout` as a rank sends it (See
    [Note: the outer loop]), the `units` laid out on one node: the change of its masters (:func:`master_numel`)
    exchanged with its peers at its place on the other nodes, all of it between nodes: the fp32 all-reduce
    (a ring over the n nodes), 2 (n-1)/n x 4 bytes a value, or with ``outer_bits`` the change cut into n
    chunks of whole blocks (:func:`~zeropp.index.flat.node_chunk_numel`), each quantized (data and scales
    in one message): the all-to-all sends n-1 of them, the all-gather of the mean chunk (a ring) n-1 more;
    then, as after the inner step, every resident unit's new weights gathered inside the node
    (:func:`published_weights`, stages 1-3). With ``outer_fragments`` the same over the units of
    `fragment` (:func:`~zeropp.index.flat.outer_fragments` of their masters), or (None) every fragment's
    synchronization one after the other: what H steps exchange."""
    outer, nodes, units = zero.outer, layout.nodes, list(units)
    if nodes == 1 or not outer.enabled:
        return []
    replica = layout.one_node().data_parallel_layout()
    fragments = outer_fragments(master_numels(units, replica, zero), outer.fragments)
    return [
        t
        for f in (range(len(fragments)) if fragment is None else [fragment])
        for t in _fragment_sync([units[i] for i in fragments[f]], nodes, replica, zero)
    ]


def _fragment_sync(units: list[UnitSize], nodes: int, replica: Layout, zero: ZeroConfig) -> list[Transfer]:
    """One synchronization of `units` (:func:`outer_transfers`)."""
    outer, shard = zero.outer, master_numel(units, replica, zero)
    if outer.bits:
        chunk = node_chunk_numel(shard, nodes, outer.block_size)
        row = sum(quantized_row(QuantSpec(outer.bits, outer.block_size), chunk))
        exchange = [Transfer(op, "step", (nodes - 1) * row, 1.0) for op in ("all_to_all", "all_gather")]
    else:
        exchange = [Transfer("all_reduce", "step", ring_bytes(4 * shard, nodes, 2), 1.0)]
    published = [published_weights(padded, replica, zero) for padded, resident in units if resident]
    return [*exchange, *(published if zero.stage >= 1 else ())]


def published_weights(padded: int, data_parallel: Layout, zero: ZeroConfig) -> Transfer:
    """A resident unit's updated weights all-gathered from the masters' shards in the step (stages 1-3),
    pP over the `data_parallel` group."""
    sent = ring_bytes(padded * BYTES[zero.precision], data_parallel.world_size)
    return Transfer("all_gather", "step", sent, _world_crossing(data_parallel))


def step_transfers(
    units: Iterable[UnitSize],
    layout: Layout,
    zero: ZeroConfig,
    hpz: int,
    activations: Activations | None = None,
    *,
    first: bool = False,
    parameters: int = 0,
) -> Iterator[Transfer]:
    """The engine's collectives in one step on the (data-parallel x tensor-parallel) `layout`:
    :func:`unit_transfers` over a data-parallel group, the tensor- and context-parallel traffic of
    `activations` (:func:`activation_transfers`, :func:`ulysses_transfers`; None: neither is priced), then the step's
    scalars (the gradient norm, and fp16's overflow check: one fp32 all-reduce each, over the ranks
    whose masters differ: the world once the optimizer state is sharded, else the tensor-parallel group)
    and, unless the optimizer steps flat shards, which of the `parameters` trainable parameters got a
    gradient (a byte each, all-reduced over the data-parallel group: See [Note: segments]).
    `first`: the step after construction or a load (qWD sends the full weights then)."""
    tp = layout.tensor_parallel_size
    yield from unit_transfers(units, layout.data_parallel_layout(), zero, hpz, first=first)
    if activations is not None:
        micro = zero.gradient_accumulation_steps
        yield from activation_transfers(activations, tp, BYTES[zero.precision], micro)
        yield from ulysses_transfers(activations, tp, BYTES[zero.precision], micro)
        grad_bytes, reductions = BYTES[zero.grad_dtype or zero.precision], micro if zero.stage >= 2 else 1
        yield from norm_gradient_transfers(activations, tp, grad_bytes, reductions)
    if zero.stage >= 1 or tp > 1:
        for _ in range(2 if zero.precision == "fp16" else 1):
            if zero.stage >= 1:
                yield Transfer("all_reduce", "step", ring_bytes(4, layout.world_size, 2), _world_crossing(layout), True)
            else:
                yield Transfer("tp.all_reduce", "step", ring_bytes(4, tp, 2), 0.0)
    data_parallel = layout.data_parallel_layout()
    if parameters and data_parallel.world_size > 1 and flat_only(zero) is None:
        yield Transfer(
            "all_reduce", "step", ring_bytes(parameters, data_parallel.world_size, 2), _world_crossing(data_parallel)
        )


def megatron_transfers(
    block_elements: int, element_bytes: int, tp: int, recomputed: int = 0, sublayers: int = 2
) -> Iterator[Transfer]:
    """One block's tensor-parallel all-reduces in one micro-batch under Megatron's layout (a ring over
    the tp ranks, 2 (tp-1)/tp of the buffer each): the row-wise linears' outputs in forward (one per
    split sub-layer, `sublayers`: attention and the MLP, or attention alone before a mixture of
    experts), the column-wise linears' input gradients in backward (as many), and `recomputed` of the
    forward's again in recomputation, which runs in backward (0 without activation checkpointing)."""
    sent = ring_bytes(block_elements * element_bytes, tp, passes=2)
    for phase, count in (("forward", sublayers), ("backward", sublayers + min(recomputed, sublayers))):
        for _ in range(count):
            yield Transfer("tp.all_reduce", phase, sent, 0.0)


# Sequence parallelism's forward collectives per block, attention's then the MLP's: an all-gather of the
# sub-layer's input, a reduce-scatter of its row-wise linear's output; in backward each one's mirror image
SEQUENCE_PARALLEL_FORWARD = ("tp.all_gather", "tp.reduce_scatter") * 2
MIRROR = {"tp.all_gather": "tp.reduce_scatter", "tp.reduce_scatter": "tp.all_gather"}
# Activations.recomputed_all_reduces -> the forward collectives recomputation repeats with sequence
# parallelism: zeropp's runtime (1) stops after the MLP's all-gather (its output is saved for backward,
# the reduce-scatter after it feeds nothing backward needs), the ZeRO paper's layout (2) the whole forward
SEQUENCE_PARALLEL_RECOMPUTED = {0: 0, 1: 3, 2: 4}


def sequence_parallel_transfers(
    block_elements: int, element_bytes: int, tp: int, recomputed: int = 0
) -> Iterator[Transfer]:
    """One block's tensor-parallel collectives in one micro-batch with sequence parallelism, each of
    b x s x h (the gathered output, the scattered input), (tp-1)/tp of it per rank: Megatron's bytes,
    each all-reduce now a reduce-scatter and an all-gather. :data:`SEQUENCE_PARALLEL_FORWARD` in
    forward, their mirror images in backward, and the first `recomputed` of the forward's again there."""
    sent = ring_bytes(block_elements * element_bytes, tp)
    for phase, ops in (
        ("forward", SEQUENCE_PARALLEL_FORWARD),
        ("backward", (*(MIRROR[op] for op in SEQUENCE_PARALLEL_FORWARD), *SEQUENCE_PARALLEL_FORWARD[:recomputed])),
    ):
        for op in ops:
            yield Transfer(op, phase, sent, 0.0)


def sequence_parallel_ends(activations: Activations, tp: int, element_bytes: int) -> Iterator[Transfer]:
    """Sequence parallelism's collectives outside the blocks, per micro-batch: the (whole) head's input
    all-gathered in forward, the first block's input gradient all-gathered in backward (the slicing of
    the whole embeddings' output and of the head's input gradient are local)."""
    sent = ring_bytes(activations.block_elements * element_bytes, tp)
    yield Transfer("tp.all_gather", "forward", sent, 0.0)
    yield Transfer("tp.all_gather", "backward", sent, 0.0)


def norm_gradient_transfers(activations: Activations, tp: int, grad_bytes: int, reductions: int) -> Iterator[Transfer]:
    """Sequence parallelism's norm gradients: each tensor-parallel rank's is the partial sum over its
    slice of the sequence. A unit all-reduces its norms' partial sums as one message when it reduces
    its gradients: every micro-batch at stages 2-3, once a step at 0-1 (`reductions`), in the gradient
    dtype. Priced as one message of all norm parameters per reduction: the same bytes however the
    units divide them (each a multiple of the ring's share)."""
    if tp == 1 or not activations.sequence_parallel:
        return
    numel = activations.norm_parameters * activations.hidden
    for _ in range(reductions):
        yield Transfer("tp.all_reduce", "backward", ring_bytes(numel * grad_bytes, tp, 2), 0.0)


def activation_transfers(activations: Activations, tp: int, element_bytes: int, micro: int) -> Iterator[Transfer]:
    """The tensor-parallel traffic of one step: every block's :func:`megatron_transfers` per micro-batch
    and, with Pa, the all-gather of its partitioned checkpoint (tp partitions of ceil(bsh/tp)) right
    before its recomputation: bsh (tp-1)/tp bytes per block, 1/12 of the block's all-reduces in the ZeRO
    paper's layout (§8), 1/10 in zeropp's runtime (:attr:`~zeropp.costs.memory.Activations.recomputed_all_reduces`).
    With sequence parallelism: :func:`sequence_parallel_transfers` per block and
    :func:`sequence_parallel_ends` per micro-batch; Pa moves nothing (a checkpoint is 1/tp already)."""
    if tp == 1:
        return
    recomputed = activations.recomputed_all_reduces if activations.activation_checkpointing else 0
    gathered = tp * activations.checkpoint_elements(tp) * element_bytes
    for _ in range(micro):
        if activations.sequence_parallel:
            yield from sequence_parallel_ends(activations, tp, element_bytes)
        for _ in range(activations.layers):
            if activations.sequence_parallel:
                yield from sequence_parallel_transfers(
                    activations.block_elements, element_bytes, tp, SEQUENCE_PARALLEL_RECOMPUTED[recomputed]
                )
                continue
            yield from megatron_transfers(
                activations.block_elements, element_bytes, tp, recomputed, activations.split_sublayers
            )
            if activations.partition_activations:
                yield Transfer(PA_GATHER, "backward", ring_bytes(gathered, tp), 0.0)


def ulysses_transfers(activations: Activations, tp: int, element_bytes: int, micro: int) -> Iterator[Transfer]:
    """Every all-to-all of one step's attention layers, as multi-head attention over the hidden width
    (a tensor-parallel rank's 1/tp of it): per block and micro-batch, q, k, v and the output forward,
    their gradients backward, and with activation checkpointing the forward's four again in backward
    (the recomputation); inside one node (the context-parallel group is)."""
    cp = activations.context_parallel
    if cp == 1:
        return
    width = activations.hidden // tp
    per_tensor = ulysses_bytes(activations.batch, activations.seq, 1, 1, width, cp, element_bytes) // 4
    backward = 8 if activations.activation_checkpointing else 4
    for _ in range(micro * activations.layers):
        for phase, calls in (("forward", 4), ("backward", backward)):
            for _ in range(calls):
                yield Transfer(ULYSSES_OP, phase, per_tensor, 0.0)


def unit_transfers(
    units: Iterable[UnitSize], layout: Layout, zero: ZeroConfig, hpz: int, *, first: bool = False
) -> Iterator[Transfer]:
    """Every unit's collectives in one step, `hpz` the secondary group size (1: off).

    Stage 0 all-reduces gradients once per step; stage 1 reduce-scatters them once per step and stage 2
    and 3 every micro-batch; resident units all-gather the updated weights in the step. A sharded unit
    gathers in forward and backward of every micro-batch: over the world (qwZ: quantized; qWD:
    :func:`_changed_weights`, `first`: the step after construction or a load), or, with hpZ, inside its
    secondary group in the compute dtype once the step's first forward has cut the copy.
    """
    world, per_node = layout.world_size, layout.ranks_per_node
    compute, grad = BYTES[zero.precision], BYTES[zero.grad_dtype or zero.precision]
    micro = zero.gradient_accumulation_steps
    across_world = _world_crossing(layout)
    for padded, resident in units:
        if zero.stage == 0:
            yield Transfer("all_reduce", "backward", ring_bytes(padded * grad, world, 2), across_world)
            continue
        for _ in range(micro if zero.stage >= 2 else 1):
            yield from _reduce_gradients(padded, grad, layout, zero)
        if resident:
            yield published_weights(padded, layout, zero)
            continue
        for index in range(micro):
            for phase in ("forward", "backward"):
                if hpz > 1 and (index, phase) != (0, "forward"):
                    yield Transfer("all_gather", phase, ring_bytes(padded * compute, hpz), ring_crossing(hpz, per_node))
                else:
                    yield from _changed_weights(padded, compute, phase, layout, zero, hpz, first)


def frozen_transfers(frozen: Iterable[int], layout: Layout, zero: ZeroConfig, hpz: int) -> Iterator[Transfer]:
    """The gathers of the units' frozen weights in one step (stage 3; `frozen`: each sharded unit's
    padded frozen numel): in forward and backward of every micro-batch, beside the unit's own gather,
    over the world (qwZ: quantized; ``quantized_nontrainable_weights``: every rank's stored message of
    int8 or int4 data and fp32 scales), or with hpZ inside the secondary group from the first use on
    (the copy is cut once: frozen values never change; stored messages too when quantized). Nothing
    reduced, nothing gathered in the step. A unit whose backward needs no weights (no gradient
    reaches it) is not gathered in backward."""
    world, compute, crossing = layout.world_size, BYTES[zero.precision], _world_crossing(layout)
    spec = frozen_quant(zero)
    for padded in frozen:
        shard = padded // world
        stored = world * sum(quantized_row(spec, shard)) if spec else padded * compute
        for _ in range(zero.gradient_accumulation_steps):
            for phase in ("forward", "backward"):
                if hpz > 1:
                    yield Transfer(
                        "all_gather", phase, ring_bytes(stored, hpz), ring_crossing(hpz, layout.ranks_per_node)
                    )
                elif spec is not None:
                    yield Transfer("all_gather", phase, ring_bytes(stored, world), crossing)
                else:
                    yield from _gather_weights(padded, compute, phase, world, crossing, zero)


def generation_transfers(
    units: Iterable[UnitSize],
    layout: Layout,
    zero: ZeroConfig,
    hpz: int,
    forwards: int,
    gathered: bool,
    *,
    first: bool = False,
) -> Iterator[Transfer]:
    """The weight all-gathers of one ``engine.generate`` call of `forwards` forward passes (one per new
    token), in the ledger's eval phase: every sharded unit once inside ``engine.gathered()``, else once
    per forward. A unit's first gather after its weights changed goes over the world (qwZ: quantized;
    qWD: :func:`_changed_weights`, `first`: no gather since construction or a load); with hpZ the later
    ones stay inside the secondary group. Resident units move nothing."""
    compute, across_world = BYTES[zero.precision], _world_crossing(layout)
    for padded, resident in units:
        if resident:
            continue
        yield from _changed_weights(padded, compute, "eval", layout, zero, hpz, first)
        for _ in range(0 if gathered else forwards - 1):
            if hpz > 1:
                yield Transfer(
                    "all_gather", "eval", ring_bytes(padded * compute, hpz), ring_crossing(hpz, layout.ranks_per_node)
                )
            else:
                yield from _gather_weights(padded, compute, "eval", layout.world_size, across_world, zero)


def zero3_units(layouts: Iterable[FlatLayout], layout: Layout, zero: ZeroConfig) -> list[UnitSize]:
    """Units as ZeRO-3 would lay them out, whatever stage they run at: padded for the world, sharded
    unless under the persistence threshold (at stages 0-2 every unit is resident, and stage 0 pads
    for one rank)."""
    stage3 = StagePolicy.for_stage(3)
    threshold = zero.persistence_threshold
    world = layout.world_size
    return [
        (dataclasses.replace(f, world=world).padded_numel, stage3.keeps_resident(f.numel, threshold, world))
        for f in layouts
    ]


def zero3_step_bytes(
    units: Iterable[UnitSize], layout: Layout, zero: ZeroConfig, frozen: Iterable[int] = ()
) -> dict[str, dict[str, float]]:
    """{phase: {'intra', 'inter'}}: what plain ZeRO-3 (every ZeRO++ switch off) would send per rank,
    mean over ranks, on these units (and the `frozen` weights of :func:`frozen_transfers`) under
    `zero`'s precision and accumulation.

    :func:`unit_transfers` at stage 3 without qwZ, hpZ, qgZ or quantized frozen weights; the step's
    scalar all-reduces are left out (a few bytes, and not ZeRO-3's traffic). Every transfer is a ring
    over the world, so a phase's bytes split by the world ring's crossing share.
    """
    plain = dataclasses.replace(
        zero, stage=3, quantized_weights=False, quantized_gradients=False, quantized_nontrainable_weights=False,
        nontrainable_weight_bits=8,
    )  # fmt: skip
    sent = dict.fromkeys(STEP_PHASES, 0)
    for transfer in (*unit_transfers(units, layout, plain, hpz=1), *frozen_transfers(frozen, layout, plain, hpz=1)):
        sent[transfer.phase] += transfer.sent
    crossing = _world_crossing(layout)
    return {phase: {"intra": b * (1 - crossing), "inter": b * crossing} for phase, b in sent.items()}


def _world_crossing(layout: Layout) -> float:
    return ring_crossing(layout.world_size, layout.ranks_per_node)


def _changed_weights(
    padded: int, compute: int, phase: str, layout: Layout, zero: ZeroConfig, hpz: int, first: bool
) -> Iterator[Transfer]:
    """A sharded unit's gather after its weights changed: over the world (qwZ: quantized). With qWD
    (See [Note: qWD's reference]) the reference inside the secondary group in the compute dtype and each
    rank's change quantized over the world (qwZ's bytes), or, on the `first` gather after construction
    or a load, the full weights unquantized over the world."""
    world, crossing = layout.world_size, _world_crossing(layout)
    if zero.qwz.delta:
        if first:
            yield Transfer("all_gather", phase, ring_bytes(padded * compute, world), crossing)
            return
        yield Transfer(
            "all_gather", phase, ring_bytes(padded * compute, hpz), ring_crossing(hpz, layout.ranks_per_node)
        )
    yield from _gather_weights(padded, compute, phase, world, crossing, zero)


def _gather_weights(
    padded: int, compute: int, phase: str, world: int, crossing: float, zero: ZeroConfig
) -> Iterator[Transfer]:
    """All-gather of a unit's weights over the world; qwZ gathers int8/int4 data and fp32 scales, each
    rank's shard quantized as one row."""
    if not zero.qwz.enabled:
        yield Transfer("all_gather", phase, ring_bytes(padded * compute, world), crossing)
        return
    spec, shard = QuantSpec(zero.qwz.bits, zero.qwz.block), padded // world
    for row in quantized_row(spec, shard):
        yield Transfer("all_gather", phase, ring_bytes(world * row, world), crossing)


def _reduce_gradients(padded: int, grad: int, layout: Layout, zero: ZeroConfig) -> Iterator[Transfer]:
    """Reduce-scatter of a unit's gradients: a ring over the world, or qgZ's two all-to-all hops.

    qgZ (comm/quantized.py) cuts the shard's columns into chunks; per chunk of c columns, hop 1 sends
    (X-1)/X of the W quantized rows inside the node (gradient_intra_node_bits; 0: c values of the gradient
    dtype per row, no scales) and hop 2 sends (Y-1)/Y
    of the Y re-quantized partial sums to the other nodes (gradient_bits; X ranks per node, Y nodes,
    W = XY); data and scales (sent in one message, counted here one after the other).
    """
    world, per_node, nodes = layout.world_size, layout.ranks_per_node, layout.nodes
    qgz = zero.qgz
    if not qgz.enabled:
        yield Transfer("reduce_scatter", "backward", ring_bytes(padded * grad, world), _world_crossing(layout))
        return
    spec, shard = QuantSpec(qgz.bits, qgz.block_size), padded // world
    intra_spec = QuantSpec(qgz.intra_node_bits or qgz.bits, qgz.block_size)
    chunks = qgz_column_chunks(shard, zero.reduce_bucket_numel, qgz.pipeline_chunks, qgz.pipeline_min_chunk)
    for start, stop in chunks:
        c = stop - start
        intra = quantized_row(intra_spec, c) if qgz.intra_node_quantized else (c * grad, 0)
        for intra_row, inter_row in zip(intra, quantized_row(spec, c), strict=True):
            if per_node > 1 and intra_row:
                yield Transfer("all_to_all", "backward", (per_node - 1) * nodes * intra_row, 0.0)
            if nodes > 1:
                yield Transfer("all_to_all", "backward", (nodes - 1) * inter_row, 1.0)
