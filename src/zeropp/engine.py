"""The engine: wraps an unmodified model and a torch.optim optimizer, runs any ZeRO stage.

Usage (one process per rank, under torchrun)::

    topo = zeropp.init_topology()
    engine = zeropp.ZeroEngine(model, torch.optim.AdamW, dict(lr=1e-3), ZeroConfig(stage=3), topo)
    loss = engine(x, y)        # forward
    engine.backward(loss)      # backward of one micro-batch
    engine.step()              # optimizer step once every gradient_accumulation_steps micro-batches

Hook order within one training step (sharded units, i.e. stage 3):

1. forward pre-hook of a unit: gather it (waiting for a prefetch if one is in flight), then start
   gathering the next ``prefetch`` units of the order recorded in the first step;
2. forward post-hook: put a gradient hook on the outputs (the unit's *pre-backward*), reshard;
3. pre-backward (first output gradient reaching the unit): gather again, prefetch the next units
   of the recorded backward order;
4. each parameter's post-accumulate-grad hook adds its gradient into the unit's flat gradient
   buffer; when the last one has arrived the unit reshards and its reduction starts (async);
5. end of ``backward``: units some of whose parameters got no gradient are reduced in a fixed order
   (every rank issues the same collectives), then every reduction is waited for.

Units that are resident (stages 0-2, or small units under the persistence threshold) skip 1-3.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map_only

from zeropp.comm import Communicator, Ledger, Pending
from zeropp.config import ConfigError, ZeroConfig
from zeropp.precision import DTYPES, LossScaler
from zeropp.quant import QuantSpec, kernels_for
from zeropp.stages import StagePolicy
from zeropp.topology import Topology
from zeropp.units import FlatUnit, UnitOptions, group_parameters, repeated_blocks

# reductions overlapping backward at once; each holds one unit's full gradient until it completes
MAX_REDUCTIONS_IN_FLIGHT = 2

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


class ZeroEngine:
    def __init__(
        self,
        model: nn.Module,
        optimizer: type[torch.optim.Optimizer] | OptimizerFactory,
        optimizer_kwargs: dict[str, Any] | None = None,
        config: ZeroConfig | None = None,
        topology: Topology | None = None,
        *,
        units: Iterable[nn.Module] | None = None,
        ledger: Ledger | None = None,
    ) -> None:
        from zeropp.topology import init_topology

        self.config = config or ZeroConfig()
        self.config.validate()
        is_class = isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer)
        if optimizer_kwargs and not is_class:
            raise ConfigError("optimizer_kwargs given with an optimizer factory; pass them to one or the other")
        self.topology = topology or init_topology()
        self.comm = Communicator(self.topology, ledger)
        self.policy = StagePolicy.for_stage(self.config.stage)
        self.compute_dtype = DTYPES[self.config.precision]
        self.grad_dtype = DTYPES[self.config.grad_dtype or self.config.precision]
        topology = self.topology  # a bad hpZ size is refused before the first collective
        self.hpz_group_size = self.config.hpz_group_size(topology.world_size, topology.ranks_per_node)
        self.module = model.to(self.topology.device)
        self._cast_unmanaged(model)
        self._sync_initial_weights(model)

        groups = group_parameters(model, repeated_blocks(model) if units is None else units)
        options = self._unit_options(self.hpz_group_size)
        self.units = [FlatUnit(module, params, self.comm, self.policy, options) for module, params in groups]
        masters = [unit.master for unit in self.units]
        self.optimizer = optimizer(masters, **(optimizer_kwargs or {})) if is_class else optimizer(masters)
        self.scaler = LossScaler(self.config.loss_scale, enabled=self.config.precision == "fp16")
        self._register_hooks()

        self.micro_step = 0
        self.global_step = 0
        self._at_boundary = False
        self.last_grad_norm: float | None = None
        self.last_step_skipped = False
        self.measured_model_state_bytes = 0
        self._in_backward = False
        self._reduce_now = False
        self._reductions: list[Pending] = []
        self._forward_order: list[FlatUnit] = []
        self._backward_order: list[FlatUnit] = []
        self._recording = True

    # -- construction ----------------------------------------------------------------------------

    def _unit_options(self, secondary_size: int) -> UnitOptions:
        """The units' options; builds hpZ's secondary groups (collective) unless they are the nodes."""
        config = self.config
        secondary = None
        if secondary_size > 1 and secondary_size == self.topology.ranks_per_node:
            secondary = self.topology.intra_node
        elif secondary_size > 1:
            world = self.topology.world_size
            groups = [tuple(range(g, g + secondary_size)) for g in range(0, world, secondary_size)]
            secondary = self.topology.subgroups(f"hpz{secondary_size}", groups)
        weight_block = config.weight_block_size if config.weight_quantization == "block" else None
        quantized = config.quantized_weights or config.quantized_gradients
        side_stream = config.quantized_weights and self.topology.device.type == "cuda"
        return UnitOptions(
            compute_dtype=self.compute_dtype,
            grad_dtype=self.grad_dtype,
            alignment=config.shard_alignment,
            persistence_threshold=config.persistence_threshold,
            allgather_bucket=config.allgather_bucket_numel,
            reduce_bucket=config.reduce_bucket_numel,
            weight_quant=QuantSpec(config.weight_bits, weight_block) if config.quantized_weights else None,
            grad_quant=QuantSpec(config.gradient_bits, config.gradient_block_size)
            if config.quantized_gradients
            else None,
            qgz_stages=config.qgz_pipeline_stages,
            secondary=secondary,
            kernels=kernels_for(self.topology.device, config.quant_backend) if quantized else None,
            quant_stream=torch.cuda.Stream(self.topology.device) if side_stream else None,
        )

    def _cast_unmanaged(self, model: nn.Module) -> None:
        """Frozen parameters and floating buffers run in the compute dtype, like the managed ones."""
        for p in model.parameters():
            if not p.requires_grad and p.is_floating_point():
                p.data = p.data.to(self.compute_dtype)
        for module in model.modules():
            for name, buf in module.named_buffers(recurse=False):
                if buf is not None and buf.is_floating_point():
                    setattr(module, name, buf.to(self.compute_dtype))

    def _sync_initial_weights(self, model: nn.Module) -> None:
        """Every rank starts from rank 0's weights, as with DistributedDataParallel."""
        for tensor in [*model.parameters(), *model.buffers()]:
            self.comm.broadcast(tensor.data, self.topology.world, src=0)

    def _register_hooks(self) -> None:
        for unit in self.units:
            if not unit.resident:
                unit.module.register_forward_pre_hook(functools.partial(self._pre_forward, unit))
                unit.module.register_forward_hook(functools.partial(self._post_forward, unit))
            for index, p in enumerate(unit.params):
                p.register_post_accumulate_grad_hook(functools.partial(self._on_param_grad, unit, index))

    # -- forward ---------------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        phase = "forward" if self.module.training and torch.is_grad_enabled() else "eval"
        if self.compute_dtype != torch.float32:  # floating inputs meet the parameters in their dtype
            args, kwargs = tree_map_only(
                torch.Tensor, lambda t: t.to(self.compute_dtype) if t.is_floating_point() else t, (args, kwargs)
            )
        with self.comm.ledger.in_phase(phase):
            return self.module(*args, **kwargs)

    def _pre_forward(self, unit: FlatUnit, module: nn.Module, args: Any) -> None:
        unit.unshard()
        if self._in_backward:  # activation recompute: already gathered for backward
            return
        self._record(self._forward_order, unit)
        self._prefetch(self._forward_order, unit)

    def _post_forward(self, unit: FlatUnit, module: nn.Module, args: Any, output: Any) -> None:
        if self._in_backward:
            return
        if torch.is_grad_enabled():
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            for t in tensors:
                t.register_hook(functools.partial(self._pre_backward, unit))
        unit.reshard()

    def _record(self, order: list[FlatUnit], unit: FlatUnit) -> None:
        if self._recording and unit not in order:
            order.append(unit)

    def _prefetch(self, order: list[FlatUnit], unit: FlatUnit) -> None:
        if self._recording or unit not in order:
            return
        position = order.index(unit)
        for upcoming in order[position + 1 : position + 1 + self.config.prefetch]:
            if not (self._in_backward and upcoming.reduced_this_backward):
                upcoming.unshard(async_op=True)

    # -- backward --------------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch; gradients are averaged over ranks and micro-batches."""
        boundary = (self.micro_step + 1) % self.config.gradient_accumulation_steps == 0
        self._reduce_now = self.policy.shard_gradients or boundary
        for unit in self.units:
            unit.pending_grads = len(unit.params)
            unit.reduced_this_backward = False
            unit.gathered_for_backward = False
        scale = self.scaler.scale / self.config.gradient_accumulation_steps
        self._in_backward = True
        try:
            with self.comm.ledger.in_phase("backward"):
                (loss * scale).backward()
                for unit in reversed(self.units):  # fixed order: every rank issues the same collectives
                    if not unit.reduced_this_backward:
                        self._grads_ready(unit)
                for pending in self._reductions:
                    pending.wait()
        finally:
            self._in_backward = False
            self._reductions = []
        self.micro_step += 1
        self._at_boundary = boundary
        self._recording = False

    def _require_engine_backward(self) -> None:
        if not self._in_backward:
            raise RuntimeError("zeropp: call engine.backward(loss), not loss.backward(): the engine reduces gradients")

    def _pre_backward(self, unit: FlatUnit, grad: torch.Tensor) -> None:
        self._require_engine_backward()
        if unit.gathered_for_backward:
            return
        unit.gathered_for_backward = True
        unit.unshard()
        self._record(self._backward_order, unit)
        self._prefetch(self._backward_order, unit)

    def _on_param_grad(self, unit: FlatUnit, index: int, param: nn.Parameter) -> None:
        self._require_engine_backward()
        if unit.reduced_this_backward:
            raise RuntimeError(
                f"zeropp: parameter {unit.names[index]} received a second gradient after its unit was reduced "
                "(reentrant activation checkpointing?); use torch.utils.checkpoint with use_reentrant=False"
            )
        unit.accumulate_param_grad(index, param.grad)
        param.grad = None
        unit.pending_grads -= 1
        if unit.pending_grads == 0:
            self._grads_ready(unit)

    def _grads_ready(self, unit: FlatUnit) -> None:
        unit.reduced_this_backward = True
        if self.policy.shard_parameters:
            unit.reshard()
        if self._reduce_now:
            self._reductions.append(unit.reduce_gradients())
            while len(self._reductions) > MAX_REDUCTIONS_IN_FLIGHT:  # bounds gradient memory in backward
                self._reductions.pop(0).wait()
            for pending in self._reductions:  # qgZ: start inter-node hops whose intra-node hop is done,
                if not pending.poll():  # oldest first, and none of a later unit before an earlier one's
                    break

    # -- optimizer step --------------------------------------------------------------------------

    def step(self) -> bool:
        """Run the optimizer if this is an accumulation boundary; return whether weights changed."""
        if not self._at_boundary:
            return False
        self._at_boundary = False
        for unit in self.units:  # no gathered copy may outlive the weights it was gathered from
            unit.reshard()
        self.measured_model_state_bytes = self.model_state_bytes()
        with self.comm.ledger.in_phase("step"):
            grads = [unit.reduced_gradient() for unit in self.units]
            for unit, grad in zip(self.units, grads, strict=True):
                unit.master.grad = (
                    grad.to(torch.float32).div_(self.scaler.scale) if self.scaler.enabled else grad.float()
                )
            overflow = self._any_overflow() if self.scaler.enabled else False
            self.last_step_skipped = overflow
            if not overflow:
                self.last_grad_norm = self._clip_gradients()
                self.optimizer.step()
                for unit in self.units:
                    unit.publish_master()
            self.scaler.update(overflow)
            for unit in self.units:
                unit.master.grad = None
                unit.clear_gradients()
        self.global_step += 1
        self.comm.ledger.steps += 1
        return not overflow

    def _reduce_over_shards(self, local: torch.Tensor, reduce: str) -> torch.Tensor:
        """Combine a per-rank statistic of the gradient shards over ranks (sharded optimizer only)."""
        if self.policy.shard_optimizer:
            self.comm.all_reduce(local, self.topology.world, reduce=reduce)
        return local

    def _any_overflow(self) -> bool:
        local = torch.zeros(1, device=self.topology.device)
        for unit in self.units:
            if not torch.isfinite(unit.master.grad).all():
                local.fill_(1.0)
        return bool(self._reduce_over_shards(local, "max").item())

    def _clip_gradients(self) -> float:
        """Global gradient norm over all shards; clip to max_grad_norm like clip_grad_norm_."""
        squares = torch.zeros(1, dtype=torch.float32, device=self.topology.device)
        for unit in self.units:
            squares += unit.master.grad.pow(2).sum()
        norm = self._reduce_over_shards(squares, "sum").sqrt()
        if self.config.max_grad_norm is not None:
            coefficient = torch.clamp(self.config.max_grad_norm / (norm + 1e-6), max=1.0)
            for unit in self.units:
                unit.master.grad.mul_(coefficient)
        return float(norm.item())

    # -- modes, state, measurement ---------------------------------------------------------------

    def train(self, mode: bool = True) -> ZeroEngine:
        self.module.train(mode)
        return self

    def eval(self) -> ZeroEngine:
        return self.train(False)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The consolidated fp32 model state (``model.state_dict()`` keys), on CPU, on every rank."""
        full: dict[int, torch.Tensor] = {}
        for unit in self.units:
            flat = unit.gather_flat(unit.master.data)
            for index, p in enumerate(unit.params):
                start, stop = unit.layout.param_range(index)
                full[id(p)] = flat[start:stop].view(p.shape).to("cpu", copy=True)
        state = {}
        for name, tensor in self.module.state_dict(keep_vars=True).items():
            if id(tensor) in full:
                state[name] = full[id(tensor)]
            else:  # frozen parameters and buffers: floating ones back to fp32, others unchanged
                dtype = torch.float32 if tensor.is_floating_point() else tensor.dtype
                state[name] = tensor.detach().to("cpu", dtype, copy=True)
        return state

    def model_state_bytes(self) -> int:
        """Bytes of model states this rank holds now: parameters, gradients, master, optimizer state."""
        tensors = [t for unit in self.units for t in unit.state_tensors()]
        for state in self.optimizer.state.values():
            tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        seen, total = set(), 0
        for t in tensors:
            storage = t.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    @property
    def param_count(self) -> int:
        return sum(unit.layout.numel for unit in self.units)
