"""The engine: wraps an unmodified model and a torch.optim optimizer, runs any ZeRO stage.

Usage (one process per rank, under torchrun)::

    topo = zeropp.init_topology()
    engine = zeropp.ZeroEngine(model, torch.optim.AdamW, dict(lr=1e-3), ZeroConfig(stage=3), topo)
    loss = engine(x, y)        # forward
    engine.backward(loss)      # backward of one micro-batch
    engine.step()              # optimizer step once every gradient_accumulation_steps micro-batches
    tokens = engine.generate(input_ids=ids, max_new_tokens=64)  # every unit gathered once

The engine is the user API: construction, ``__call__``, ``backward``, ``step`` and the state dicts.
What happens to the units during forward and backward (hooks, prefetch, reductions) is the
runtime's (:mod:`zeropp.runtime`); the per-parameter state is :mod:`zeropp.checkpoint.per_parameter`'s.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from zeropp.checkpoint import per_parameter
from zeropp.comm import quantized
from zeropp.comm.communicator import Communicator
from zeropp.comm.ledger import Ledger
from zeropp.comm.sequence import check_sequences
from zeropp.config.sections import ZeroConfig
from zeropp.context_parallel import apply_context_parallel, refuse_whole_prompts
from zeropp.costs.memory import distinct_storage_bytes
from zeropp.errors import ConfigError
from zeropp.expert_parallel import refuse_expert_parallel, split_experts
from zeropp.quant import scratch
from zeropp.quant.backends import kernels_for
from zeropp.quant.spec import QuantSpec
from zeropp.runtime import Runtime
from zeropp.runtime.activation_checkpointing import (
    ActivationCheckpointStep,
    activation_checkpointing_for,
    kv_cache_configs,
    kv_cache_off,
)
from zeropp.runtime.compiled import compile_units
from zeropp.tensor_parallel.apply import check_split
from zeropp.topology import Topology
from zeropp.zero import materialize
from zeropp.zero.arena import Arena
from zeropp.zero.fingerprint import check_same_model
from zeropp.zero.grouping import group_parameters, repeated_blocks
from zeropp.zero.materialize import InitFn
from zeropp.zero.offload.delayed import DelayedUpdate
from zeropp.zero.offload.disk_params import disk_tiers_for, resident
from zeropp.zero.offload.states import KINDS, StateOffloader, StatesMoved
from zeropp.zero.optim.in_backward import backward_step, refuse_step_in_backward
from zeropp.zero.optim.outer import OuterStep, refuse_fragments, runs_outer_loop
from zeropp.zero.optim.owners import WholeParameterStep, refuse_whole_with
from zeropp.zero.optim.segments import SegmentStep
from zeropp.zero.optim.spec import OptimizerFactory, read_for
from zeropp.zero.optim.stepping import MasterStep, Stepper, clip_coefficient, gradient_statistics
from zeropp.zero.options import UnitOptions, frozen_quant, refuse_qwd_without_hpz
from zeropp.zero.precision import DTYPES, LossScaler, keep_master_in
from zeropp.zero.stages import StagePolicy
from zeropp.zero.unit import FlatUnit


class ZeroEngine:
    def __init__(
        self,
        model: nn.Module,
        optimizer: type[torch.optim.Optimizer] | torch.optim.Optimizer | list[torch.optim.Optimizer] | OptimizerFactory,
        optimizer_kwargs: dict[str, Any] | None = None,
        config: ZeroConfig | None = None,
        topology: Topology | None = None,
        *,
        units: Iterable[nn.Module] | None = None,
        ledger: Ledger | None = None,
        init_fn: InitFn | None = None,
        seed: int = 0,
    ) -> None:
        """Wrap `model` (built for real, or on the meta device) and build the optimizer on its shards: a class
        and `optimizer_kwargs`, a factory, or optimizers built on the model (:mod:`zeropp.zero.optim.spec`).

        The model is brought onto the ranks one unit at a time (:mod:`zeropp.zero.materialize`): a
        meta-device model is initialized unit by unit under per-unit seeds derived from `seed`
        (with `init_fn(module)` when given), a materialized one is synchronized from rank 0.
        `units`: the modules to flatten and shard together (default: the repeated blocks)."""
        from zeropp.topology import init_topology

        self.config = config or ZeroConfig()
        self.config.validate()
        spec, path = read_for(optimizer, optimizer_kwargs, model, self.config)  # before any collective
        self.optimizer_spec = spec
        self.topology = topology or init_topology()
        if path == "whole":
            refuse_whole_with(spec.described, self.config, self.topology.tensor_parallel.size)
        self.comm = Communicator(self.topology, ledger)
        if self.config.flight_record_dir is not None:  # See [Note: collective sequences]
            self.comm.trace.folder = Path(self.config.flight_record_dir)
        self.policy = StagePolicy.for_stage(self.config.stage)
        self.compute_dtype = DTYPES[self.config.precision]
        self.grad_dtype = DTYPES[self.config.grad_dtype or self.config.precision]
        # DiLoCo: ZeRO inside each node, the nodes synchronized by the outer step (See [Note: the outer loop])
        outer = runs_outer_loop(self.config, self.topology.nodes, path)
        refuse_step_in_backward(self.config, spec, path, outer)  # See [Note: the step inside backward]
        units = None if units is None else list(units)
        if outer:  # Streaming DiLoCo's fragments: whole units holding trainable parameters
            modules = repeated_blocks(model) if units is None else units
            refuse_fragments(self.config, len(group_parameters(model, modules)))
        self.groups = self.topology.shard_groups(self.config.hpz_partition_size, per_node=outer)  # refuses bad sizes
        self.replica = self.topology.node() if outer else self.topology.world  # the ranks training one model
        self.hpz_group_size = self.groups.hpz_group_size
        refuse_qwd_without_hpz(self.config, self.hpz_group_size, self.topology.layout.nodes)
        self.module = model
        # gradient buffers (MD: one buffer, allocated after the first step); allocations counted per step
        self.gradient_buffers = Arena(
            self.topology.device, pinned=False, contiguous=self.config.contiguous_memory_optimization
        )
        self.last_gradient_allocations = 0
        check_split(model, self.topology.tensor_parallel.size)
        apply_context_parallel(model, self.comm)  # See [Note: Ulysses attention]
        refuse_expert_parallel(model, self.comm, self.config, self.groups, units or [])  # before any collective
        unit_modules = check_same_model(self.topology, model, units)  # every rank built this model
        self.expert_units, self.expert_groups = split_experts(model, self.comm, self.groups)
        unit_modules = [*(repeated_blocks(model) if unit_modules is None else unit_modules), *self.expert_units]
        shard_ranks = self.groups.shard.size if self.policy.shard_optimizer else 1
        self.scaler = LossScaler(self.config.loss_scale, enabled=self.config.precision == "fp16")
        self.disk, self.param_disk = disk_tiers_for(self.config, self.topology.rank, model, shard_ranks, self.scaler)
        for tier in (t for t in (self.disk, self.param_disk) if t is not None):
            weakref.finalize(self, tier.close)
        self.units = self._build_units(model, unit_modules, init_fn, seed)
        # See [Note: the whole-parameter step] and [Note: segments]
        self.whole = WholeParameterStep(self.units, self.comm, spec, self.topology.rank) if path == "whole" else None
        self.stepper: Stepper | None = None if self.whole else {"segments": SegmentStep, "flat": MasterStep}[path](self.units, spec)  # fmt: skip
        self.optimizers = self.whole.optimizers if self.whole else self.stepper.optimizers  # what the step drives
        self.optimizer = self.optimizers[0]
        if self.disk is not None:
            self.disk.attach(self.optimizer)
        self.update = DelayedUpdate(self.stepper, self.config.offload, self.disk, self.param_disk)
        self.early = backward_step(self.config, self.stepper, self.comm, self.groups.shard, self.disk)  # or None
        self.outer = OuterStep(self.units, self.comm, self.topology.inter_node, self.config) if outer else None
        ordered = self.topology.expert_parallel.size > 1  # experts' collectives share qgZ's second hops' ranks
        self.runtime = Runtime(self.units, self.policy, self.config.prefetch, self.param_disk, ordered)
        self.states = StateOffloader(self.units, self.stepper, self.optimizers, self.topology.device, self.whole.masters() if self.whole else [])  # fmt: skip
        if self.config.compile:
            compile_units(self.units)
        self.activation_checkpointing = activation_checkpointing_for(self.config, self.units, self.comm, self.topology)
        self._kv_caches = [] if self.activation_checkpointing is None else kv_cache_configs(model)
        self.last_activation_checkpoints: ActivationCheckpointStep | None = None  # what the last optimizer step stored

        self.micro_step = 0
        self.global_step = 0
        self._at_boundary = False
        self._grad_norm: torch.Tensor | None = None  # of the last step taken (last_grad_norm)
        self.last_step_skipped = False
        self.measured_model_state_bytes = 0

    # -- construction ----------------------------------------------------------------------------

    def _unit_options(self) -> UnitOptions:
        config, device = self.config, self.topology.device
        qwz, qgz = config.qwz, config.qgz
        quantized = qwz.enabled or qgz.enabled or config.quantized_nontrainable_weights
        side_stream = qwz.enabled and device.type == "cuda"
        return UnitOptions(
            device=device,
            compute_dtype=self.compute_dtype,
            grad_dtype=self.grad_dtype,
            alignment=config.shard_alignment,
            persistence_threshold=config.persistence_threshold,
            allgather_bucket=config.allgather_bucket_numel,
            reduce_bucket=config.reduce_bucket_numel,
            weight_quant=QuantSpec(qwz.bits, qwz.block) if qwz.enabled else None,
            weight_delta=qwz.delta,
            frozen_quant=frozen_quant(config),
            grad_quant=QuantSpec(qgz.bits, qgz.block_size) if qgz.enabled else None,
            grad_intra_quant=QuantSpec(qgz.intra_node_bits or qgz.bits, qgz.block_size)
            if qgz.enabled and qgz.intra_node_quantized
            else None,
            grad_hadamard=qgz.hadamard,
            grad_error_beta=qgz.error_beta if qgz.error_feedback == "loco" else None,
            qgz_chunks=qgz.pipeline_chunks,
            qgz_min_chunk=qgz.pipeline_min_chunk,
            kernels=kernels_for(device, config.quant_backend) if quantized else None,
            quant_stream=torch.cuda.Stream(device) if side_stream else None,
            master_device=torch.device("cpu") if config.offload.optimizer != "none" else None,
            compute_shard_device=torch.device("cpu") if config.offload.params != "none" else None,
            grad_arena=self.gradient_buffers,
        )

    def _build_units(
        self, model: nn.Module, unit_modules: list[nn.Module], init_fn: InitFn | None, seed: int
    ) -> list[FlatUnit]:
        """Materialize, flatten and shard one unit at a time (root last)."""
        meta = materialize.is_meta(model)
        frozen = self.policy.shard_parameters  # See [Note: frozen weights in backward]
        grouped = dict((id(m), params) for m, params in group_parameters(model, unit_modules, frozen))
        managed = {id(p) for params in grouped.values() for _, p in params}
        scopes = materialize.unit_scopes(model, unit_modules)
        options, world = self._unit_options(), self.topology.world
        names = {id(m): name for name, m in model.named_modules()}
        built = []
        for module in [*(m for m in unit_modules if m is not model), model]:
            scope, params = scopes.get(id(module), []), grouped.get(id(module), [])
            trainable = [(n, p) for n, p in params if p.requires_grad]
            groups = self.expert_groups if module in self.expert_units else self.groups  # the unit's shard groups
            flat, views = materialize.host_flat(trainable, groups, self.policy, options) if meta else (None, {})
            if meta:  # the unit's fp32 parameters are initialized straight into its flat buffer
                materialize.initialize_scope(scope, model, seed, init_fn, views)
            materialize.place_fixed(
                scope, managed, self.topology.device, self.compute_dtype, self.comm, None if meta else world
            )
            built_from = dict(broadcast_initial=not meta, initial_flat=flat, name=names.get(id(module), ""))
            unit = FlatUnit(module, params, self.comm, groups, self.policy, options, **built_from) if params else None
            # Drop the buffer and its views before the next unit allocates its own: either kept
            # alive would hold two whole units at once instead of one.
            del flat, views, built_from
            built.extend([unit] if unit is not None else [])
            if unit is not None and self.disk is not None:  # to its file before the next unit is built
                self.disk.add(unit.master, unit)
            if unit is not None and self.param_disk is not None:
                self.param_disk.add(unit)
            if unit is not None and self.config.master_dtype != "fp32":
                keep_master_in(unit, DTYPES[self.config.master_dtype])
        return built

    # -- forward ---------------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        phase = "forward" if self.module.training and torch.is_grad_enabled() else "eval"
        if phase == "eval":  # outside training the weights hold every step taken
            self.update.settle()
        if self.early is not None:
            self.early.refuse_torn_weights()
        if self.compute_dtype != torch.float32:  # floating inputs meet the parameters in their dtype
            args, kwargs = tree_map_only(
                torch.Tensor, lambda t: t.to(self.compute_dtype) if t.is_floating_point() else t, (args, kwargs)
            )
        with self.comm.in_phase(phase), kv_cache_off(self._kv_caches if torch.is_grad_enabled() else []):
            return self.module(*args, **kwargs)

    # -- generation ------------------------------------------------------------------------------

    # See [Note: gathered generation] (docs/design.md)
    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Gather every unit once (the ledger's eval phase), keep them gathered for the block and
        reshard them at its exit. Costs the whole model in the compute dtype on every rank, on top of
        the shards. Collective: every rank enters and leaves the block together."""
        refuse_whole_prompts(self.topology, "engine.gathered")
        self.update.settle()
        with self.comm.in_phase("eval"):
            self.runtime.gather_all()
        try:
            yield
        finally:
            self.runtime.release_all()

    def generate(self, *args: Any, gathered: bool = True, **kwargs: Any) -> Any:
        """The model's own ``generate(*args, **kwargs)`` without gradients, in the ledger's eval phase:
        inside :meth:`gathered` (default), or unit by unit, every unit gathered for every token."""
        refuse_whole_prompts(self.topology, "engine.generate")
        if not callable(getattr(self.module, "generate", None)):
            raise ConfigError(
                f"engine.generate: {type(self.module).__name__} has no generate method; "
                "call your own decoding loop inside engine.gathered()"
            )
        self.update.settle()
        block = self.gathered() if gathered else contextlib.nullcontext()
        with torch.no_grad(), self.comm.in_phase("eval"), block:
            return self.module.generate(*args, **kwargs)

    # -- backward --------------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch; gradients are averaged over ranks and micro-batches."""
        self.states.require_on_device("backward")
        boundary = (self.micro_step + 1) % self.config.gradient_accumulation_steps == 0
        if self.disk is not None and self.disk.gradients is not None:  # its statistics at the boundary only
            self.disk.gradients.at_boundary = boundary
        scale = self.scaler.scale / self.config.gradient_accumulation_steps
        on_reduced = self.early.begin(boundary) if self.early is not None else None
        if on_reduced is not None:  # the units step as they are reduced: at the rate set now
            self.optimizer_spec.follow_sources(self.optimizers)
        with self.comm.in_phase("backward"):
            reduce = self.policy.shard_gradients or boundary
            try:
                self.runtime.backward(loss * scale, reduce=reduce, on_reduced=on_reduced)
            finally:  # no unit lands after it, even where it failed: the worker stops waiting for one
                if self.early is not None:
                    self.early.abandon()
        self.micro_step += 1
        self._at_boundary = boundary

    # -- optimizer step --------------------------------------------------------------------------

    def step(self) -> bool:
        """Run the optimizer if this is an accumulation boundary; return whether weights changed."""
        if not self._at_boundary:
            return False
        self.states.require_on_device("step")
        if self.early is not None:  # nothing below reads a state the worker may still be writing
            self.early.wait()
        self._at_boundary = False
        for unit in self.units:  # no gathered copy may outlive the weights it was gathered from
            unit.reshard()
        with self.comm.in_phase("step"):
            self.update.settle()  # the last step's delayed update: See [Note: the delayed parameter update]
            self.measured_model_state_bytes = self.model_state_bytes()
            on_disk = self.disk.gradients if self.disk is not None else None  # See [Note: gradients on disk]
            finite, squares = gradient_statistics(self.units, self.scaler, self.topology.device, on_disk)
            overflow = self._any_overflow(finite) if self.scaler.enabled else False
            self.last_step_skipped = overflow
            if not overflow:
                self._grad_norm = self._reduce_over_shards(squares, "sum").sqrt()
                coefficient = clip_coefficient(self._grad_norm, self.config.max_grad_norm)
                if self.whole is not None:
                    self.whole.step(self.scaler, coefficient)
                elif self.early is None or not self.early.publish():  # publish(): stepped in backward
                    self.optimizer_spec.follow_sources(self.optimizers)  # the user's scheduler's rate
                    given = self.stepper.given_gradients(self.comm, self.groups.shard)
                    self.update.step(self.scaler, coefficient, given)
                if self.outer is not None:
                    self.outer.after_step(self.global_step + 1)
            scale = self.scaler.scale
            self.scaler.update(overflow)
            self._follow_loss_scale(overflow, self.scaler.scale / scale)
            for unit in self.units:
                unit.clear_gradients()
        if self.activation_checkpointing is not None:
            self.last_activation_checkpoints = self.activation_checkpointing.new_step()
        self.last_gradient_allocations = self.gradient_buffers.end_step()
        self.global_step += 1
        self.comm.ledger.steps += 1
        self._check_sequences()
        reset = self.config.qgz.error_reset_steps
        if reset and self.global_step % reset == 0:  # LoCo's periodic reset (reset_T)
            self.reset_error_feedback()
        return not overflow

    def _check_sequences(self) -> None:
        """After the first step and every zero.sequence_check_interval: did every rank issue the same
        collectives? (SequenceMismatch names the first difference.) See [Note: collective sequences]."""
        interval, step = self.config.sequence_check_interval, self.global_step
        if interval and (step == 1 or step % interval == 0):
            check_sequences(self.comm, step)
        self.comm.trace.step = step

    def publish_update(self) -> None:
        """Publish a delayed optimizer step (``zero.offload.delayed_update``) to the weights now; evals,
        generation and state dicts do it themselves. Collective where publishing is (stages 1-2)."""
        self.update.settle()

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm of the last step taken, before clipping (reading it synchronizes
        with the device; the step itself does not)."""
        return None if self._grad_norm is None else float(self._grad_norm.item())

    # -- qgZ options over the run ----------------------------------------------------------------

    def set_quantized_gradients(self, on: bool) -> None:
        """Reduce gradients with qgZ (on) or a full-precision reduce-scatter (off; the paper's schedule
        turns qgZ off for the end of a run, and its error-feedback residuals are freed then, with the
        message buffers and kernel scratch its hops kept). Every rank must switch at the same step."""
        switched_off = not on and any(unit.quantize_gradients for unit in self.units)
        for unit in self.units:
            unit.quantize_gradients = on and unit.options.grad_quant is not None
            if not on and unit.error_feedback is not None:
                unit.error_feedback.free()
        if switched_off:  # qwZ's buffers go with them once and come back at its next gather
            quantized.messages.release()
            scratch.release()

    def qgz_residual_bytes(self) -> int:
        """Bytes of qgZ error-feedback residuals this rank holds (created at a unit's first qgZ reduction)."""
        return sum(4 * u.error_feedback.numel() for u in self.units if u.error_feedback is not None)

    def _follow_loss_scale(self, overflow: bool, ratio: float) -> None:
        """qgZ residuals hold loss-scaled gradient error: an overflow leaves inf or nan in them (zeroed),
        a new loss scale rescales them."""
        for unit in self.units:
            if unit.error_feedback is not None:
                if overflow:
                    unit.error_feedback.reset()
                elif ratio != 1:
                    unit.error_feedback.scale(ratio)

    def reset_error_feedback(self) -> None:
        """Zero every qgZ residual (LoCo's periodic reset; also a run on another world size)."""
        for unit in self.units:
            if unit.error_feedback is not None:
                unit.error_feedback.reset()

    def _reduce_over_shards(self, local: torch.Tensor, reduce: str) -> torch.Tensor:
        """Combine a per-rank statistic of the gradients over the ranks whose masters differ: the
        tensor-parallel ranks, and the data-parallel ones where the optimizer state is sharded (one
        node's, under DiLoCo)."""
        group = self.replica if self.policy.shard_optimizer else self.topology.tensor_parallel
        self.comm.all_reduce(local, group, reduce=reduce)
        return local

    def _any_overflow(self, finite: torch.Tensor) -> bool:
        """Whether any rank's gradients hold an inf or a nan: the step's one host synchronization
        under fp16 (skipping the step is a decision the host takes), one for all units."""
        local = finite.logical_not().to(torch.float32).reshape(1)
        return bool(self._reduce_over_shards(local, "max").item())

    def states_resident(self, changes: bool = False) -> contextlib.AbstractContextManager:
        """The masters and optimizer states complete (a delayed step waited for) and in memory for the block, where
        the disk tier keeps them in files; `changes`: the block writes them (they go back to the files), and
        the compute shards the parameters' disk tier keeps, which follow the masters, too."""
        self._settle_steps("reading or writing the model states")
        return resident(self.disk, self.param_disk, changes)

    def _settle_steps(self, what: str) -> None:
        """The delayed step waited for; `what` refused while units stepped in backward await engine.step()."""
        self.update.wait()
        if self.early is not None:
            self.early.require_published(what)

    # -- modes, state, measurement ---------------------------------------------------------------

    def offload_states(self, include: str | Iterable[str] = KINDS) -> StatesMoved:
        """Move the states of `include` (optimizer, master, gradients) that live on the device to host
        memory (pinned on CUDA) and free their device copies; forward and generation still run,
        backward and step wait for :meth:`reload_states` (:mod:`zeropp.zero.offload.states`)."""
        self._settle_steps("offload_states()")
        return self.states.offload(include)

    def reload_states(self) -> StatesMoved:
        """Bring back what :meth:`offload_states` moved."""
        return self.states.reload()

    def train(self, mode: bool = True) -> ZeroEngine:
        self.module.train(mode)
        return self

    def eval(self) -> ZeroEngine:
        return self.train(False)

    # -- state (per-parameter, sharding-independent: zeropp.checkpoint.per_parameter) --------------------------------

    @functools.cached_property
    def checkpoint_mesh(self) -> per_parameter.CheckpointMesh:
        """The ranks as the (tensor-parallel x data-parallel) mesh the per-parameter state is cut over (built once, on first use)."""
        return per_parameter.CheckpointMesh(self.topology, self.groups.shard)

    def sharded_state_dict(self, frozen: bool = True) -> dict[str, Any]:
        """Masters, optimizer state and fixed tensors per parameter, each rank its pieces (collective).
        With the disk tier the pieces are copies, unless the caller holds :meth:`states_resident`.
        Without `frozen`, the units' frozen parameters (stage 3) are left out rather than gathered."""
        copies = self.disk is not None and not self.disk.is_resident
        with self.states_resident():
            state = per_parameter.sharded_state_dict(self.units, self.stepper, self.module, self.checkpoint_mesh, frozen)  # fmt: skip
            state.update(per_parameter.owned_state_entries(self.whole) if self.whole else {})
            return tree_map_only(torch.Tensor, torch.clone, state) if copies else state

    def sharded_state_template(self, saved: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, Any]:
        """Empty tensors in the form of :meth:`sharded_state_dict`, to load into; `saved`: the shape and
        dtype of each ``optim.<name>.<key>`` entry of the checkpoint."""
        template = per_parameter.sharded_state_template(self.units, self.module, self.checkpoint_mesh, {} if self.whole else saved)  # fmt: skip
        return template | (per_parameter.owned_state_template(self.whole, saved) if self.whole else {})

    def load_sharded_state_dict(self, sharded: Mapping[str, Any]) -> None:
        """Set masters, weights and optimizer state from a :meth:`sharded_state_dict` (collective)."""
        self.states.require_on_device("loading a state")
        if self.early is not None:  # what a failed boundary backward stepped is overwritten
            self.early.discard()
        with self.states_resident(changes=True):
            per_parameter.load_sharded_state_dict(self.units, self.stepper, self.module, sharded)
            if self.whole is not None:
                per_parameter.load_owned_states(self.whole, sharded)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The consolidated fp32 model state (``model.state_dict()`` keys), on CPU, on every rank."""
        with self.comm.in_phase("other"):  # tensor-parallel pieces are gathered by DTensor
            with self.states_resident():
                return per_parameter.full_state_dict(self.units, self.module)

    # See [Note: MD arenas]: with MD the gradient arena counts whole
    def model_state_bytes(self) -> int:
        """Bytes of model states this rank holds now: parameters, gradients, master, optimizer state."""
        states = [v for o in self.optimizers for s in o.state.values() for v in s.values()]
        held = [*states, *(self.whole.masters() if self.whole else ()), *(self.outer.tensors() if self.outer else ())]
        tensors = [t for unit in self.units for t in unit.state_tensors()]
        return distinct_storage_bytes([*tensors, *(t for t in held if isinstance(t, torch.Tensor) and t.dim() > 0)])

    @property
    def param_count(self) -> int:
        return sum(unit.layout.numel for unit in self.units)
