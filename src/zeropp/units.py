"""Units: groups of parameters that are flattened, sharded, gathered and reduced together.

Default grouping: every child of a repeated container (an ``nn.ModuleList`` / ``nn.Sequential``
whose children include at least two modules of one class, e.g. the transformer layers) is a unit;
one root unit holds everything else. A parameter reachable from two units (a tied weight between
a layer and the root, say) goes to the root unit, which stays gathered for the whole forward.

A :class:`FlatUnit` owns the buffers of its parameters. The module's ``nn.Parameter`` objects stay
registered where the user put them, their ``.data`` pointed once at views of the unit's full
buffer. Resharding frees that buffer's *storage* (resized to 0 bytes) and unsharding re-grows it
and gathers into it, so the views never change: a weight (or a view of it, like ``w.t()``)
that autograd saved in forward reads the re-gathered values in backward, and holds no memory
in between.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from zeropp.comm import Communicator, Pending
from zeropp.comm.quantized import all_gather_quantized, reduce_scatter_quantized
from zeropp.partition import FlatLayout, secondary_range
from zeropp.quant import QuantSpec
from zeropp.stages import StagePolicy
from zeropp.topology import Group


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """Children of containers holding >= 2 modules of the same class, outermost first, in order."""
    blocks: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, (nn.ModuleList, nn.Sequential)):
                kinds = [type(m) for m in child.children()]
                if any(kinds.count(k) >= 2 for k in kinds):
                    blocks.extend(m for m in child.children() if any(True for _ in m.parameters()))
                    continue
            visit(child)

    visit(model)
    return blocks


def group_parameters(
    model: nn.Module, unit_modules: Iterable[nn.Module]
) -> list[tuple[nn.Module, list[tuple[str, nn.Parameter]]]]:
    """Assign each trainable parameter to exactly one unit; the root (`model`) unit comes last.

    Frozen parameters (requires_grad=False) are left where they are: resident and replicated.
    """
    claims: dict[int, list[int]] = {}
    unit_modules = [m for m in unit_modules if m is not model]
    for index, module in enumerate(unit_modules):
        for p in module.parameters():
            if p.requires_grad:
                claims.setdefault(id(p), []).append(index)
    grouped: list[list[tuple[str, nn.Parameter]]] = [[] for _ in unit_modules] + [[]]
    for name, p in model.named_parameters(remove_duplicate=True):
        if not p.requires_grad:
            continue
        owners = claims.get(id(p), [])
        grouped[owners[0] if len(owners) == 1 else -1].append((name, p))
    modules = [*unit_modules, model]
    return [(m, params) for m, params in zip(modules, grouped, strict=True) if params]


class ParamState(enum.Enum):
    SHARDED = "sharded"  # only this rank's shard exists; parameters point at empty tensors
    GATHERING = "gathering"  # an all-gather into the full buffer is in flight
    UNSHARDED = "unsharded"  # parameters are views of the gathered full buffer


@dataclass(frozen=True)
class UnitOptions:
    """How every unit stores and communicates (the engine builds one from ZeroConfig)."""

    compute_dtype: torch.dtype
    grad_dtype: torch.dtype
    alignment: int
    persistence_threshold: int
    allgather_bucket: int
    reduce_bucket: int
    weight_quant: QuantSpec | None = None  # qwZ: gather weights over the world quantized
    grad_quant: QuantSpec | None = None  # qgZ: reduce gradients by quantized hierarchical all-to-all
    qgz_stages: int = 1
    secondary: Group | None = None  # hpZ: this rank's secondary group
    kernels: ModuleType | None = None  # quantization kernels (zeropp.quant.kernels_for)
    quant_stream: torch.cuda.Stream | None = None  # CUDA: qwZ quantizes and gathers on this side stream


class FlatUnit:
    """One unit's flat buffers under a stage policy.

    Buffers (P = padded numel, S = this rank's shard, W = ranks the optimizer state is split over):

    - ``master``: fp32 ``nn.Parameter`` of S elements (P when W == 1), what the optimizer updates;
    - ``full``: compute-dtype P elements, resident unless the unit is sharded (stage 3);
    - ``compute_shard``: compute-dtype S elements, the all-gather source of a sharded unit;
    - ``grad_flat``: P elements in the gradient dtype where parameter gradients land; kept across
      micro-batches when gradients are not sharded (stages 0, 1), transient otherwise;
    - ``grad_shard``: S elements, the reduced gradient accumulated over micro-batches (stages 2, 3).

    Where the compute dtype is fp32 the full buffer (stage 0) or the compute shard (stage 3) is the
    master's own storage, so nothing is stored twice.

    ZeRO++ on a sharded unit:

    - hpZ keeps ``secondary_shard``, this rank's 1/H of the full compute-dtype buffer (H = its
      secondary group's size). It is cut from the gathered weights when the unit reshards and is
      valid while the weights have not changed (``version``, bumped by every optimizer step):
      while valid every gather (backward, later micro-batches, eval) runs inside the secondary
      group. A step invalidates it, so a stale copy is never read; the copy is written only after
      the gather into ``full`` has completed, so it never races a prefetch.
    - qwZ quantizes the compute shard at every gather over the world and dequantizes what arrives.
    """

    def __init__(
        self,
        module: nn.Module,
        named_params: list[tuple[str, nn.Parameter]],
        comm: Communicator,
        policy: StagePolicy,
        options: UnitOptions,
    ) -> None:
        self.module = module
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.comm = comm
        self.policy = policy
        self.options = options
        compute_dtype = self.compute_dtype = options.compute_dtype
        grad_dtype = self.grad_dtype = options.grad_dtype
        self.allgather_bucket, self.reduce_bucket = options.allgather_bucket, options.reduce_bucket
        topo = comm.topology
        self.shard_world = topo.world_size if policy.shard_optimizer else 1
        self.layout = FlatLayout(tuple(tuple(p.shape) for p in self.params), self.shard_world, options.alignment)
        self.resident = policy.keeps_resident(self.layout.numel, options.persistence_threshold)
        device = topo.device

        full32 = torch.zeros(self.layout.padded_numel, dtype=torch.float32, device=device)
        for i, p in enumerate(self.params):
            start, stop = self.layout.param_range(i)
            full32[start:stop].copy_(p.detach().reshape(-1))
        start, stop = self.layout.shard_range(topo.rank if self.shard_world > 1 else 0)
        if self.shard_world == 1:
            self.master = nn.Parameter(full32)
        else:
            self.master = nn.Parameter(full32[start:stop].clone())
        self.compute_shard: torch.Tensor | None = None
        if self.resident:
            alias = self.shard_world == 1 and compute_dtype == torch.float32
            self.full = self.master.data if alias else full32.to(compute_dtype)
        else:
            alias = compute_dtype == torch.float32
            self.compute_shard = self.master.data if alias else self.master.data.to(compute_dtype)
            self.full = torch.empty(self.layout.padded_numel, dtype=compute_dtype, device=device)
        del full32
        for i, p in enumerate(self.params):
            start, stop = self.layout.param_range(i)
            p.data = self.full[start:stop].view(p.shape)
        self.grad_flat: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None
        if not policy.shard_gradients:
            self.grad_flat = torch.zeros(self.layout.padded_numel, dtype=grad_dtype, device=device)
        self.version = 0  # bumped whenever the weights change
        self.secondary_shard: torch.Tensor | None = None
        self._secondary_version = -1
        self.state = ParamState.UNSHARDED
        self._gather: Pending | None = None
        self.pending_grads = len(self.params)
        self.reduced_this_backward = False
        self.gathered_for_backward = False
        self.reshard()
        if options.secondary is not None and not self.resident:  # filled by the first gather's reshard
            group = options.secondary
            self._secondary_range = secondary_range(self.layout.padded_numel, group.size, group.ranks.index(topo.rank))
            size = self._secondary_range[1] - self._secondary_range[0]
            self.secondary_shard = torch.empty(size, dtype=compute_dtype, device=device)

    # -- parameters ------------------------------------------------------------------------------

    def unshard(self, async_op: bool = False) -> None:
        """Start (or, unless async, also finish) gathering the full parameters of a sharded unit."""
        if self.state is ParamState.SHARDED:
            self.full.untyped_storage().resize_(self.layout.padded_numel * self.full.element_size())
            self._gather = self._start_gather()
            self.state = ParamState.GATHERING
        if self.state is ParamState.GATHERING and not async_op:
            self._gather.wait()
            self._gather = None
            self.state = ParamState.UNSHARDED

    def _start_gather(self) -> Pending:
        options, world = self.options, self.comm.topology.world
        bucket = self.allgather_bucket
        if self.secondary_valid:  # hpZ: inside the secondary group, in the compute dtype
            return self.comm.all_gather(
                self.full, self.secondary_shard, options.secondary, bucket_numel=bucket, async_op=True
            )
        if options.weight_quant is not None:  # qwZ
            return all_gather_quantized(
                self.comm,
                self.full,
                self.compute_shard,
                options.weight_quant,
                world,
                options.kernels,
                bucket_numel=bucket,
                async_op=True,
                stream=options.quant_stream,
            )
        return self.comm.all_gather(self.full, self.compute_shard, world, bucket_numel=bucket, async_op=True)

    @property
    def secondary_valid(self) -> bool:
        return self.secondary_shard is not None and self._secondary_version == self.version

    def reshard(self) -> None:
        """Free the gathered parameters of a sharded unit (resident units keep theirs); with hpZ keep
        this rank's secondary shard of them first."""
        if self.resident or self.state is ParamState.SHARDED:
            return
        if self._gather is not None:
            self._gather.wait()
            self._gather = None
        if self.secondary_shard is not None and not self.secondary_valid:
            start, stop = self._secondary_range
            self.secondary_shard.copy_(self.full[start:stop])
            self._secondary_version = self.version
        self.full.untyped_storage().resize_(0)
        self.state = ParamState.SHARDED

    # -- gradients -------------------------------------------------------------------------------

    def accumulate_param_grad(self, param_index: int, grad: torch.Tensor) -> None:
        """Add one parameter's gradient into the flat gradient buffer (allocated on first use)."""
        if self.grad_flat is None:
            self.grad_flat = torch.zeros(self.layout.padded_numel, dtype=self.grad_dtype, device=grad.device)
        start, stop = self.layout.param_range(param_index)
        self.grad_flat[start:stop].add_(grad.reshape(-1))

    def reduce_gradients(self) -> Pending:
        """Reduce this rank's gradients over the world (mean), asynchronously.

        Stage 0 all-reduces ``grad_flat`` in place; stage 1 reduce-scatters it and writes the mean
        shard back into its own slice of ``grad_flat``; stages 2 and 3 reduce-scatter into
        ``grad_shard`` (adding to what earlier micro-batches left there) and drop ``grad_flat``.
        With qgZ (stage 3) the reduce-scatter is the quantized two-hop all-to-all.
        """
        world = self.comm.topology.world
        if self.grad_flat is None:  # no parameter of this unit got a gradient on this rank
            self.grad_flat = torch.zeros(self.layout.padded_numel, dtype=self.grad_dtype, device=self.master.device)
        if not self.policy.shard_optimizer:
            return self.comm.all_reduce(self.grad_flat, world, async_op=True)
        start, stop = self.layout.shard_range(self.comm.topology.rank)
        flat = self.grad_flat
        out = flat.new_empty(stop - start)
        pending = self._reduce_scatter(out, flat)
        if not self.policy.shard_gradients:  # stage 1: the mean shard goes back into its own slice
            mine = flat[start:stop]
            return Pending([pending], lambda: mine.copy_(out), poll=pending.poll)
        # the full gradient lives only as long as its reduction needs it (qgZ: not past the quantization)
        self.grad_flat = None
        return Pending([pending], lambda: self._accumulate_reduced(out), poll=pending.poll)

    def _reduce_scatter(self, out: torch.Tensor, flat: torch.Tensor) -> Pending:
        options = self.options
        if options.grad_quant is None:
            world = self.comm.topology.world
            return self.comm.reduce_scatter(out, flat, world, bucket_numel=self.reduce_bucket, async_op=True)
        return reduce_scatter_quantized(
            self.comm,
            out,
            flat,
            options.grad_quant,
            options.kernels,
            stages=options.qgz_stages,
            bucket_numel=self.reduce_bucket,
        )

    def _accumulate_reduced(self, shard: torch.Tensor) -> None:
        if self.grad_shard is None:
            self.grad_shard = shard
        else:
            self.grad_shard.add_(shard)

    def reduced_gradient(self) -> torch.Tensor:
        """This rank's reduced gradient, aligned with ``master`` (zeros if none arrived)."""
        if self.policy.shard_gradients:
            if self.grad_shard is None:
                self.grad_shard = torch.zeros_like(self.master, dtype=self.grad_dtype)
            return self.grad_shard
        return self.shard_of(self.grad_flat)

    def clear_gradients(self) -> None:
        if self.policy.shard_gradients:
            self.grad_shard = None
            self.grad_flat = None
        else:
            self.grad_flat.zero_()

    # -- whole flat buffers (consolidation, checkpoints) -------------------------------------------

    def gather_flat(self, shard: torch.Tensor) -> torch.Tensor:
        """The whole padded flat buffer of which `shard` (aligned with ``master``) is this rank's piece."""
        if self.shard_world == 1:
            return shard
        flat = torch.empty(self.layout.padded_numel, dtype=shard.dtype, device=shard.device)
        self.comm.all_gather(flat, shard, self.comm.topology.world, bucket_numel=self.allgather_bucket)
        return flat

    def shard_of(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a whole padded flat buffer (the inverse of gather_flat)."""
        if self.shard_world == 1:
            return flat
        start, stop = self.layout.shard_range(self.comm.topology.rank)
        return flat[start:stop]

    def load_master(self, flat: torch.Tensor) -> None:
        """Set the fp32 master from a whole flat buffer and make every copy of the weights follow it."""
        self.reshard()
        self.master.data.copy_(self.shard_of(flat))
        self.publish_master()

    # -- after the optimizer step -----------------------------------------------------------------

    def publish_master(self) -> None:
        """Make the compute-dtype parameters follow the updated fp32 master."""
        self.version += 1
        if not self.resident:
            if self.compute_shard.data_ptr() != self.master.data_ptr():
                self.compute_shard.copy_(self.master.data)
        elif self.shard_world == 1:
            if self.full.data_ptr() != self.master.data_ptr():
                self.full.copy_(self.master.data)
        else:
            source = self.master.data.to(self.compute_dtype)
            self.comm.all_gather(self.full, source, self.comm.topology.world, bucket_numel=self.allgather_bucket)

    # -- bookkeeping -----------------------------------------------------------------------------

    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor this unit keeps (for measured model-state bytes)."""
        return [
            t
            for t in (
                self.master.data,
                self.full,
                self.compute_shard,
                self.secondary_shard,
                self.grad_flat,
                self.grad_shard,
            )
            if t is not None
        ]
