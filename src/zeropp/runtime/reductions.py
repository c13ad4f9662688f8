"""Gradient reductions in flight during backward."""

from __future__ import annotations

from zeropp.comm.communicator import Pending

MAX_IN_FLIGHT = 2  # reductions in flight during backward (zeropp.costs.memory counts their gradients)


# See [Note: qgZ issue order] (docs/design.md)
class ReductionQueue:
    """Reductions issued as units finish backward, oldest first, at most `max_in_flight` at once.

    Why two by default: each reduction holds its unit's whole gradient until it completes. With
    two in flight, one unit's reduction overlaps the backward compute of the next unit while the
    other's finishes, and gradient memory in backward stays bounded by two units' gradients
    whatever the model's depth; issuing a third waits for the oldest.

    qgZ's reductions have a second, inter-node hop that starts only once the first hop's data has
    arrived. Each time a reduction is added, the queue starts the second hops that are ready,
    oldest first, and stops at the first one still waiting: every rank must issue the collectives
    of one group in the same order, so no later unit's hop may overtake an earlier unit's.

    `hops_in_program_order`: where other collectives run over the second hops' ranks (expert
    parallelism's), when a hop's input arrives must not decide where it falls among them: each
    time a reduction is added, the second hops of the ones before it start, waiting for their
    first hops, at the same point of the program on every rank.
    """

    def __init__(self, max_in_flight: int = MAX_IN_FLIGHT, hops_in_program_order: bool = False) -> None:
        self.max_in_flight = max_in_flight
        self.hops_in_program_order = hops_in_program_order
        self._pending: list[Pending] = []

    def push(self, pending: Pending) -> None:
        self._pending.append(pending)
        while len(self._pending) > self.max_in_flight:
            self._pending.pop(0).wait()
        if self.hops_in_program_order:
            for reduction in self._pending[:-1]:
                reduction.start_ready_hops(wait=True)
            return
        for reduction in self._pending:
            if not reduction.start_ready_hops():
                break

    def drain(self) -> None:
        """Wait for every reduction in flight."""
        for reduction in self._pending:
            reduction.wait()
        self._pending = []

    def clear(self) -> None:
        """Forget the reductions in flight (after a failed backward: nothing will wait for them)."""
        self._pending = []
