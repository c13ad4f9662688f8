"""Memory for tensors that live from a forward to its backward, optionally carved from one
preallocated buffer: ZeRO-R's MD (contiguous memory), as DeepSpeed's ``contiguous_memory_optimization``.

An :class:`Arena` hands out tensors with :meth:`Arena.take` and takes each back through the release
function it returned. It counts every allocation it makes (``allocations``), so a run can show how
many it needed per step with MD and without.

- Without MD (``contiguous=False``) every take is a fresh allocation.
- With MD the first step measures: each take is still a fresh allocation and the arena records the
  peak of the bytes alive at once. :meth:`Arena.settle` (called by the engine at the end of each
  step) then allocates one buffer of that peak, once. From then on a take is a view of the lowest
  free range of the buffer that fits (first fit, ranges aligned to :data:`ALIGN` bytes), so the
  checkpoints of a step (taken in forward order, given back in reverse) and the staging copies of
  Pa+cpu (taken and given back in the same order, at most two alive) reuse the same memory step
  after step. A take that does not fit (a bigger batch than the first step's) is a fresh,
  counted allocation rather than an error.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

ALIGN = 64  # bytes; every range starts at a multiple, so a view of any dtype is aligned


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class Arena:
    def __init__(self, device: torch.device, *, pinned: bool, contiguous: bool) -> None:
        self.device, self.pinned, self.contiguous = device, pinned, contiguous
        self.buffer: torch.Tensor | None = None  # uint8, once settled
        self.allocations = 0  # fresh allocations so far (the buffer's own included)
        self._ranges: dict[int, int] = {}  # offset in the buffer -> bytes, of the views alive
        self._fresh_bytes = 0  # bytes alive outside the buffer
        self._peak = 0  # most bytes alive at once while measuring

    def take(self, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, Callable[[], None]]:
        """An uninitialized tensor of `numel` elements and the function that gives it back."""
        nbytes = numel * dtype.itemsize
        if self.buffer is not None:
            offset = self._first_fit(_aligned(nbytes))
            if offset is not None:
                self._ranges[offset] = _aligned(nbytes)
                return self.buffer[offset : offset + nbytes].view(dtype), lambda: self._ranges.pop(offset)
        self.allocations += 1
        self._fresh_bytes += _aligned(nbytes)
        self._peak = max(self._peak, self._fresh_bytes)
        tensor = torch.empty(numel, dtype=dtype, device=self.device, pin_memory=self.pinned)
        return tensor, lambda: self._give_back_fresh(_aligned(nbytes))

    def _give_back_fresh(self, nbytes: int) -> None:
        self._fresh_bytes -= nbytes

    def _first_fit(self, nbytes: int) -> int | None:
        start = 0
        for offset in sorted(self._ranges):
            if offset - start >= nbytes:
                return start
            start = offset + self._ranges[offset]
        return start if self.buffer.numel() - start >= nbytes else None

    def settle(self) -> None:
        """With MD, after the first step that took anything: allocate the buffer of the measured peak."""
        if self.contiguous and self.buffer is None and self._peak:
            self.allocations += 1
            self.buffer = torch.empty(self._peak, dtype=torch.uint8, device=self.device, pin_memory=self.pinned)

    @property
    def capacity(self) -> int:
        """Bytes of the preallocated buffer (0 before it exists, or without MD)."""
        return 0 if self.buffer is None else self.buffer.numel()
