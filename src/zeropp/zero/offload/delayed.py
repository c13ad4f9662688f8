"""ZeRO-Offload's delayed parameter update (DPU, ``zero.offload.delayed_update``): the host optimizer step
of step t runs on a thread while step t+1's forward and backward run on the weights from before it.

[Note: the delayed parameter update]
ZeRO-Offload's host step leaves the device idle; DPU overlaps it with the next forward and backward
at the price of one step of staleness, so it is not exact. With w_t the masters after t updates, g_t
the gradients of step t and U the optimizer: w_t = U(w_{t-1}, g_t) as without the delay, but from the
first delayed step on g_t is computed on w_{t-2} instead of w_{t-1}. Its parts:

- The first ``delayed_update_warmup`` optimizer steps of an engine (overflowing fp16 steps do not
  count) run as without the delay: published at once.
- A delayed step takes, on the main thread, the gradients' copies in host memory (its own: the
  gradient buffers are cleared and refilled by the next backward), the loss scale of its step, the
  clipping coefficient (the norm is computed before the step as always) and the optimizers' param
  groups as they are (a scheduler, zeropp train's among them, sets the next step's rate while this
  one runs). The thread steps stand-ins of the optimizers: the same state and tensors, those groups.
- Its masters reach the compute weights at the start of the next ``engine.step()``, before that
  step's statistics (:meth:`DelayedUpdate.settle`), and before the weights are used outside training:
  an eval forward (not training, or without grad), ``gathered()`` and ``generate()`` (where the
  publication is collective, stages 1-2 over several ranks, every rank must evaluate). The next
  step's gradients are then computed on fresh weights: evals change the trajectory.
- What reads the masters and optimizer state (state dicts, checkpoints, loads, ``states_resident``)
  only waits for the thread (:meth:`DelayedUpdate.wait`): a save does not change the trajectory.
- On CUDA the publication's copies to the device are issued before the next launch's synchronize
  (:func:`~zeropp.zero.optim.stepping.host_gradients`), so the thread never writes a master that a
  copy still reads.
- fp16 is allowed: the overflow check and the loss scale's update stay on the main thread, before the
  launch; an overflowing step launches nothing, and the thread unscales by its step's scale.
- Only with ``offload_optimizer = "cpu"`` (:class:`~zeropp.config.policies.OffloadPolicy`), and not with
  DiLoCo's outer loop, whose synchronization reads the masters right after the inner step
  (:func:`~zeropp.zero.optim.outer.runs_outer_loop`).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from zeropp.zero.optim.stepping import host_gradients, publish_unit, step_batches, step_masters, step_units

if TYPE_CHECKING:
    from zeropp.config.policies import OffloadPolicy
    from zeropp.zero.offload.disk import DiskTier
    from zeropp.zero.offload.disk_params import ParamFiles
    from zeropp.zero.optim.stepping import Stepper
    from zeropp.zero.precision import LossScaler


def stand_in(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """An optimizer of `optimizer`'s class sharing its state, tensors and hooks, with a copy of its param
    groups' hyperparameters as they are now (its class's ``step``: a scheduler's wrapper is left out)."""
    copy = object.__new__(type(optimizer))
    copy.__dict__.update({k: v for k, v in optimizer.__dict__.items() if k != "step"})
    copy.param_groups = [
        {k: v if k == "params" or not isinstance(v, torch.Tensor) else v.clone() for k, v in group.items()}
        for group in optimizer.param_groups
    ]
    return copy


class DelayedUpdate:
    """The stepper path's optimizer step (:func:`~zeropp.zero.optim.stepping.step_units`), published at
    once, or with ``delayed_update`` after the warm-up on a thread, published one step later
    (See [Note: the delayed parameter update])."""

    def __init__(
        self, stepper: Stepper | None, offload: OffloadPolicy, disk: DiskTier | None, params: ParamFiles | None
    ) -> None:
        """`stepper`: None on the whole-parameter path, which offload (and so the delay) refuses."""
        self.stepper, self.disk, self.params = stepper, disk, params
        self.host_copies = offload.optimizer == "cpu"  # ZeRO-Offload's host-resident masters
        self.warmup = offload.delayed_update_warmup if offload.delayed_update else None
        self.steps = 0  # optimizer steps taken
        self._thread = ThreadPoolExecutor(1, "zeropp-delayed-update") if offload.delayed_update else None
        self._running: Future | None = None
        self._unpublished = False

    def step(self, scaler: LossScaler, coefficient: torch.Tensor | None, given: list[set[int]] | None) -> None:
        """Step the masters with this step's gradients (`coefficient`: clipping; `given`: per segment)."""
        self.steps += 1
        if self._thread is None or self.steps <= self.warmup:
            step_units(self.stepper, scaler, coefficient, self.host_copies, self.disk, self.params, given)
            return
        units = self.stepper.units
        copies = host_gradients(units, own=True)  # after it the device's work is done: the coefficient is ready
        coefficient = None if coefficient is None else coefficient.to("cpu")
        scale = scaler.scale if scaler.enabled else None
        optimizers = [stand_in(o) for o in self.stepper.optimizers]
        batches = step_batches(optimizers, list(range(len(units))))
        self._running = self._thread.submit(
            step_masters, self.stepper, optimizers, copies, scale, coefficient, batches, given
        )
        self._unpublished = True

    def wait(self) -> None:
        """Wait for a delayed step: the masters and optimizer state are complete (its error raised here)."""
        running, self._running = self._running, None
        if running is not None:
            running.result()

    def settle(self) -> None:
        """Wait for a delayed step and publish its masters to the compute weights (collective where
        publishing is: stages 1-2 over several ranks); a no-op where none is pending."""
        self.wait()
        if self._unpublished:
            self._unpublished = False
            for unit in self.stepper.units:
                publish_unit(unit, self.params)
            if self.params is not None:
                self.params.flush()
