"""The order units run in, recorded during the first training step, which prefetch follows."""

from __future__ import annotations

from zeropp.zero.unit import FlatUnit


class ExecutionOrder:
    """Units in the order they first ran in one direction (forward, or backward) of the first step.

    Recording stops at the end of the first backward (:meth:`freeze`); from then on a unit that
    runs is followed by the units recorded after it. A unit that ran before recording stopped but
    was not recorded (it did not run in the first step) never triggers a prefetch.
    """

    def __init__(self) -> None:
        self.units: list[FlatUnit] = []
        self.recording = True
        self._position: dict[int, int] = {}  # id(unit) -> its index in units, once frozen

    def record(self, unit: FlatUnit) -> None:
        if self.recording and unit not in self.units:
            self.units.append(unit)

    def freeze(self) -> None:
        self.recording = False
        self._position = {id(unit): i for i, unit in enumerate(self.units)}

    def after(self, unit: FlatUnit, count: int) -> list[FlatUnit]:
        """The `count` units recorded after `unit` (none while recording, or for an unrecorded unit)."""
        position = self._position.get(id(unit))
        if position is None:  # still recording, or a unit that was not recorded
            return []
        return self.units[position + 1 : position + 1 + count]
