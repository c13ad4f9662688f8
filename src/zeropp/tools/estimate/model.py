"""The estimator's model of one optimizer step: units, memory of model states, bytes and time.

Memory per rank is :func:`zeropp.costs.memory.analytic_model_state_bytes` per unit (ZeRO Table 1, hpZ's
secondary copy) on the padded unit sizes the engine allocates, plus the activation checkpoints
(:class:`~zeropp.costs.memory.Activations`, ZeRO-R); bytes are :mod:`zeropp.costs.volume`'s transfers
(what the ledger records); time is the busiest link of each kind without overlap (docs/estimate.md).

A LoRA-style run (``frozen_fraction``) leaves that share of every unit's parameters frozen: no
gradient, master or optimizer state; at stage 3 sharded in a flat buffer of its own and gathered per
use (:func:`~zeropp.costs.volume.frozen_transfers`), stored quantized with
``quantized_nontrainable_weights``; below stage 3 whole on every rank and never sent.

With tensor parallelism (dp x tp ranks) a unit is one tensor-parallel rank's share of it (its split
weights' local shards plus its whole ones) and the ZeRO formulas run over the dp ranks of a
data-parallel group: the ZeRO paper's §7, Ψ/N_m per device for model parallelism of N_m.

Under DiLoCo's outer loop (``zero.outer`` on more than one node) each node is a replica: ZeRO shards
over one node's data-parallel ranks (memory with the outer loop's fp32 anchor, momentum and residuals),
a step's collectives stay inside the node, and each rank's exchange at a synchronization
(:func:`~zeropp.costs.volume.outer_transfers`) counts per sync and, spread over its H steps, per step;
with ``outer_fragments`` per fragment, each synchronized once in H steps at its own step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from zeropp.comm.ledger import Ledger, bytes_under
from zeropp.config.sections import ZeroConfig
from zeropp.costs.expert_parallel import MixtureOfExperts, expert_transfers
from zeropp.costs.memory import (
    BYTES,
    Activations,
    analytic_model_state_bytes,
    disk_tier_bytes,
    outer_state_bytes,
    owner_state_bytes,
    stage3_transient_bytes,
)
from zeropp.costs.step_time import Backend, StepTime, step_seconds
from zeropp.costs.volume import (
    STEP_PHASES,
    Transfer,
    frozen_transfers,
    master_numel,
    master_numels,
    outer_transfers,
    owner_transfers,
    step_transfers,
    unit_transfers,
    zero3_step_bytes,
)
from zeropp.index.flat import FlatLayout
from zeropp.index.ranks import Layout
from zeropp.zero.optim.outer import refuse_fragments, runs_outer_loop
from zeropp.zero.optim.owners import refuse_whole_with
from zeropp.zero.options import frozen_quant, refuse_qwd_without_hpz
from zeropp.zero.stages import StagePolicy


@dataclass(frozen=True)
class Unit:
    numel: int  # trainable
    padded: int
    resident: bool  # not gathered per use: stages 0-2, or at most zero.persistence_threshold elements
    frozen: int = 0  # frozen parameters (a LoRA run's base)
    frozen_padded: int = 0  # their flat buffer's padded numel at stage 3, else `frozen`
    experts: bool = False  # an experts container: sharded over the ranks holding the same experts


@dataclass(frozen=True)
class Estimate:
    """One optimizer step of a model on a cluster under a ZeroConfig (built by :func:`estimate`)."""

    units: tuple[Unit, ...]  # one tensor-parallel rank's
    layout: Layout  # data-parallel x tensor-parallel
    zero: ZeroConfig
    hpz_group_size: int
    optimizer_bytes: int
    transfers: tuple[Transfer, ...]
    activations: Activations | None = None  # the transformer's shape and ZeRO-R switches; None: not priced
    whole_parameters: bool = False  # the optimizer steps whole parameters on owner ranks
    diloco: bool = False  # DiLoCo's outer loop runs: every node a replica (See [Note: the outer loop])
    sync_transfers: tuple[tuple[Transfer, ...], ...] = ()  # DiLoCo: each fragment's synchronization

    @property
    def data_parallel(self) -> Layout:
        """One data-parallel group as a world of its own."""
        return self.layout.data_parallel_layout()

    @property
    def shard_layout(self) -> Layout:
        """What ZeRO partitions over: one data-parallel group, under DiLoCo one node's part of it."""
        return (self.layout.one_node() if self.diloco else self.layout).data_parallel_layout()

    @property
    def shard_numel(self) -> int:
        """Master elements per rank (:func:`~zeropp.costs.volume.master_numel`)."""
        return master_numel([(u.padded, u.resident) for u in self.units], self.shard_layout, self.zero)

    @property
    def unit_shard_numels(self) -> list[int]:
        """Master elements per rank of each unit (:func:`~zeropp.costs.volume.master_numels`)."""
        return master_numels([(u.padded, u.resident) for u in self.units], self.shard_layout, self.zero)

    @property
    def psi(self) -> int:
        return sum(u.numel for u in self.units)

    @property
    def padded_psi(self) -> int:
        return sum(u.padded for u in self.units)

    @property
    def frozen_psi(self) -> int:
        return sum(u.frozen for u in self.units)

    @property
    def model_state_bytes(self) -> float:
        """Per rank, wherever they live (:meth:`model_state_bytes_on`)."""
        return self.model_state_bytes_on("all")

    def model_state_bytes_on(self, where: str) -> float:
        """Per rank on the device, the host (ZeRO-Offload), the disk (ZeRO-Infinity's tiers: their host
        rings are :meth:`disk_tiers`'), or all. A resident unit at stage 3 keeps whole weights on the
        device and no secondary copy: stage 2's formula. DiLoCo's state is the whole shard's (its
        exchange pads each fragment's shard at once), beside the masters."""
        zero, world, offload = self.zero, self.shard_layout.world_size, self.zero.offload
        ep, experts_hpz = self.layout.expert_parallel_size, self.layout.expert_hpz_group_size(self.hpz_group_size)
        # the whole-parameter owners' state and DiLoCo's, held once per rank rather than per unit
        held = owner_state_bytes(self.psi, world) if self.whole_parameters and where in ("device", "all") else 0
        beside_masters = "host" if offload.optimizer != "none" else "device"  # the disk tier is refused with it
        if self.diloco and where in ("all", beside_masters):
            held += outer_state_bytes(self.unit_shard_numels, zero.outer, self.layout.nodes)
        return held + sum(
            analytic_model_state_bytes(
                u.padded,
                world // ep if u.experts else world,
                2 if zero.stage == 3 and u.resident else zero.stage,
                zero.precision,
                zero.grad_dtype,
                self.optimizer_bytes,
                1 if u.resident else experts_hpz if u.experts else self.hpz_group_size,
                offload_optimizer=offload.optimizer != "none",
                offload_params=offload.params != "none" and not u.resident,
                optimizer_on_disk=offload.optimizer == "nvme",
                params_on_disk=offload.params == "nvme" and not u.resident,
                master_dtype=zero.master_dtype,
                where=where,
                qgz_residuals=self.qgz_residual_layout,
                frozen=u.frozen_padded,
                frozen_quant=frozen_quant(zero),
                qwd_reference=zero.qwz.delta and not u.resident,
            )
            for u in self.units
        )

    def disk_tiers(self) -> dict[str, int] | None:
        """ZeRO-Infinity's disk tiers per rank (None without them): :func:`disk_tier_bytes`."""
        if "nvme" not in (self.zero.offload.optimizer, self.zero.offload.params):
            return None
        world = self.shard_layout.world_size if self.zero.stage >= 1 else 1
        shards = [(math.ceil(u.padded / world), not u.resident) for u in self.units]
        return disk_tier_bytes(self.zero, shards, self.optimizer_bytes, self.hpz_group_size > 1)

    @property
    def qgz_residual_layout(self) -> tuple[int, int, bool] | None:
        """(ranks per node, nodes, intra-node hop quantized) where qgZ's error feedback keeps residuals, else None."""
        zero = self.zero
        feedback = zero.stage == 3 and zero.qgz.feedback
        layout = (self.shard_layout.ranks_per_node, self.shard_layout.nodes, zero.qgz.intra_node_quantized)
        return layout if feedback else None

    def transient_bytes(self) -> dict[str, int] | None:
        """Stage 3's bytes per rank beside the model states while a step runs (None at stages 0-2): the
        units gathered at once (frozen weights counted in the compute dtype) and the whole gradients of
        the unit in backward and of the reductions in flight (trainable parameters only)."""
        gathered = self.gathered_per_use
        if not gathered:
            return None
        zero = self.zero
        return stage3_transient_bytes(
            largest_gathered=max(u.padded + u.frozen_padded for u in gathered),
            largest_trainable=max(u.padded for u in gathered),
            world=self.shard_layout.world_size,
            compute_bytes=BYTES[zero.precision],
            grad_bytes=BYTES[zero.grad_dtype or zero.precision],
            prefetch=zero.prefetch,
        )

    def activation_bytes(self) -> int | None:
        """Per rank, what the forward saves for backward (the embedded GPT's; None: not modeled)."""
        return (
            None
            if self.activations is None
            else self.activations.saved_bytes(BYTES[self.zero.precision], self.layout.tensor_parallel_size)
        )

    def activation_checkpoint_bytes(self, where: str = "device") -> int:
        """Per rank, held from forward to backward (ZeRO-R: /tp with Pa, on the host with Pa+cpu)."""
        if self.activations is None:
            return 0
        return self.activations.checkpoint_bytes(self.layout.tensor_parallel_size, BYTES[self.zero.precision], where)

    def synced_after(self, step: int) -> tuple[int, ...]:
        """The fragments DiLoCo synchronizes after inner step `step` (from 1; none without it)."""
        return self.zero.outer.synced_after(step) if self.diloco else ()

    def ledger(self, rank: int | None = None, synced: bool | Iterable[int] | None = None) -> Ledger:
        """Bytes per optimizer step as the engine's ledger records them: global `rank`'s, or the mean over
        ranks. Under DiLoCo a fragment's exchange counts whole at a step that synchronizes it (`synced`:
        the fragments it synchronizes, :meth:`synced_after`; True: every fragment, plain DiLoCo's
        synchronization; False: none), and by default every fragment's spread over its H steps (1/H of
        each a step, as each fragment synchronizes once in H steps)."""
        ledger = Ledger(steps=1)
        every = self.zero.outer.sync_every if synced is None else 1
        everyone = range(len(self.sync_transfers))
        fragments = everyone if synced is None or synced is True else () if synced is False else synced
        outer = [(t, t.sent / every if every > 1 else t.sent) for f in fragments for t in self.sync_transfers[f]]
        for t, sent in (*((t, t.sent) for t in self.transfers), *outer):
            with ledger.in_phase(t.phase):
                if rank is None:
                    ledger.record(t.op, sent * (1 - t.crossing), sent * t.crossing)
                elif t.crosses(rank, self.layout):
                    ledger.record(t.op, 0, sent)
                else:
                    ledger.record(t.op, sent, 0)
        return ledger

    def outer_exchange(self) -> dict[str, Any] | None:
        """DiLoCo's exchange (None without it): the bytes between nodes a rank and a node send per
        synchronization of the whole model (with fragments, every fragment's once: H steps' worth), per
        fragment's synchronization, and per step (/H)."""
        if not self.diloco:
            return None
        outer, per_node = self.zero.outer, self.layout.ranks_per_node
        fragments = [sum(t.sent for t in sync if t.crossing) for sync in self.sync_transfers]
        per_sync = sum(fragments)
        # resident units' new weights
        regathered = sum(t.sent for sync in self.sync_transfers for t in sync if not t.crossing)
        return {
            "sync_every": outer.sync_every, "bits": outer.bits, "shard_numel": self.shard_numel,
            "fragments": outer.fragments, "fragment_bytes_per_sync_per_rank": fragments,
            "bytes_per_sync_per_rank": per_sync, "node_bytes_per_sync": per_node * per_sync,
            "bytes_per_step_per_rank": per_sync / outer.sync_every,
            "node_bytes_per_step": per_node * per_sync / outer.sync_every,
            "intra_node_bytes_per_sync_per_rank": regathered,
        }  # fmt: skip

    def node_inter_bytes(self) -> float:
        """Bytes leaving one node per step (every node sends the same)."""
        return self.layout.ranks_per_node * self.ledger().total(link="inter")

    def _busiest_intra_ledger(self) -> Ledger:
        """The ledger of the rank that sends the most inside its node (a node's first or last)."""
        per_node = self.layout.ranks_per_node
        return max((self.ledger(rank) for rank in {0, per_node - 1}), key=lambda ledger: ledger.total(link="intra"))

    def busiest_intra_bytes(self) -> int:
        """Intra-node bytes per step of the rank that sends the most inside its node."""
        return self._busiest_intra_ledger().total(link="intra")

    def seconds(self, intra_bits_per_s: float, inter_bits_per_s: float) -> dict[str, float]:
        intra = 8 * self.busiest_intra_bytes() / intra_bits_per_s
        inter = 8 * self.node_inter_bytes() / inter_bits_per_s
        return {"intra": intra, "inter": inter, "total": intra + inter}

    def phase_bytes(self, backend: Backend = "nccl") -> dict[str, dict[str, int]]:
        """Per phase, the busiest rank's intra-node bytes and a node's inter-node bytes as `backend`
        sends them: gloo's reduce-scatters count twice (:mod:`zeropp.costs.step_time`)."""
        per_node, mean, busiest = self.layout.ranks_per_node, self.ledger(), self._busiest_intra_ledger()

        def sent(ledger: Ledger, phase: str, link: str) -> int:
            doubled = ledger.total(op="reduce_scatter", phase=phase, link=link) if backend == "gloo" else 0
            return ledger.total(phase=phase, link=link) + doubled

        return {
            p: {"intra": sent(busiest, p, "intra"), "inter": per_node * sent(mean, p, "inter")} for p in STEP_PHASES
        }

    def comm_seconds_by_phase(
        self, intra_bits_per_s: float, inter_bits_per_s: float, backend: Backend = "nccl"
    ) -> dict[str, float]:
        """Seconds on the wire per phase, the links taken one after the other (:meth:`phase_bytes`)."""
        return {
            phase: 8 * sent["intra"] / intra_bits_per_s + 8 * sent["inter"] / inter_bits_per_s
            for phase, sent in self.phase_bytes(backend).items()
        }

    @property
    def gathered_per_use(self) -> list[Unit]:
        """The units gathered for every use: stage 3's, but for those kept whole (resident: every unit
        below stage 3, a unit within ``persistence_threshold``, one whose shard group is one rank)."""
        return [u for u in self.units if not u.resident]

    @property
    def gathered_units(self) -> int:
        return len(self.gathered_per_use)

    def step_time(
        self, compute_s: float, intra_bits_per_s: float, inter_bits_per_s: float, backend: Backend = "nccl"
    ) -> StepTime:
        """A step of `compute_s` seconds of compute with its communication overlapped as stage 3
        pipelines it over the units gathered per use (:func:`zeropp.costs.step_time.step_seconds`)."""
        comm = self.comm_seconds_by_phase(intra_bits_per_s, inter_bits_per_s, backend)
        return step_seconds(compute_s, comm, self.gathered_units)

    def zero3_bytes(self) -> dict[str, dict[str, float]]:
        """What plain ZeRO-3 would send on the same units ({phase: {link: mean bytes per rank}})."""
        return zero3_step_bytes(
            [(u.padded, u.resident) for u in self.units], self.data_parallel, self.zero, self.gathered_frozen
        )

    @property
    def gathered_frozen(self) -> list[int]:
        """The padded frozen numel of every unit that gathers its frozen weights per use (stage 3)."""
        return [u.frozen_padded for u in self.gathered_per_use if u.frozen]

    def bytes_of(self, prefix: str) -> float:
        """Bytes per rank and step of the ledger's ops named `prefix`.*: ``tp``, the tensor-parallel
        layers' collectives; ``pa``, Pa's all-gathers of the activation checkpoints; ``cp``, Ulysses'
        all-to-alls."""
        return bytes_under(self.ledger().as_dict(), prefix)

    def _activation_fields(self) -> dict[str, Any]:
        """What depends on the activations: None each where they are unknown (not priced)."""
        known = self.activations is not None
        return {
            "activations": dataclasses.asdict(self.activations) if known else None,
            "activation_bytes_per_rank": self.activation_bytes(),
            "activation_checkpoint_bytes_per_rank": self.activation_checkpoint_bytes() if known else None,
            "activation_checkpoint_host_bytes_per_rank": self.activation_checkpoint_bytes("host") if known else None,
            "tensor_parallel_bytes_per_step": self.bytes_of("tp") if known else None,
            "context_parallel_bytes_per_step": self.bytes_of("cp") if known else None,
            "partitioned_activation_bytes_per_step": self.bytes_of("pa") if known else None,
        }

    def as_dict(
        self,
        intra_bits_per_s: float,
        inter_bits_per_s: float,
        compute_s: float | None = None,
        backend: Backend = "nccl",
    ) -> dict[str, Any]:
        mean, zero3 = self.ledger(), self.zero3_bytes()
        step = None if compute_s is None else self.step_time(compute_s, intra_bits_per_s, inter_bits_per_s, backend)
        return {
            "params": self.psi + self.frozen_psi,
            "trainable_params": self.psi,
            "frozen_params": self.frozen_psi,
            "padded_params": self.padded_psi,
            "unit_numels": [u.numel for u in self.units],
            "world_size": self.layout.world_size,
            "nodes": self.layout.nodes,
            "ranks_per_node": self.layout.ranks_per_node,
            "tensor_parallel_size": self.layout.tensor_parallel_size,
            "data_parallel_size": self.data_parallel.world_size,
            "zero": dataclasses.asdict(self.zero),
            "hpz_group_size": self.hpz_group_size,
            "optimizer_state_bytes": self.optimizer_bytes,
            "optimizer_path": "whole" if self.whole_parameters else "flat",
            "model_state_bytes_per_rank": self.model_state_bytes,
            "model_state_bytes_per_rank_by_tier": {w: self.model_state_bytes_on(w) for w in ("device", "host", "disk")},
            "disk_tiers_per_rank": self.disk_tiers(),
            "outer_exchange": self.outer_exchange(),
            "stage3_transient_bytes_per_rank": self.transient_bytes(),
            **self._activation_fields(),
            "bytes_per_step": {
                phase: {link: mean.total(phase=phase, link=link) for link in ("intra", "inter")}
                for phase in STEP_PHASES
            },
            "intra_node_bytes_per_step": mean.total(link="intra"),
            "inter_node_bytes_per_step": mean.total(link="inter"),
            "ledger": mean.as_dict(),
            "node_inter_node_bytes_per_step": self.node_inter_bytes(),
            "busiest_rank_intra_node_bytes_per_step": self.busiest_intra_bytes(),
            "zero3_inter_node_bytes_per_step": sum(zero3[p]["inter"] for p in STEP_PHASES),
            "bandwidth_bits_per_s": {"intra": intra_bits_per_s, "inter": inter_bits_per_s},
            "predicted_comm_seconds_per_step": self.seconds(intra_bits_per_s, inter_bits_per_s),
            "backend": backend,
            "compute_seconds_per_step": compute_s,
            "predicted_step_seconds": None if step is None else dataclasses.asdict(step) | {"total_s": step.total_s},
        }


def expert_unit_transfers(
    est: Estimate, experts: MixtureOfExperts | None, activations: Activations | None
) -> list[Transfer]:
    """Expert parallelism's collectives in one step: the experts units' over the ranks holding the same
    experts (hpZ: those of a dense secondary group), with `activations` the layers' dispatch and combine."""
    if experts is None or experts.expert_parallel == 1:
        return []
    zero, layout, micro = est.zero, est.layout, est.zero.gradient_accumulation_steps
    holders = Layout(layout.data_parallel_size // experts.expert_parallel, layout.nodes)
    hpz = layout.expert_hpz_group_size(est.hpz_group_size)
    transfers = list(unit_transfers(((u.padded, u.resident) for u in est.units if u.experts), holders, zero, hpz))
    if activations is not None:
        tokens, recomputed = activations.batch * activations.seq, activations.activation_checkpointing
        transfers += expert_transfers(experts, tokens, activations.hidden, BYTES[zero.precision], micro, recomputed)
    return transfers


def estimate(
    model: int | Sequence[int | Sequence[int]],
    world: int,
    nodes: int = 1,
    zero: ZeroConfig | None = None,
    *,
    optimizer_bytes: int = 8,
    tensor_parallel: int = 1,
    activations: Activations | None = None,
    frozen_fraction: float = 0.0,
    whole_parameters: bool = False,
    experts: MixtureOfExperts | None = None,
    expert_units: Sequence[int | Sequence[int]] = (),
) -> Estimate:
    """Estimate one optimizer step of `model` on `world` ranks over `nodes` nodes under `zero`
    (ZeroConfig's defaults when None), with `tensor_parallel` ranks splitting each weight matrix.

    `model`: Ψ as one flat unit, every weight split over the tensor-parallel ranks (ceil(Ψ/tp) per
    rank, the ZeRO paper's Ψ/N_m), or every unit on one tensor-parallel rank: its numel, or its
    parameters' numels (:func:`gpt_unit_numels`), which qwZ's blocks start each parameter of. `activations`: the transformer's shape per micro-batch and the ZeRO-R
    switches, for the tensor-parallel traffic and the activation checkpoints (None: neither is
    priced). `optimizer_bytes`: optimizer state per parameter beside the fp32 master, in fp32 (Adam: 8;
    halved where ``zero.optimizer_state_dtype`` is bf16). `frozen_fraction`: the share of every unit's
    parameters that is frozen (rounded down). `whole_parameters`: the optimizer steps whole parameters
    on owner ranks (its exchanges and whole masters priced). `experts`, `expert_units`: the model's
    mixture-of-experts layers and their experts containers' numels (units of their own; with expert
    parallelism sharded over world / E ranks, their dispatch priced with `activations`' tokens).
    Raises ConfigError for a bad combination."""
    zero = zero or ZeroConfig()
    zero.validate()
    if zero.optimizer_state_dtype == "bf16":
        optimizer_bytes //= 2
    ep = experts.expert_parallel if experts is not None else 1
    layout = Layout(world, nodes, tensor_parallel, activations.context_parallel if activations is not None else 1, ep)
    diloco = runs_outer_loop(zero, nodes, "whole" if whole_parameters else "flat")  # refuses what it cannot run
    replica = layout.one_node() if diloco else layout  # the ranks that train one model
    dp = replica.data_parallel_size
    hpz = 1 if diloco else layout.hpz_group_size(zero.hpz_partition_size)
    refuse_qwd_without_hpz(zero, hpz, nodes)  # as the engine does
    if whole_parameters:
        refuse_whole_with("--optimizer-path whole", zero, tensor_parallel)
    entries = [math.ceil(model / tensor_parallel)] if isinstance(model, int) else list(model)
    shard_world = dp if zero.stage >= 1 else 1
    policy = StagePolicy.for_stage(zero.stage)
    # as UnitOptions.param_alignment and FrozenWeights: parameters start on a block of their quantization
    trained_block = zero.qwz.block or 1 if zero.qwz.enabled else 1
    frozen_block = zero.qwz.block or 1 if zero.quantized_nontrainable_weights else 1

    def padded(numels: Sequence[int], block: int, split: int = 1) -> int:
        shapes = tuple((n,) for n in numels)
        return FlatLayout(shapes, shard_world // split, zero.shard_alignment, block).padded_numel if sum(numels) else 0

    units, trainable = [], 0  # trainable: how many parameters (a unit given as its numel: one)
    for index, entry in enumerate([*entries, *expert_units]):
        split = ep if index >= len(entries) else 1  # an experts unit: its 1/E of the experts, over world / E ranks
        params = [numel // split for numel in ([entry] if isinstance(entry, int) else entry)]
        n = sum(params)
        frozen = math.floor(frozen_fraction * n)
        trained = params if not frozen else [n - frozen]
        trainable += sum(1 for numel in trained if numel)
        resident = policy.keeps_resident(n, zero.persistence_threshold, dp, zero.offload.params != "none")
        frozen_padded = padded([frozen], frozen_block) if policy.shard_parameters else frozen
        units.append(
            Unit(n - frozen, padded(trained, trained_block, split), resident, frozen, frozen_padded, split > 1)
        )
    est = Estimate(tuple(units), layout, zero, hpz, optimizer_bytes, (), activations, whole_parameters, diloco)
    dense = [(u.padded, u.resident) for u in units if not u.experts]
    transfers = [
        *step_transfers(dense, replica, zero, hpz, activations, parameters=trainable),
        *expert_unit_transfers(est, experts, activations),
        *frozen_transfers(est.gathered_frozen, replica.data_parallel_layout(), zero, hpz),
        *(owner_transfers(est.psi, layout.data_parallel_layout()) if whole_parameters else ()),
    ]  # fmt: skip
    sizes = [(u.padded, u.resident) for u in units]
    if diloco:  # Streaming DiLoCo's fragments: whole units holding trainable parameters, as the engine refuses
        refuse_fragments(zero, sum(1 for u in units if u.numel))
    sync = [tuple(outer_transfers(sizes, layout, zero, f)) for f in range(zero.outer.fragments)] if diloco else []
    return dataclasses.replace(est, transfers=tuple(transfers), sync_transfers=tuple(sync))
