"""Memory for tensors that live from a forward to its backward, optionally carved from one
preallocated buffer: ZeRO-R's MD (contiguous memory), as DeepSpeed's ``contiguous_memory_optimization``.

An :class:`Arena` hands out tensors with :meth:`Arena.take` and takes each back through the release
function it returned. It counts every allocation it makes (``allocations``), so a run can show how
many it needed per step with MD and without.

- Without MD (``contiguous=False``) every take is a fresh allocation.
- With MD the first step measures: each take is still a fresh allocation and the arena records,
  per size (elements and dtype), the most tensors alive at once. :meth:`Arena.end_step` (called by
  the engine at the end of each step) then allocates one buffer holding that many ranges of each
  size, once. From then on a take is a free range of its size, and giving it back frees the range:
  the checkpoints of a step (taken in forward order, given back in reverse), the staging copies of
  Pa+cpu (at most two alive) and the gradient buffers (a few units' at a time) reuse the same memory
  step after step, whatever order they are given back in. A take for which no range of its size is
  free (a bigger batch than the first step's) is a fresh, counted allocation rather than an error.

:class:`Loans` takes from an arena and gives back by the tensor itself (a unit's gradient buffers).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch

ALIGN = 64  # bytes; every range starts at a multiple, so a view of any dtype is aligned


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


Size = tuple[int, torch.dtype]


# See [Note: MD arenas] (docs/design.md)
class Arena:
    def __init__(self, device: torch.device, *, pinned: bool, contiguous: bool) -> None:
        self.device, self.pinned, self.contiguous = device, pinned, contiguous
        self.buffer: torch.Tensor | None = None  # uint8, once settled
        self.allocations = 0  # fresh allocations so far (the buffer's own included)
        self._counted = 0  # allocations before this step (end_step)
        self._free: dict[Size, list[torch.Tensor]] = defaultdict(list)  # ranges of the buffer, by size
        self._alive: dict[Size, int] = defaultdict(int)  # fresh tensors alive, by size
        self._peak: dict[Size, int] = defaultdict(int)  # the most alive at once while measuring

    def take(self, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, Callable[[], None]]:
        """An uninitialized tensor of `numel` elements and the function that gives it back."""
        size = (numel, dtype)
        if self._free[size]:
            view = self._free[size].pop()
            return view, lambda: self._free[size].append(view)
        self.allocations += 1
        self._alive[size] += 1
        if self.buffer is None:
            self._peak[size] = max(self._peak[size], self._alive[size])
        tensor = torch.empty(numel, dtype=dtype, device=self.device, pin_memory=self.pinned)
        return tensor, lambda: self._give_back_fresh(size)

    def _give_back_fresh(self, size: Size) -> None:
        self._alive[size] -= 1

    def end_step(self) -> int:
        """The end of an optimizer step: the allocations made during it; with MD, after the first step
        that took anything, the buffer of the measured peaks is allocated (counted in no step)."""
        made = self.allocations - self._counted
        self._settle()
        self._counted = self.allocations
        return made

    def _settle(self) -> None:
        if not self.contiguous or self.buffer is not None or not self._peak:
            return
        ranges = [(size, _aligned(size[0] * size[1].itemsize)) for size, n in self._peak.items() for _ in range(n)]
        self.allocations += 1
        self.buffer = torch.empty(
            sum(b for _, b in ranges), dtype=torch.uint8, device=self.device, pin_memory=self.pinned
        )
        offset = 0
        for (numel, dtype), nbytes in ranges:
            self._free[(numel, dtype)].append(self.buffer[offset : offset + numel * dtype.itemsize].view(dtype))
            offset += nbytes

    @property
    def capacity(self) -> int:
        """Bytes of the preallocated buffer (0 before it exists, or without MD)."""
        return 0 if self.buffer is None else self.buffer.numel()


class Loans:
    """Tensors taken from an :class:`Arena`, each given back by passing the tensor itself."""

    def __init__(self, arena: Arena) -> None:
        self.arena = arena
        self._give_back_of: dict[int, Callable[[], None]] = {}  # data_ptr -> how to give it back

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        tensor, give_back = self.arena.take(numel, dtype)
        self._give_back_of[tensor.data_ptr()] = give_back
        return tensor

    def give_back(self, tensor: torch.Tensor | None) -> None:
        """Give `tensor` back (None: nothing to give)."""
        if tensor is not None:
            self._give_back_of.pop(tensor.data_ptr())()
