"""The optimizer step inside backward (``zero.step_in_backward``): each unit's shard is stepped on a
worker thread as soon as the reduction of its last micro-batch's gradient lands, while backward goes
on through the units before it.

[Note: the step inside backward]
Without it the optimizer waits for the whole backward, and (ZeRO-Offload) the device then waits for
the host's step. A unit's reduced gradient is final once the boundary micro-batch's reduction of it
has landed: nothing later in backward writes it. So from that moment its shard can be stepped, and
the step of the units reduced first overlaps the backward of the rest. The weights are bit for bit
those of stepping after backward:

- Each unit is stepped alone, by the same ``optimizer.step()`` call over the same tensors that
  :func:`~zeropp.zero.optim.stepping.step_units` makes (torch's element-wise optimizers, one unit per
  call: :func:`~zeropp.zero.optim.stepping.step_batches`; other optimizers are refused), only
  in another order; no unit's step reads another's.
- The gradient is neither scaled nor clipped in place: fp16 (the overflow check needs every
  gradient) is refused, and with ``max_grad_norm`` the step waits for the global norm, after
  backward, exactly as without this switch. The gradient norm the engine reports is computed at
  ``engine.step()`` from the same untouched gradients, in the same order.
- The learning rate and the other hyperparameters are the ones set before the boundary micro-batch's
  backward (a scheduler steps after ``engine.step()``, as usual).
- The compute weights follow the masters at ``engine.step()``, in unit order on the main thread:
  at stages 1-2 that publication is a collective, and every rank must issue it at the same point.
- The worker only reads gradients and steps masters: the gradient buffer is taken from the unit's
  pool on the main thread (:meth:`~zeropp.zero.unit.FlatUnit.reduced_gradient`); on CUDA its copy to
  a host master is issued there too and the worker waits for it (an event).

- The segment step (See [Note: segments]) learns which parameters some rank gave a gradient per unit,
  as that unit lands: one all-reduce (max) of a byte per parameter issued on the main thread, in
  program order, and waited for by the worker; without it, one all-reduce for all units at the step.

Refused in one line (the config, the engine): fp16, the delayed update, the disk tiers (their ring
streams states in unit order), DiLoCo's outer loop, the whole-parameter path and optimizers other
than torch's element-wise ones.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from zeropp.errors import ConfigError
from zeropp.zero.optim.segments import SegmentStep
from zeropp.zero.optim.stepping import ELEMENTWISE_OPTIMIZERS, publish_unit, step_masters

if TYPE_CHECKING:
    from zeropp.comm.communicator import Communicator, Pending
    from zeropp.config.sections import ZeroConfig
    from zeropp.topology import Group
    from zeropp.zero.optim.spec import OptimizerSpec
    from zeropp.zero.optim.stepping import Stepper
    from zeropp.zero.unit import FlatUnit


class BackwardStep:
    """Steps the units of the boundary micro-batch's backward as their reductions land (See [Note: the
    step inside backward])."""

    def __init__(self, stepper: Stepper, config: ZeroConfig, comm: Communicator, group: Group) -> None:
        """`comm`, `group`: where the segment step learns which parameters some rank gave a gradient."""
        self.stepper, self.comm, self.group = stepper, comm, group
        self.segments = isinstance(stepper, SegmentStep)
        self.host_copies = config.offload.optimizer == "cpu"  # the masters live in host memory
        self.waits_for_norm = config.max_grad_norm is not None  # every step after backward, as without it
        self._index = {id(unit): k for k, unit in enumerate(stepper.units)}
        self._thread = ThreadPoolExecutor(1, "zeropp-step-in-backward")
        self._running: list[Future] = []
        self._stepped: list[int] = []

    def begin(self, boundary: bool) -> Callable[[FlatUnit], None] | None:
        """Before a micro-batch's backward: what the runtime calls as each unit's reduction lands (None:
        not the boundary, or the step waits for the norm). What a failed backward launched is waited
        for and forgotten."""
        for future in self._running:
            future.exception()
        self._running, self._stepped = [], []
        return self.on_reduced if boundary and not self.waits_for_norm else None

    def on_reduced(self, unit: FlatUnit) -> None:
        """`unit`'s reduction landed on the boundary micro-batch: launch its step."""
        k = self._index[id(unit)]
        grad, ready = unit.reduced_gradient(), None
        if grad.device.type == "cuda" and self.host_copies:  # issued here, in stream order; the worker waits
            grad = grad.to(unit.master.device, unit.master.dtype, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        given = None
        if self.segments:  # which parameters some rank gave a gradient: this unit's byte per parameter, async
            flags = torch.tensor([i in unit.with_grad for i in range(len(unit.params))], dtype=torch.uint8)
            flags = flags.to(unit.options.device)
            given = (flags, self.comm.all_reduce(flags, self.group, reduce="max", async_op=True))
        self._stepped.append(k)
        self._running.append(self._thread.submit(self._step, k, grad, ready, given))

    def _step(
        self, k: int, grad: torch.Tensor, ready: torch.cuda.Event | None, given: tuple[torch.Tensor, Pending] | None
    ) -> None:
        if ready is not None:
            ready.synchronize()
        if given is not None:
            flags, reduced = given
            reduced.wait()
            given = {k: {i for i, flag in enumerate(flags.tolist()) if flag}}
        master = self.stepper.units[k].master
        copies = {k: grad.to(master.device, master.dtype)}  # the buffer itself where it matches: not written
        step_masters(self.stepper, self.stepper.optimizers, copies, None, None, [[k]], given)

    def finish(self) -> bool:
        """Wait for the steps launched in backward and publish every unit stepped, in unit order; whether
        this step's units were stepped in backward (False: none was launched)."""
        running, self._running = self._running, []
        for future in running:
            future.result()
        stepped, self._stepped = self._stepped, []
        if not stepped:
            return False
        assert sorted(stepped) == list(range(len(self.stepper.units))), "a unit was not stepped in backward"
        for unit in self.stepper.units:
            publish_unit(unit, None)
        return True


def refuse_step_in_backward(config: ZeroConfig, spec: OptimizerSpec, path: str, outer: bool) -> None:
    """What ``zero.step_in_backward`` cannot step unit by unit, refused in one line before any of the
    engine's collectives (the config refuses the rest)."""
    if not config.step_in_backward:
        return
    unsteppable = [part.cls.__name__ for part in spec.parts if part.cls not in ELEMENTWISE_OPTIMIZERS]
    refused = {
        "zero.outer_sync_every (DiLoCo: its synchronization reads the masters after the step)": outer,
        "the 'whole' optimizer path (whole parameters on owner ranks: not one unit per step call)": path == "whole",
        f"{', '.join(unsteppable)} (one unit per optimizer.step() call: torch's element-wise optimizers only)": bool(
            unsteppable
        ),
    }
    for what, yes in refused.items():
        if yes:
            raise ConfigError(f"zero.step_in_backward = True is not allowed; expected false with {what}")
