"""A unit: parameters flattened into one padded buffer, evenly sharded, gathered and reduced together.

A :class:`FlatUnit` owns the buffers of its parameters. The module's ``nn.Parameter`` objects stay
registered where the user put them, their ``.data`` pointed once at views of the unit's
``compute_flat`` buffer. Resharding frees that buffer's *storage* (resized to 0 bytes) and
unsharding re-grows it and gathers into it, so the views never change: a weight (or a view of it,
like ``w.t()``) that autograd saved in forward reads the re-gathered values in backward, and holds
no memory in between.

A unit has two pieces of state, each an enum changed only by its own methods:

- :class:`ShardState`, where its compute-dtype parameters are (sharded / gathering / unsharded);
- :class:`TrainingState`, where it is in a backward pass (the runtime drives it: ``begin_backward``,
  ``enter_backward``, ``add_grad``, ``finish_backward``, ``end_backward``).

Which modules form units is :mod:`zeropp.zero.grouping`'s concern; when hooks fire is :mod:`zeropp.runtime`'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from zeropp.comm.communicator import Communicator, Pending
from zeropp.comm.feedback import ErrorFeedback
from zeropp.comm.quantized import reduce_scatter_quantized
from zeropp.index.flat import FlatLayout, secondary_range
from zeropp.topology import ShardGroups
from zeropp.zero.arena import Arena, Loans
from zeropp.zero.options import UnitOptions
from zeropp.zero.stages import StagePolicy
from zeropp.zero.unit_states import ShardState, TrainingState
from zeropp.zero.weights.dtensor_params import local_tensor, point_at
from zeropp.zero.weights.frozen import FrozenWeights
from zeropp.zero.weights.gather import start_weight_gather
from zeropp.zero.weights.reference import WeightReference

if TYPE_CHECKING:
    from zeropp.zero.offload.disk_gradients import GradientFiles

_RELEASED = torch.empty(0)


class FlatUnit:
    """One unit's flat buffers under a stage policy.

    Buffers (P = padded numel, S = this rank's shard, W = ranks the optimizer state is split over):

    - ``master``: fp32 ``nn.Parameter`` of S elements (P when W == 1), what the optimizer updates;
    - ``compute_flat``: compute-dtype P elements, the parameters' storage; resident unless the unit
      is sharded (stage 3), where it holds memory only while gathered;
    - ``compute_shard``: compute-dtype S elements, the all-gather source of a sharded unit;
    - ``grad_flat``: P elements in the gradient dtype where parameter gradients land; kept across
      micro-batches when gradients are not sharded (stages 0, 1), transient otherwise;
    - ``grad_shard``: S elements, the reduced gradient accumulated over micro-batches (stages 2, 3; in a
      file instead with the optimizer's disk tier: ``gradient_files``).

    Where the compute dtype is fp32 the compute buffer (stage 0) or the compute shard (stage 3) is the
    master's own storage, so nothing is stored twice.

    ZeRO++ on a sharded unit:

    - hpZ keeps ``secondary_shard``, this rank's 1/H of ``compute_flat`` (H = its secondary group's
      size), cut when the unit reshards (after its gather completed, so never racing a prefetch) and
      gathered from while the weights are unchanged ([Note: hpZ validity and versioning]).
    - qwZ quantizes the compute shard (qWD: its change since ``reference``, :mod:`zeropp.zero.weights.reference`)
      at every gather over the shard group and dequantizes what arrives.

    At stage 3 a unit also holds its modules' frozen parameters (``frozen``, :mod:`zeropp.zero.weights.frozen`),
    gathered and freed with the rest; the buffers above cover the trainable ones only, which may be none.
    """

    def __init__(
        self,
        module: nn.Module,
        named_params: list[tuple[str, nn.Parameter]],
        comm: Communicator,
        groups: ShardGroups,
        policy: StagePolicy,
        options: UnitOptions,
        *,
        broadcast_initial: bool = False,
        initial_flat: torch.Tensor | None = None,
        name: str = "",
    ) -> None:
        """Flatten `named_params` (real tensors, anywhere) into this unit's buffers on the device;
        with `broadcast_initial` every rank takes rank 0's values (one broadcast of the flat buffer).
        `initial_flat`: an fp32 flat buffer of :meth:`layout_of` that already holds the parameters
        (they are views of it), taken as it is where it already lives on the device. `name`: the
        module's name in the model, which labels the unit's collectives ([Note: collective sequences])."""
        self.name = name or "(root)"
        self.module = module
        trainable = [(n, p) for n, p in named_params if p.requires_grad]
        self.names = [n for n, _ in trainable]
        self.params = [p for _, p in trainable]
        self.comm = comm
        self.groups = groups
        self.policy = policy
        self.options = options
        compute_dtype = self.compute_dtype = options.compute_dtype
        grad_dtype = self.grad_dtype = options.grad_dtype
        self.allgather_bucket, self.reduce_bucket = options.allgather_bucket, options.reduce_bucket
        self.shard_world = groups.shard.size if policy.shard_optimizer else 1
        self.layout = self.layout_of(self.params, groups, policy, options)
        frozen = [(n, p) for n, p in named_params if not p.requires_grad]
        self.resident = policy.keeps_resident(
            self.layout.numel + sum(local_tensor(p).numel() for _, p in frozen),
            options.persistence_threshold,
            groups.shard.size,
            options.compute_shard_device is not None,
        )
        device = options.device
        self.frozen = (
            FrozenWeights(frozen, comm, groups, options, resident=self.resident, broadcast=broadcast_initial)
            if frozen
            else None
        )
        self._hold_weights(self._take_parameters(initial_flat, broadcast_initial))
        self.grad_flat: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None
        self.gradient_files: GradientFiles | None = None  # where the reduced shards go instead (the disk tier)
        # the step's (finite, sum of squares) of the reduced gradient, where computed as it landed
        self.known_statistics: tuple[torch.Tensor | None, torch.Tensor] | None = None
        # gradient buffers (MD: ranges of the preallocated gradient arena)
        self._gradients = Loans(options.grad_arena or Arena(device, pinned=False, contiguous=False))
        if not policy.shard_gradients:
            self.grad_flat = torch.zeros(self.layout.padded_numel, dtype=grad_dtype, device=device)
        self.version = 0  # bumped whenever the weights change
        self.quantize_gradients = options.grad_quant is not None  # qgZ; the engine may turn it off mid-run
        beta = options.grad_error_beta
        self.error_feedback = ErrorFeedback(beta) if beta is not None and self.quantize_gradients else None
        self.secondary_shard: torch.Tensor | None = None
        self._secondary_version = -1
        self.shard_state = ShardState.UNSHARDED
        self.training_state = TrainingState.IDLE
        self._gather: Pending | None = None
        self._grads_missing = 0
        self._inputs_pending = 0  # forward calls whose input gradients backward has yet to compute
        self._unwritten: set[int] | None = None  # parameters with nothing in a fresh grad_flat yet
        self.with_grad: set[int] = set()  # parameters this rank gave a gradient since the last step
        self._tp_partial: set[int] = set()  # parameters whose gradients are partial sums over tp ranks
        self.reshard()
        if groups.secondary is not None and not self.resident:  # filled by the first gather's reshard
            secondary = groups.secondary
            self._secondary_range = secondary_range(self.layout.padded_numel, secondary.size, secondary.rank)
            size = self._secondary_range[1] - self._secondary_range[0]
            self.secondary_shard = torch.empty(size, dtype=compute_dtype, device=device)
        delta = options.weight_delta and self.secondary_shard is not None and bool(self.params)  # qWD
        self.reference = WeightReference(self.secondary_shard, self.compute_shard.numel()) if delta else None

    def _take_parameters(self, initial_flat: torch.Tensor | None, broadcast: bool) -> torch.Tensor:
        """The parameters' values as one fp32 flat buffer on the device; the parameters' own copies are
        released (each as soon as it is flattened), so a unit never exists twice."""
        device = self.options.device
        flat = initial_flat
        if flat is None:
            flat = torch.zeros(self.layout.padded_numel, dtype=torch.float32, device=device)
        for p, view in zip(self.params, self.layout.split(flat), strict=True):
            local = local_tensor(p)
            if local.data_ptr() != view.data_ptr():  # not initialized in place (or shared with another scope)
                view.copy_(local.detach())
            point_at(p, _RELEASED.to(p.dtype))
        full32 = flat.to(device)
        if broadcast and self.params:  # the padding holds zeros everywhere already
            self.comm.broadcast(full32[: self.layout.end], self.groups.shard, src=self.groups.shard.ranks[0])
        return full32

    def _hold_weights(self, full32: torch.Tensor) -> None:
        """Keep this rank's fp32 master and compute-dtype weights of `full32`; point the parameters at
        views of ``compute_flat``. Where the compute dtype is fp32 and the master stays on the device,
        the master is the compute shard (stage 3, unless the parameters are offloaded) or the whole buffer
        (stage 0) itself."""
        options, dtype = self.options, self.compute_dtype
        offloaded = options.master_device is not None
        if self.shard_world == 1 and not offloaded:
            self.master = nn.Parameter(full32)
        else:
            mine = self.shard_of(full32)
            self.master = nn.Parameter(options.host_empty(mine.numel(), torch.float32, options.master_device))
            self.master.data.copy_(mine)
        self.compute_shard: torch.Tensor | None = None
        if self.resident:
            alias = self.shard_world == 1 and dtype == torch.float32 and not offloaded
            self.compute_flat = self.master.data if alias else full32.to(dtype)
        elif dtype == torch.float32 and not offloaded and options.compute_shard_device is None:
            self.compute_shard = self.master.data
        else:
            numel, where = self.master.numel(), options.compute_shard_device
            self.compute_shard = options.host_empty(numel, dtype, where).copy_(self.master.data)
        del full32
        if not self.resident:  # holds memory only while gathered (storage freed by the first reshard)
            self.compute_flat = torch.empty(self.layout.padded_numel, dtype=dtype, device=options.device)
        for p, view in zip(self.params, self.layout.split(self.compute_flat), strict=True):
            point_at(p, view)

    @staticmethod
    def layout_of(
        params: list[nn.Parameter], groups: ShardGroups, policy: StagePolicy, options: UnitOptions
    ) -> FlatLayout:
        """The flat layout a unit of `params` gets (padded for the ranks its optimizer state spans)."""
        shard_world = groups.shard.size if policy.shard_optimizer else 1
        shapes = tuple(tuple(local_tensor(p).shape) for p in params)
        return FlatLayout(shapes, shard_world, options.alignment, options.param_alignment)

    # -- parameters ------------------------------------------------------------------------------

    def unshard(self, async_op: bool = False) -> None:
        """Start (or, unless async, also finish) gathering the full parameters of a sharded unit."""
        if self.shard_state is ShardState.SHARDED:
            # See [Note: the storage-resize trick] (docs/design.md)
            self.compute_flat.untyped_storage().resize_(self.layout.padded_numel * self.compute_flat.element_size())
            with self.comm.trace.labelled(self.name):
                gathers = [self._start_gather()] if self.params else []
                gathers += [self.frozen.start_gather()] if self.frozen is not None else []
            self._gather = Pending(gathers)
            self.shard_state = ShardState.GATHERING
        if self.shard_state is ShardState.GATHERING and not async_op:
            self._gather.wait()
            self._gather = None
            self.shard_state = ShardState.UNSHARDED

    def _start_gather(self) -> Pending:
        secondary = self.secondary_shard if self.secondary_valid else None
        return start_weight_gather(
            self.comm, self.options, self.groups, self.compute_flat, self.compute_shard, secondary, self.reference
        )

    # See [Note: hpZ validity and versioning] (docs/design.md)
    @property
    def secondary_valid(self) -> bool:
        return self.secondary_shard is not None and self._secondary_version == self.version

    def reshard(self) -> None:
        """Free the gathered parameters of a sharded unit (resident units keep theirs); with hpZ keep
        this rank's secondary shard of them first."""
        if self.resident or self.shard_state is ShardState.SHARDED:
            return
        if self._gather is not None:
            self._gather.wait()
            self._gather = None
        if self.secondary_shard is not None and not self.secondary_valid:
            start, stop = self._secondary_range
            self.secondary_shard.copy_(self.compute_flat[start:stop])
            self._secondary_version = self.version
            if self.reference is not None:  # See [Note: qWD's reference] (docs/design.md)
                self.reference.record(self.shard_of(self.compute_flat), self.version)
        # See [Note: the storage-resize trick]
        self.compute_flat.untyped_storage().resize_(0)
        if self.frozen is not None:
            self.frozen.release()
        self.shard_state = ShardState.SHARDED

    # -- training state --------------------------------------------------------------------------

    def begin_backward(self) -> None:
        """A backward pass starts: every parameter's gradient is awaited."""
        self.training_state = TrainingState.PRE_BACKWARD
        self._grads_missing = len(self.params)

    # See [Note: frozen weights in backward] (docs/design.md)
    def await_input_grads(self) -> None:
        """A forward of this unit took inputs that require gradients: backward needs its weights until
        those gradients are computed (:meth:`input_grads_done`), not only until its own gradients are in."""
        self._inputs_pending += 1

    def input_grads_done(self) -> bool:
        """One forward call's input gradients are computed; return whether the unit's backward is now over."""
        self._inputs_pending -= 1
        return self._backward_over()

    def _backward_over(self) -> bool:
        done = self._grads_missing == 0 and self._inputs_pending == 0
        return done and self.training_state is not TrainingState.POST_BACKWARD

    def enter_backward(self) -> bool:
        """The first output gradient reached the unit; return whether it must be gathered for backward
        (only the first time in a backward, and not once its gradients are all in)."""
        if self.training_state is not TrainingState.PRE_BACKWARD:
            return False
        self.training_state = TrainingState.BACKWARD
        return True

    def add_grad(self, index: int, grad: torch.Tensor) -> bool:
        """Add parameter `index`'s gradient into the flat gradient buffer (allocated on first use);
        return whether it was the last one this backward awaited (and no input gradient is awaited)."""
        if self.training_state is TrainingState.POST_BACKWARD:
            raise RuntimeError(
                f"zeropp: parameter {self.names[index]} received a second gradient after its unit was reduced "
                "(reentrant activation checkpointing?); use torch.utils.checkpoint with use_reentrant=False"
            )
        if self.grad_flat is None:  # fresh: each parameter's first gradient is copied in, not added to zeros
            self.grad_flat = self._gradients.take(self.layout.padded_numel, self.grad_dtype)
            self._unwritten = set(range(len(self.params)))
        if isinstance(grad, DTensor):  # tensor parallelism: in the parameter's own placement, this rank's piece
            param = self.params[index]
            if all(p.is_partial() for p in grad.placements) and all(p.is_replicate() for p in param.placements):
                self._tp_partial.add(index)  # summed over the tensor-parallel group when reduced
            elif grad.placements != param.placements:
                grad = grad.redistribute(placements=param.placements)
            grad = grad.to_local()
        start, stop = self.layout.param_range(index)
        self.with_grad.add(index)
        if self._unwritten is not None and index in self._unwritten:
            self._unwritten.discard(index)
            self.grad_flat[start:stop].copy_(grad.reshape(-1))
        else:
            self.grad_flat[start:stop].add_(grad.reshape(-1))
        self._grads_missing -= 1
        return self._backward_over()

    def finish_backward(self) -> None:
        """Every gradient this backward will produce is in (some parameters may have got none)."""
        self.training_state = TrainingState.POST_BACKWARD

    @property
    def finished_backward(self) -> bool:
        return self.training_state is TrainingState.POST_BACKWARD

    def end_backward(self) -> None:
        self.training_state = TrainingState.IDLE
        self._inputs_pending = 0

    # -- gradients -------------------------------------------------------------------------------

    def reduce_gradients(self) -> Pending:
        """Reduce this rank's gradients over the shard group (mean), asynchronously.

        Stage 0 all-reduces ``grad_flat`` in place; stage 1 reduce-scatters it and writes the mean
        shard back into its own slice of ``grad_flat``; stages 2 and 3 reduce-scatter into
        ``grad_shard`` (adding to what earlier micro-batches left there) and drop ``grad_flat``.
        With qgZ (stage 3) the reduce-scatter is the quantized two-hop all-to-all.
        """
        with self.comm.trace.labelled(self.name):
            return self._reduce_gradients()

    def _reduce_gradients(self) -> Pending:
        if not self.params:  # frozen parameters only: nothing to reduce
            return Pending([])
        if self.grad_flat is None:  # no parameter of this unit got a gradient on this rank
            self.grad_flat = self._gradients.take(self.layout.padded_numel, self.grad_dtype).zero_()
        self._zero_unwritten()
        # sequence parallelism: each tp rank's norm gradients cover its slice of the sequence; one
        # all-reduce per unit sums them (Megatron's coalesced norm all-reduce); linear, so micro-batches
        # accumulated before it add up the same
        partial = [self.grad_flat[slice(*self.layout.param_range(i))] for i in sorted(self._tp_partial)]
        self.comm.all_reduce_coalesced(partial, self.comm.topology.tensor_parallel, reduce="sum")
        if not self.policy.shard_optimizer:
            return self.comm.all_reduce(self.grad_flat, self.groups.shard, async_op=True)
        flat = self.grad_flat
        mine = self.shard_of(flat)
        if self.shard_world == 1:  # the mean over one rank is the gradient itself: nothing to move
            if not self.policy.shard_gradients:
                return Pending([])
            self.grad_flat = None
            return Pending([], lambda: self._accumulate_reduced(flat))
        out = self._gradients.take(mine.numel(), self.grad_dtype)
        pending = self._reduce_scatter(out, flat)
        if not self.policy.shard_gradients:  # stage 1: the mean shard goes back into its own slice

            def write_back() -> None:
                mine.copy_(out)
                self._gradients.give_back(out)

            return Pending([pending], write_back, start_hops=pending.start_ready_hops)
        # the full gradient lives only as long as its reduction needs it (qgZ: not past the quantization)
        self.grad_flat = None

        def finish() -> None:
            self._accumulate_reduced(out)
            self._gradients.give_back(flat)

        return Pending([pending], finish, start_hops=pending.start_ready_hops)

    def _reduce_scatter(self, out: torch.Tensor, flat: torch.Tensor) -> Pending:
        options = self.options
        if not self.quantize_gradients:
            return self.comm.reduce_scatter(
                out, flat, self.groups.shard, bucket_numel=self.reduce_bucket, async_op=True
            )
        return reduce_scatter_quantized(
            self.comm, out, flat, options.grad_quant, options.kernels, self.groups,
            chunks=options.qgz_chunks, bucket_numel=self.reduce_bucket, intra_spec=options.grad_intra_quant,
            min_chunk=options.qgz_min_chunk, hadamard_rotation=options.grad_hadamard, feedback=self.error_feedback,
        )  # fmt: skip

    def _zero_unwritten(self) -> None:
        """Zero what no gradient was copied into since ``grad_flat`` was allocated: the slices of
        parameters that got none, and the gaps and padding."""
        if self._unwritten is None:
            return
        for start, stop in [*map(self.layout.param_range, self._unwritten), *self.layout.gaps()]:
            self.grad_flat[start:stop].zero_()
        self._unwritten = None

    def _accumulate_reduced(self, shard: torch.Tensor) -> None:
        if self.gradient_files is not None:  # See [Note: gradients on disk]
            self.gradient_files.park(self, shard, lambda: self._gradients.give_back(shard))
            return
        if self.grad_shard is None:
            self.grad_shard = shard
        else:
            self.grad_shard.add_(shard)
            self._gradients.give_back(shard)

    def reduced_gradient(self) -> torch.Tensor:
        """This rank's reduced gradient, aligned with ``master`` (zeros if none arrived)."""
        if self.policy.shard_gradients:
            if self.grad_shard is None:
                self.grad_shard = self._gradients.take(self.master.numel(), self.grad_dtype).zero_()
            return self.grad_shard
        return self.shard_of(self.grad_flat)

    def clear_gradients(self) -> None:
        self.with_grad.clear()
        if self.gradient_files is not None:
            self.gradient_files.forget(self)
        self.known_statistics = None
        if self.policy.shard_gradients:
            self._gradients.give_back(self.grad_shard)
            self._gradients.give_back(self.grad_flat)
            self.grad_shard = None
            self.grad_flat = None
        else:
            self.grad_flat.zero_()

    # -- whole flat buffers (state dicts, checkpoints) ----------------------------------------------

    def gather_flat(self, shard: torch.Tensor) -> torch.Tensor:
        """The whole padded flat buffer of which `shard` (aligned with ``master``) is this rank's piece."""
        shard = shard.to(self.options.device)  # an offloaded one travels from the device
        if self.shard_world == 1:
            return shard
        flat = torch.empty(self.layout.padded_numel, dtype=shard.dtype, device=shard.device)
        self.comm.all_gather(flat, shard, self.groups.shard, bucket_numel=self.allgather_bucket)
        return flat

    def shard_of(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a whole padded flat buffer (the inverse of gather_flat)."""
        if self.shard_world == 1:
            return flat
        start, stop = self.layout.shard_range(self.groups.shard.rank)
        return flat[start:stop]

    def load_master(self, flat: torch.Tensor) -> None:
        """Set the fp32 master from a whole flat buffer and make every copy of the weights follow it."""
        self.load_master_shard(self.shard_of(flat))

    def load_master_shard(self, shard: torch.Tensor) -> None:
        """Set this rank's fp32 master shard and make every copy of the weights follow it."""
        self.reshard()
        if self.reference is not None:
            self.reference.forget()
        self.master.data.copy_(shard)
        self.publish_master()

    # -- after the optimizer step -----------------------------------------------------------------

    def publish_master(self) -> None:
        """Make the compute-dtype parameters follow the updated fp32 master."""
        # See [Note: hpZ validity and versioning]
        self.version += 1
        if not self.params:
            return
        # non-blocking: the next gather reads the copy in stream order, and with offloaded masters the host
        # writes them again only after the next step's synchronize (ZeroEngine.step)
        if not self.resident:
            if self.compute_shard.data_ptr() != self.master.data_ptr():
                self.compute_shard.copy_(self.master.data, non_blocking=True)
        elif self.shard_world == 1:
            if self.compute_flat.data_ptr() != self.master.data_ptr():
                self.compute_flat.copy_(self.master.data, non_blocking=True)
        else:
            source = self.master.data.to(self.options.device, self.compute_dtype)
            with self.comm.trace.labelled(self.name):
                self.comm.all_gather(self.compute_flat, source, self.groups.shard, bucket_numel=self.allgather_bucket)

    # -- bookkeeping -----------------------------------------------------------------------------

    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor this unit keeps (for measured model-state bytes)."""
        reference = self.reference.shard if self.reference is not None else None
        kept = (self.master.data, self.compute_flat, self.compute_shard, self.secondary_shard, reference)
        residuals = self.error_feedback.residuals.values() if self.error_feedback is not None else ()
        frozen = self.frozen.state_tensors() if self.frozen is not None else ()
        return [t for t in (*kept, self.grad_flat, self.grad_shard, *residuals, *frozen) if t is not None]
