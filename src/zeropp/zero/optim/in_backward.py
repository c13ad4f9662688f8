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
  backward, exactly as without this switch; but each unit's part of it (its sum of squares) is
  computed on the worker as the unit lands (with the disk tier, as it is parked), so the norm is
  known as soon as backward ends and the step reads the gradients only to step them. The gradient
  norm the engine reports sums the same parts of the same untouched gradients, in the same order.
- The learning rate and the other hyperparameters are the ones set before the boundary micro-batch's
  backward (a scheduler steps after ``engine.step()``, as usual).
- The compute weights follow the masters at ``engine.step()``, in unit order on the main thread:
  at stages 1-2 that publication is a collective, and every rank must issue it at the same point.
  With the optimizer's disk tier (stage 3 only) one task on the worker streams the states through
  the ring in the order the units landed at the last boundary (the first: last unit first), so
  reads run ahead and writes behind as in the step after backward; it steps each unit once it has
  landed, publishes its compute shard (a copy, no collective) while the master is in memory, and
  the ring writes the states back. Its gradient comes back from the disk (See [Note: gradients on
  disk]). A unit that never lands (a backward that failed half-way) stops the stream when
  :meth:`BackwardStep.wait` says backward is over.
- The worker only reads gradients and steps masters: the gradient buffer is taken from the unit's
  pool on the main thread (:meth:`~zeropp.zero.unit.FlatUnit.reduced_gradient`). On CUDA the main
  thread records an event on its stream after the gradient (and its copy to a host master); the
  worker's kernels wait for it (a host master: the worker waits), and the worker synchronizes its
  stream before the step counts as done, so the publication reads finished masters.
- ``engine.step()`` waits for the worker before it reads anything; what reads or moves the model
  states between a boundary backward and ``engine.step()`` (state dicts, checkpoints, loads,
  ``offload_states``) is refused in one line (the masters moved, the weights and the step count
  not yet), and so is a boundary backward after one that ``engine.step()`` did not follow (a
  failed backward): its units would be stepped twice.
- The segment step (See [Note: segments]) learns which parameters some rank gave a gradient per unit,
  as that unit lands: one all-reduce (max) of a byte per parameter issued on the main thread, in
  program order, and waited for by the worker; without it, one all-reduce for all units at the step.

Refused in one line (the config, the engine): fp16, the delayed update, the parameters' disk tier
and the optimizer's at stages 1-2 or with ``persistence_threshold`` (their publication is a
collective), DiLoCo's outer loop, the whole-parameter path and optimizers other than torch's
element-wise ones.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from zeropp.errors import ConfigError
from zeropp.zero.optim.segments import SegmentStep
from zeropp.zero.optim.stepping import (
    ELEMENTWISE_OPTIMIZERS,
    given_of,
    gradient_flags,
    publish_unit,
    step_masters,
    unit_statistics,
)

if TYPE_CHECKING:
    from zeropp.comm.communicator import Communicator, Pending
    from zeropp.config.sections import ZeroConfig
    from zeropp.topology import Group
    from zeropp.zero.offload.disk import DiskTier
    from zeropp.zero.optim.spec import OptimizerSpec
    from zeropp.zero.optim.stepping import Stepper
    from zeropp.zero.unit import FlatUnit


class BackwardStep:
    """Steps the units of the boundary micro-batch's backward as their reductions land (See [Note: the
    step inside backward])."""

    def __init__(
        self, stepper: Stepper, config: ZeroConfig, comm: Communicator, group: Group, disk: DiskTier | None = None
    ) -> None:
        """`comm`, `group`: where the segment step learns which parameters some rank gave a gradient;
        `disk`: the optimizer's disk tier, where the states live in files."""
        self.stepper, self.comm, self.group, self.disk = stepper, comm, group, disk
        self.segments = isinstance(stepper, SegmentStep)
        self.host_copies = config.offload.optimizer == "cpu"  # the masters live in host memory
        self.waits_for_norm = config.max_grad_norm is not None  # steps after backward, as without it
        self._index = {id(unit): k for k, unit in enumerate(stepper.units)}
        self._thread = ThreadPoolExecutor(1, "zeropp-step-in-backward")
        weakref.finalize(self, self._thread.shutdown, wait=False)
        self._running: list[Future] = []
        self._stepped: list[int] = []
        # the disk tier's boundary: one task streams the states (See _stream), fed as units land
        self._landed: list[tuple | None] = []  # per unit, _step's arguments once it has landed
        self._arrivals: list[threading.Event] = []
        self._landing_order: list[int] = []  # the last boundary's
        # the last boundary backward's: (unit, landed, step started, step done) in perf_counter seconds, and
        # how long engine.step() waited for the worker (``zeropp bench optimizer --in-backward``)
        self.timeline: list[tuple[int, float, float, float]] = []
        self.waited_s = 0.0

    def begin(self, boundary: bool) -> Callable[[FlatUnit], None] | None:
        """Before a micro-batch's backward: what the runtime calls as each unit's reduction lands: its
        step, or with clipping its part of the norm (None: not the boundary, or the disk tier computes
        that part as it parks the gradient). Units stepped in an earlier backward and never published
        (no engine.step() after it) refuse the run: stepping them again would step them twice."""
        self.wait()
        if self._stepped:
            raise RuntimeError(
                "zeropp: zero.step_in_backward stepped units in the last accumulation boundary's backward, which "
                "engine.step() did not follow (a failed backward?); expected a checkpoint loaded before training on"
            )
        if not boundary:
            return None
        self.timeline, self.waited_s = [], 0.0
        if self.waits_for_norm:  # the norm's statistics as units land (the disk tier computes them as it parks)
            return None if self._parked else self._statistics_as_they_land
        if self.disk is not None:
            self._landed = [None] * len(self.stepper.units)
            self._arrivals = [threading.Event() for _ in self.stepper.units]
            # the last boundary's landing order, then the rest: the blocks last first, the root (built last) last
            n, landed = len(self.stepper.units), self._landing_order
            order = landed + [k for k in [*reversed(range(n - 1)), n - 1] if k not in landed]
            self._running.append(self._thread.submit(self._stream, order))
            self._landing_order = []
        return self.on_reduced

    def on_reduced(self, unit: FlatUnit) -> None:
        """`unit`'s reduction landed on the boundary micro-batch: launch its step."""
        k = self._index[id(unit)]
        grad, ready = (None if self._parked else unit.reduced_gradient()), None  # parked: the worker reads it back
        if grad is not None and grad.device.type == "cuda":  # the worker's kernels wait for this stream's work
            stream = torch.cuda.current_stream(grad.device)
            if self.host_copies:  # issued here, in stream order
                grad = grad.to(unit.master.device, unit.master.dtype, non_blocking=True)
            ready = stream.record_event()
        given = None
        if self.segments:  # which parameters some rank gave a gradient: this unit's byte per parameter, async
            flags = gradient_flags([unit])
            given = (flags, self.comm.all_reduce(flags, self.group, reduce="max", async_op=True))
        self._stepped.append(k)
        landed = (k, grad, ready, given, time.perf_counter())
        if self.disk is None:
            self._running.append(self._thread.submit(self._step, *landed))
        else:  # to the stream (it may be waiting for this unit)
            self._landing_order.append(k)
            self._landed[k] = landed
            self._arrivals[k].set()

    def _statistics_as_they_land(self, unit: FlatUnit) -> None:
        """With clipping: `unit`'s part of the norm computed on the worker as it lands, while backward goes
        on; the step waits for backward (the norm needs every unit's)."""
        grad, ready = unit.reduced_gradient(), None
        if grad.device.type == "cuda":
            ready = torch.cuda.current_stream(grad.device).record_event()
        self._running.append(self._thread.submit(self._unit_statistics, unit, grad, ready))

    def _unit_statistics(self, unit: FlatUnit, grad: torch.Tensor, ready: torch.cuda.Event | None) -> None:
        if ready is not None:
            torch.cuda.current_stream(grad.device).wait_event(ready)
        unit.known_statistics = unit_statistics(unit, grad, None)
        if ready is not None:  # engine.step() reads them on its stream
            torch.cuda.current_stream(grad.device).synchronize()

    def _stream(self, order: list[int]) -> None:
        """The disk tier's boundary: the units' states read ahead through the ring in `order` (the
        order they landed in at the last boundary), each stepped once it has landed and written back.
        Stops where a unit will not land (:meth:`wait` was called: backward is over) or the process
        is exiting (a worker blocked here would hold up the interpreter's exit)."""
        with contextlib.closing(self.disk.streamed([[k] for k in order])) as stream:  # stopped: freed, errors raised
            for [k] in stream:
                while not self._arrivals[k].wait(timeout=1.0):
                    if not threading.main_thread().is_alive():
                        return
                if self._landed[k] is None:  # woken by abandon(): it never landed
                    return
                self._step(*self._landed[k])

    def _step(
        self,
        k: int,
        grad: torch.Tensor | None,
        ready: torch.cuda.Event | None,
        given: tuple[torch.Tensor, Pending] | None,
        landed: float,
    ) -> None:
        started = time.perf_counter()
        master = self.stepper.units[k].master
        if ready is not None and master.device.type == "cuda":  # the step's kernels after the gradient's
            torch.cuda.current_stream(master.device).wait_event(ready)
        elif ready is not None:  # a host master reads the copy once it has arrived
            ready.synchronize()
        chosen = None  # the segment step's: the parameters some rank gave a gradient
        if given is not None:
            flags, reduced = given
            reduced.wait()
            chosen = {k: given_of([self.stepper.units[k]], flags)[0]}
        copies = {} if grad is None else {k: grad.to(master.device, master.dtype)}  # the buffer itself where it matches
        batches: Iterable[Sequence[int]] = [[k]]
        if grad is None:  # the gradient back from its file (after its write: one I/O thread)
            batches = self.disk.gradients.taken([[k]], batches, copies)
        # the disk tier's states are in memory (_stream): published now (stage 3: not a collective)
        publish = None if self.disk is None else self._publish_now
        step_masters(self.stepper, self.stepper.optimizers, copies, None, None, batches, chosen, publish)
        if master.device.type == "cuda":  # publication (main thread's stream) reads the stepped master
            torch.cuda.current_stream(master.device).synchronize()
        self.timeline.append((k, landed, started, time.perf_counter()))

    def _publish_now(self, k: int) -> None:
        """Unit `k`'s compute shard from its master while the disk tier holds it in memory; on CUDA the
        copy is done before the ring's slot is written back and reused."""
        unit = self.stepper.units[k]
        publish_unit(unit, None)
        if unit.options.device.type == "cuda":
            torch.cuda.current_stream(unit.options.device).synchronize()

    @property
    def _parked(self) -> bool:
        """The reduced gradients go to the disk tier's files (See [Note: gradients on disk])."""
        return self.disk is not None and self.disk.gradients is not None

    def abandon(self) -> None:
        """Backward is over (or failed): no unit lands after this, so the disk tier's stream stops at
        one that has not instead of waiting for it (a failed backward must not hold up the process)."""
        for arrival in self._arrivals:
            arrival.set()

    def discard(self) -> None:
        """A checkpoint is being loaded: what the last boundary's backward stepped is overwritten."""
        self.wait()
        self._stepped, self._landing_order = [], []

    def refuse_torn_weights(self) -> None:
        """With the disk tier the worker publishes each unit's weights as it steps it: a forward between a
        boundary backward and engine.step() would read some units stepped and others not."""
        if self.disk is not None and self._stepped:
            raise RuntimeError(
                "zeropp: a forward between engine.backward() and engine.step() is not allowed with "
                "zero.step_in_backward and the optimizer's disk tier (the weights are being stepped, or a backward "
                "failed); expected engine.step() first, or a checkpoint loaded"
            )

    def wait(self) -> None:
        """Wait for the steps launched in backward (their errors raised here); backward is over."""
        self.abandon()
        running, self._running, tick = self._running, [], time.perf_counter()
        for future in running:
            future.result()
        self.waited_s += time.perf_counter() - tick

    def require_published(self, what: str) -> None:
        """Refuse `what` (reading or moving the model states) while units stepped in backward wait for
        engine.step(): their masters have moved, their weights and the step count not yet."""
        self.wait()
        if self._stepped:
            raise RuntimeError(
                f"zeropp: {what} between engine.backward() and engine.step() is not allowed with "
                "zero.step_in_backward (the units were stepped in backward); expected engine.step() first"
            )

    def publish(self) -> bool:
        """Publish every unit stepped in backward, in unit order, once all are done; whether this step's
        units were stepped in backward (False: none was launched)."""
        self.wait()
        stepped, self._stepped = self._stepped, []
        if not stepped:
            return False
        if sorted(stepped) != list(range(len(self.stepper.units))):
            raise RuntimeError("zeropp: zero.step_in_backward: a unit was not stepped in backward; expected every unit")
        for unit in self.stepper.units if self.disk is None else ():  # the disk tier's: published when stepped
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


def backward_step(
    config: ZeroConfig, stepper: Stepper, comm: Communicator, group: Group, disk: DiskTier | None
) -> BackwardStep | None:
    """The engine's :class:`BackwardStep` where ``zero.step_in_backward`` asks for one, after
    :func:`refuse_step_in_backward`."""
    return BackwardStep(stepper, config, comm, group, disk) if config.step_in_backward else None
