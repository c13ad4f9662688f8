"""Index math of a unit's flat buffer: where each parameter lives and which slice each rank owns.

Padding: the parameters of a unit are laid end to end (``numel`` elements), then padded up to
``padded = ceil(numel / (world * alignment)) * world * alignment``. Every rank's shard is then
``padded / world`` elements, a multiple of ``alignment``: equal shards make all-gather and
reduce-scatter single calls, and aligned shards start on a quantization-block boundary. The pad
is at the end of the buffer, so it lands in the last ranks' shards; it holds zeros, receives zero
gradients and therefore never changes (Adam's update of a zero with zero gradient is zero).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class FlatLayout:
    shapes: tuple[tuple[int, ...], ...]
    world: int
    alignment: int

    @cached_property
    def numels(self) -> tuple[int, ...]:
        return tuple(math.prod(shape) for shape in self.shapes)

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        offsets, running = [], 0
        for n in self.numels:
            offsets.append(running)
            running += n
        return tuple(offsets)

    @property
    def numel(self) -> int:
        return sum(self.numels)

    @property
    def padded_numel(self) -> int:
        quantum = self.world * self.alignment
        return max(1, math.ceil(self.numel / quantum)) * quantum

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world

    def shard_range(self, rank: int) -> tuple[int, int]:
        """[start, stop) of `rank`'s shard in the padded flat buffer."""
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def param_range(self, index: int) -> tuple[int, int]:
        """[start, stop) of parameter `index` in the flat buffer."""
        start = self.offsets[index]
        return start, start + self.numels[index]
