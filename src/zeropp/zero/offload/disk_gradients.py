"""The reduced gradients on disk beside the optimizer's states (``offload_optimizer = "nvme"`` at
stages 2 and 3): no rank holds a whole gradient shard.

[Note: gradients on disk]
Without this the reduced gradient shard of every unit stays in memory from its reduction to the
optimizer step, gΨ/N bytes per rank (2 bytes a parameter in bf16), however small the disk tier's
rings: at world 2 the largest part of what a rank holds. So each unit's reduced shard goes to a
file of its own (``grads-NNNN.bin``) as soon as its reduction lands, and travels back with the unit's
master and optimizer state when the step streams them through the ring:

- :meth:`GradientFiles.park` (the main thread, as a reduction lands) queues the write on the
  gradients' own I/O thread (the states' ring has another) and keeps the shard's buffer until it is
  written (at most ``offload_buffer_count`` writes wait; the buffer then goes back to the unit's
  pool; on CUDA the device buffer goes back as soon as its copy to pinned host memory is queued:
  the pool's reuse is stream-ordered). A later micro-batch of the same step
  reads the parked gradient back and adds its own (the same sum, in the same dtype, as adding into
  the shard in memory: IEEE addition is commutative), then writes it again.
- The gradient statistics the step needs first (every gradient finite under fp16, the sum of
  squares for the norm) are computed on the I/O thread from the value it writes, exactly as
  :func:`~zeropp.zero.optim.stepping.gradient_statistics` computes them from the buffer in memory,
  and kept on the unit (``FlatUnit.known_statistics``): the norm is known when backward ends,
  without reading the gradients back; the step reads each unit's gradient once, with its states
  (:meth:`GradientFiles.taken`). Only the boundary micro-batch's sum is measured. On CUDA they
  are computed on the host copy, whose sums run in another order than the device's: there the norm,
  hence clipping, equals the run without the disk tier within rounding, not bit for bit.
- One I/O thread runs a unit's writes and reads in the order they were asked for, so a read (the
  step, or the step inside backward's worker) always finds the last write. Whether a unit's gradient
  is parked is decided on the thread that asks, when it asks.

Per step each rank writes gΨ/N bytes per micro-batch and reads gΨ/N per micro-batch after the first
and once more at the step (:func:`~zeropp.costs.memory.disk_gradients_step_bytes`); host memory holds
the writes in flight and the step's ring of gradients, a few units' shards
(:func:`~zeropp.costs.memory.disk_gradients_ring_bytes`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from zeropp.zero.offload.disk import DiskFiles, bytes_of, open_direct, write_at
from zeropp.zero.optim.stepping import unit_statistics

if TYPE_CHECKING:
    from zeropp.zero.precision import LossScaler
    from zeropp.zero.unit import FlatUnit


class GradientFiles(DiskFiles):
    """The reduced gradient shards of the units handed to :meth:`add`, from their reduction to the
    optimizer step, in files under `folder` (See [Note: gradients on disk])."""

    PREFIX = "grads"

    def __init__(self, folder: Path, depth: int, scaler: LossScaler) -> None:
        """`scaler`: fp16's, whose scale the statistics divide out."""
        super().__init__(folder, depth)
        self.scaler = scaler
        self.units: list[FlatUnit] = []
        self._index: dict[int, int] = {}  # id(unit) -> its file
        self._gradients: list[torch.Tensor] = []  # each unit's shard (no storage while in its file)
        self.parked: list[bool] = []  # a gradient of this step is (or is queued to be) in the file
        self._writes: deque[tuple[Future, Callable[[], None]]] = deque()
        self.at_boundary = True  # the micro-batch being reduced is the step's last (the engine sets it)

    def add(self, unit: FlatUnit) -> None:
        """Take a unit whose reduced gradients are sharded (its master is its shard of them)."""
        self._index[id(unit)] = len(self.units)
        self.units.append(unit)
        gradient = torch.empty(unit.master.numel(), dtype=unit.grad_dtype)
        gradient.untyped_storage().resize_(0)
        self._gradients.append(gradient)
        self.parked.append(False)
        self._files.append(open_direct(self.folder / f"{self.PREFIX}-{len(self._files):04d}.bin"))

    def tensors(self, index: int) -> list[torch.Tensor]:
        return [self._gradients[index]]

    def park(self, unit: FlatUnit, shard: torch.Tensor, give_back: Callable[[], None]) -> None:
        """`unit`'s reduced `shard` of this micro-batch: added to what earlier micro-batches parked and
        written out by the I/O thread; `give_back()` (the shard's buffer to its pool) once written."""
        index = self._index[id(unit)]
        ready = None
        if shard.device.type == "cuda":  # the host copy, in stream order, waited for by the I/O thread
            host = torch.empty(shard.shape, dtype=shard.dtype, pin_memory=True)
            shard = host.copy_(shard, non_blocking=True)
            ready = torch.cuda.current_stream(unit.options.device).record_event()
            give_back()  # later kernels that reuse the device buffer run after the copy
            give_back = _nothing
        while len(self._writes) >= self.depth:  # at most depth shards wait, this one included
            self._finish_oldest()
        accumulate, self.parked[index] = self.parked[index], True
        scale = self.scaler.scale if self.scaler.enabled else None
        final = self.at_boundary  # the statistics of the step's sum only
        self._writes.append((self._io.submit(self._park, index, shard, accumulate, ready, scale, final), give_back))

    def _park(
        self,
        index: int,
        shard: torch.Tensor,
        accumulate: bool,
        ready: torch.cuda.Event | None,
        scale: float | None,
        final: bool,
    ) -> None:
        if ready is not None:
            ready.synchronize()
        if accumulate:  # the sum so far, read back, plus this micro-batch's
            self._read_in(index)
            shard = self._gradients[index].add_(shard)
        if final:
            unit = self.units[index]
            unit.known_statistics = unit_statistics(unit, shard, scale)
        try:
            write_at(self._files[index], bytes_of(shard), 0)
        except OSError as error:
            raise OSError(f"{error} to {self.folder}") from None
        self.bytes_written += shard.numel() * shard.element_size()
        self._free(index)

    def _finish_oldest(self) -> None:
        write, give_back = self._writes.popleft()
        write.result()
        give_back()

    def settle(self) -> None:
        """Every parked gradient is written (their buffers given back): before the step reads any."""
        while self._writes:
            self._finish_oldest()

    def taken(
        self, batches: Sequence[Sequence[int]], steps: Iterable[Sequence[int]], copies: dict[int, torch.Tensor]
    ) -> Iterator[Sequence[int]]:
        """`steps` (the optimizer's batches of unit indices, `batches`, as another ring yields them), each
        yielded once its parked gradients are read back and put in `copies` in their master's dtype (the
        step's gradients), no longer parked; each batch's are freed when the next is asked for.
        The main thread calls :meth:`settle` first; the step inside backward's worker need not (one I/O
        thread: the read comes after the write)."""
        wanted = [[k for k in batch if self.parked[k]] for batch in batches]
        gradients = self.streamed(wanted, write_back=False)
        for batch, mine in zip(steps, gradients, strict=True):  # strict: the last batch freed too
            for k in mine:
                master = self.units[k].master
                copies[k] = self._gradients[k].to(master.device, master.dtype)
                self.parked[k] = False
            yield batch

    def forget(self, unit: FlatUnit) -> None:
        """The step's end: forget `unit`'s gradient (that of a step skipped for overflow was never read)."""
        self.settle()
        index = self._index[id(unit)]
        self.parked[index] = False


def _nothing() -> None:
    """A buffer already given back."""
