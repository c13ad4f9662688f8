"""The time of one training step from its compute and its communication, as stage 3 overlaps them.

A stage-3 pass is a pipeline of two stages per unit: the unit's communication (its weight gather,
in backward also its gradient reduction) and its compute. With prefetch, unit k+1's communication
runs while unit k computes, so for U units of equal cost, G seconds of communication and C of
compute in a pass, the pass takes the two-machine flow shop's makespan

    max(C, G) + min(C, G) / U

(the longer stage throughout, plus one unit of the shorter one at an end of the pipeline, where
nothing overlaps it). A step is its forward pass, its backward pass and the optimizer step; the
backward computes twice the forward's FLOPs (the gradients of both operands of every matmul), so the
measured compute splits 1 : 2 between them; the step's own collectives (the gradient norm's
all-reduce) overlap nothing.

**The backend.** The byte model of :mod:`zeropp.costs.volume` is the ring's (NCCL's). gloo performs a
reduce-scatter as an all-reduce, sending twice the ring's bytes (measured: docs/cluster.md), so
with ``backend = "gloo"`` reduce-scatter bytes count twice in the time.

The model has no fitted constant, but was chosen with 12 steps of the emulated cluster in view (2-4
nodes, 200 Mbit/s and 1 Gbit/s, ZeRO-3 and ZeRO++), where it is within 12% (compute + communication
without overlap: up to 38% off). Over all 63 shaped steps stored (docs/benchmarks.md) it is within
15% at 54; the other 9 are under-predictions of up to 26%, steps well above their own bound.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

Backend = Literal["nccl", "gloo"]
BACKWARD_COMPUTE_SHARE = 2 / 3  # backward's FLOPs are twice the forward's


def pass_seconds(compute_s: float, comm_s: float, units: int) -> float:
    """One pass of `units` equal units: the flow shop's makespan (see the module docstring); with no
    unit gathered per use (stages 0-2) compute and communication add up."""
    if units <= 0 or comm_s == 0:
        return compute_s + comm_s
    return max(compute_s, comm_s) + min(compute_s, comm_s) / units


@dataclass(frozen=True)
class StepTime:
    """A step's predicted seconds: forward and backward passes, the optimizer step's collectives."""

    forward_s: float
    backward_s: float
    step_comm_s: float

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s + self.step_comm_s


def step_seconds(compute_s: float, comm_by_phase_s: Mapping[str, float], units: int) -> StepTime:
    """`compute_s` (a step's compute, measured or estimated) against `comm_by_phase_s` (seconds on
    the wire of the ``forward``, ``backward`` and ``step`` phases), over `units` units gathered per use."""
    backward = BACKWARD_COMPUTE_SHARE * compute_s
    return StepTime(
        forward_s=pass_seconds(compute_s - backward, comm_by_phase_s.get("forward", 0.0), units),
        backward_s=pass_seconds(backward, comm_by_phase_s.get("backward", 0.0), units),
        step_comm_s=comm_by_phase_s.get("step", 0.0),
    )
