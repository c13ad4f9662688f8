"""Hooks that drive the units through forward and backward, and the backward pass around them.

Hook order within one training step (sharded units, i.e. stage 3):

1. forward pre-hook of a unit: gather it (waiting for a prefetch if one is in flight), then start
   gathering the next ``prefetch`` units of the forward order recorded in the first step;
2. forward post-hook: put a gradient hook on the outputs (the unit's *pre-backward*), reshard;
3. pre-backward (first output gradient reaching the unit): gather again, prefetch the next units
   of the recorded backward order;
4. each parameter's post-accumulate-grad hook adds its gradient into the unit's flat gradient
   buffer; when the last one has arrived the unit reshards and its reduction starts (async); a unit
   holding frozen parameters also waits for the gradients of its forward inputs ([Note: frozen
   weights in backward]);
5. end of backward: units some of whose parameters got no gradient are reduced in a fixed order
   (every rank issues the same collectives), then every reduction is waited for.

Resident units (stages 0-2, or small units under the persistence threshold) skip 1-3. During
backward, a model's own activation checkpointing runs forward hooks again in recomputation: the unit
is gathered (it already is, for backward) and nothing is recorded, prefetched or resharded. The
engine's ``activation_checkpointing`` replaces ``forward`` only, so its recomputation runs no hook
(:mod:`zeropp.runtime.activation_checkpointing`).

With the parameters on disk (``offload_params = "nvme"``) a unit's shard is read before its gather
(:meth:`ParamFiles.fetch <zeropp.zero.offload.disk_params.ParamFiles.fetch>`), freed once the gather is
waited for, and the shards of the units recorded after it are read ahead
(:mod:`zeropp.zero.offload.disk_params`).

Inside :meth:`Runtime.gather_all` ... :meth:`Runtime.release_all` (``engine.gathered()``) every unit
is gathered once and the hooks reshard none of them ([Note: gathered generation]).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from zeropp.comm.communicator import Pending
from zeropp.runtime.order import ExecutionOrder
from zeropp.runtime.reductions import ReductionQueue
from zeropp.zero.offload.disk_params import ParamFiles
from zeropp.zero.stages import StagePolicy
from zeropp.zero.unit import FlatUnit


class Runtime:
    """The hooks of every unit, the recorded orders, prefetch and the reduction queue."""

    def __init__(
        self,
        units: Sequence[FlatUnit],
        policy: StagePolicy,
        prefetch: int,
        files: ParamFiles | None = None,
        hops_in_program_order: bool = False,
    ) -> None:
        self.units = list(units)
        self.files = files  # the shards' disk tier (offload_params = "nvme")
        self.policy = policy
        self.prefetch = prefetch
        self.forward_order = ExecutionOrder()
        self.backward_order = ExecutionOrder()
        self.reductions = ReductionQueue(hops_in_program_order=hops_in_program_order)  # See ReductionQueue
        self.in_backward = False
        self.held = False  # engine.gathered(): every unit stays gathered, the hooks reshard none
        self._reduce = False
        self._on_reduced: Callable[[FlatUnit], None] | None = None
        for unit in self.units:
            if not unit.resident:
                unit.module.register_forward_pre_hook(functools.partial(self._pre_forward, unit), with_kwargs=True)
                unit.module.register_forward_hook(functools.partial(self._post_forward, unit))
            for index, p in enumerate(unit.params):
                p.register_post_accumulate_grad_hook(functools.partial(self._on_param_grad, unit, index))

    # -- forward ---------------------------------------------------------------------------------

    def _pre_forward(self, unit: FlatUnit, module: nn.Module, args: Any, kwargs: Any) -> None:
        self._gather(unit)
        if self.in_backward:  # activation recompute: already gathered for backward
            return
        self.forward_order.record(unit)
        self._prefetch(self.forward_order, unit)
        if unit.frozen is not None and torch.is_grad_enabled():
            self._watch_input_grads(unit, (args, kwargs))

    # See [Note: frozen weights in backward] (docs/design.md)
    def _watch_input_grads(self, unit: FlatUnit, inputs: Any) -> None:
        """Keep `unit` gathered in backward until the gradients of this call's inputs are computed."""
        tensors = [t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            unit.await_input_grads()
            torch.autograd.graph.register_multi_grad_hook(
                tensors, functools.partial(self._on_input_grads, unit), mode="all"
            )

    def _on_input_grads(self, unit: FlatUnit, grads: Any) -> None:
        if self.in_backward and unit.input_grads_done():
            self._grads_ready(unit)

    def _post_forward(self, unit: FlatUnit, module: nn.Module, args: Any, output: Any) -> None:
        if self.in_backward:
            return
        if torch.is_grad_enabled():
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            for t in tensors:
                t.register_hook(functools.partial(self._pre_backward, unit))
        if not self.held:
            unit.reshard()

    def _gather(self, unit: FlatUnit) -> None:
        """Gather `unit` and wait for it; its shard, read from disk first where it lives there, is freed then."""
        if self.files is not None:
            self.files.fetch(unit)
        unit.unshard()
        if self.files is not None:
            self.files.release(unit)

    def _prefetch(self, order: ExecutionOrder, unit: FlatUnit) -> None:
        """Start gathering the units recorded after `unit` (with the shards on disk, reading ahead first).

        In backward, a unit whose gradients are all in is skipped. The order was recorded in the
        first step and need not hold in later ones (a unit may run twice, a branch may be skipped),
        so a prefetch can name a unit whose backward is already over in this pass: gathering it
        would move its weights for nobody and hold their memory until the step reshards them.
        """

        def wanted(units: list[FlatUnit]) -> list[FlatUnit]:
            return [u for u in units if not (self.in_backward and u.finished_backward)]

        if self.files is not None:
            self.files.read_ahead(wanted(order.after(unit, self.files.window)))
        for upcoming in wanted(order.after(unit, self.prefetch)):
            if self.files is not None:
                self.files.fetch(upcoming)
            upcoming.unshard(async_op=True)

    # -- every unit gathered at once -------------------------------------------------------------

    # See [Note: gathered generation] (docs/design.md)
    def gather_all(self) -> None:
        """Gather every sharded unit (all gathers started, then waited for, in unit order: the same
        on every rank) and keep them gathered until :meth:`release_all`."""
        if self.held:
            raise RuntimeError("zeropp: engine.gathered() blocks do not nest")
        self.held = True
        for unit in self.units:
            if self.files is not None:
                self.files.fetch(unit)
            unit.unshard(async_op=True)
        for unit in self.units:
            self._gather(unit)

    def release_all(self) -> None:
        """Reshard every unit gathered by :meth:`gather_all`; the hooks reshard as usual again."""
        self.held = False
        for unit in self.units:
            unit.reshard()

    # -- backward --------------------------------------------------------------------------------

    def backward(
        self, loss: torch.Tensor, *, reduce: bool, on_reduced: Callable[[FlatUnit], None] | None = None
    ) -> None:
        """Backward of `loss` (already scaled); reduce every unit's gradients as they complete when
        `reduce`, else leave them accumulated in place (a micro-batch before the boundary, stages 0-1);
        `on_reduced(unit)` once a unit's reduction has landed (See [Note: the step inside backward])."""
        self._reduce, self._on_reduced = reduce, on_reduced
        for unit in self.units:
            unit.begin_backward()
        self.in_backward = True
        if self.files is not None and not self.backward_order.recording:  # the first units backward gathers
            self.files.read_ahead(self.backward_order.units[: self.files.window])
        try:
            loss.backward()
            for unit in reversed(self.units):  # fixed order: every rank issues the same collectives
                if not unit.finished_backward:
                    self._grads_ready(unit)
            self.reductions.drain()
        finally:
            self.in_backward = False
            self.reductions.clear()
            for unit in self.units:
                unit.end_backward()
        self.forward_order.freeze()
        self.backward_order.freeze()

    def _require_engine_backward(self) -> None:
        if not self.in_backward:
            raise RuntimeError("zeropp: call engine.backward(loss), not loss.backward(): the engine reduces gradients")

    def _pre_backward(self, unit: FlatUnit, grad: torch.Tensor) -> None:
        self._require_engine_backward()
        if not unit.enter_backward():
            return
        self._gather(unit)
        self.backward_order.record(unit)
        self._prefetch(self.backward_order, unit)

    def _on_param_grad(self, unit: FlatUnit, index: int, param: nn.Parameter) -> None:
        self._require_engine_backward()
        last = unit.add_grad(index, param.grad)
        param.grad = None
        if last:
            self._grads_ready(unit)

    def _grads_ready(self, unit: FlatUnit) -> None:
        unit.finish_backward()
        if self.policy.shard_parameters and not self.held:
            unit.reshard()
        if self._reduce:
            pending = unit.reduce_gradients()
            if self._on_reduced is not None:
                landed = functools.partial(self._on_reduced, unit)
                pending = Pending([pending], landed, start_hops=pending.start_ready_hops)
            self.reductions.push(pending)
