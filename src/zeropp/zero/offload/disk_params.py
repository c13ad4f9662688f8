"""ZeRO-Infinity's disk tier for the parameters (``offload_params = "nvme"``, stage 3): each sharded
unit's compute-dtype shard lives in a file, read ahead of its gather along the recorded execution
order and written back after the optimizer step, through the same files, swaps and I/O thread as the
optimizer's disk tier (:class:`zeropp.zero.offload.disk.DiskFiles`).

A shard is in host memory from its read until its gather has completed: the runtime calls
:meth:`ParamFiles.fetch` before a unit's gather starts, :meth:`ParamFiles.release` once it is waited
for, and :meth:`ParamFiles.read_ahead` with the units recorded after it. See [Note: the disk tier's
ring] (docs/design.md) for the bound and the bytes a step moves.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path

import torch
from torch import nn

from zeropp.config.sections import ZeroConfig
from zeropp.zero.offload.disk import DiskFiles, DiskTier, check_free_space, fix_mmap_threshold, rank_folder
from zeropp.zero.offload.disk_gradients import GradientFiles
from zeropp.zero.precision import DTYPES, LossScaler
from zeropp.zero.unit import FlatUnit
from zeropp.zero.unit_states import ShardState


class ParamFiles(DiskFiles):
    """The compute-dtype shards of the sharded units handed to :meth:`add`, in files under `folder`;
    `depth` units' writes after the step and ``max(depth, prefetch)`` units' reads ahead of the
    gathers at most."""

    PREFIX = "params"

    def __init__(self, folder: Path, depth: int, prefetch: int) -> None:
        super().__init__(folder, depth)
        self.window = max(depth, prefetch)  # units read ahead: every unit prefetch gathers, at least
        self.units: list[FlatUnit] = []
        self._index: dict[int, int] = {}  # id(unit) -> its file
        self._reads: dict[int, Future] = {}
        self._writes: deque[Future] = deque()

    def add(self, unit: FlatUnit) -> None:
        """Take a unit as it is built: its shard written out, its memory freed (a resident unit keeps
        its weights gathered on the device: nothing to take)."""
        if unit.compute_shard is None or unit.compute_shard.numel() == 0:
            return
        self._index[id(unit)] = len(self.units)
        self.units.append(unit)
        self.counting = False
        self._open()
        self.counting = True

    def tensors(self, index: int) -> list[torch.Tensor]:
        return [self.units[index].compute_shard]

    def _gathers_shard(self, unit: FlatUnit) -> int | None:
        """The file of `unit` when its next gather reads the shard (not hpZ's copy), else None."""
        index = self._index.get(id(unit))
        sharded = unit.shard_state is ShardState.SHARDED and not unit.secondary_valid
        return index if sharded else None

    def fetch(self, unit: FlatUnit) -> None:
        """Before `unit`'s gather starts: its shard in memory (read ahead, or read now)."""
        index = self._gathers_shard(unit)
        if index is None:
            return
        read = self._reads.pop(index, None)
        if read is not None:
            read.result()
        if not self.in_memory(index):  # through the I/O thread: after any write of it still queued
            self._io.submit(self._read_in, index).result()

    def read_ahead(self, units: Sequence[FlatUnit]) -> None:
        """Start reading the shards of `units` (those the next gathers will read) on the I/O thread."""
        for unit in units:
            index = self._gathers_shard(unit)
            if index is not None and index not in self._reads and not self.in_memory(index):
                self._reads[index] = self._io.submit(self._read_in, index)

    def release(self, unit: FlatUnit) -> None:
        """`unit`'s gather has completed: its shard's memory is freed (the file holds it)."""
        index = self._index.get(id(unit))
        if index is not None and index not in self._reads and not self.is_resident:
            unit.compute_shard.untyped_storage().resize_(0)

    def publish(self, unit: FlatUnit) -> None:
        """After `unit`'s optimizer step: its new weights into the shard (allocated for them, nothing
        read), then written back and freed by the I/O thread; at most `depth` writes queued."""
        index = self._index.get(id(unit))
        if index is None or self.is_resident:
            unit.publish_master()
            return
        read = self._reads.pop(index, None)
        if read is not None:  # read ahead for a gather that did not come: overwritten below
            read.result()
        shard = unit.compute_shard
        shard.untyped_storage().resize_(shard.numel() * shard.element_size())
        unit.publish_master()
        self._writes.append(self._io.submit(self._write_out, index))
        while len(self._writes) > self.depth:
            self._writes.popleft().result()

    def flush(self) -> None:
        """Every write :meth:`publish` queued is done (the step's end)."""
        while self._writes:
            self._writes.popleft().result()


def disk_tiers_for(
    config: ZeroConfig, rank: int, model: nn.Module, shard_ranks: int, scaler: LossScaler
) -> tuple[DiskTier | None, ParamFiles | None]:
    """The optimizer's disk tier where ``zero.offload_optimizer`` is "nvme" (at stages 2-3 with its
    gradients' files), the parameters' where ``zero.offload_params`` is (None otherwise), in one folder
    per rank checked for room before any unit is built: `shard_ranks` share the optimizer state, the
    gradients and the parameters (stage 3); `scaler`: fp16's, whose scale the gradients' statistics divide out."""
    offload = config.offload
    optimizer, params = offload.optimizer == "nvme", offload.params == "nvme"
    compute_bytes = DTYPES[config.precision].itemsize
    if not (optimizer or params):
        return None, None
    folder = rank_folder(offload.path, rank)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    gradients = optimizer and config.stage >= 2  # sharded: See [Note: gradients on disk]
    grad_bytes = DTYPES[config.grad_dtype or config.precision].itemsize
    needed = {
        "optimizer states": 12 if optimizer else 0,
        "gradients": grad_bytes if gradients else 0,
        "parameters": compute_bytes if params else 0,
    }
    what = " and ".join(name for name, per_param in needed.items() if per_param)
    check_free_space(folder, sum(needed.values()) * trainable // shard_ranks, what)
    fix_mmap_threshold()
    depth = offload.buffer_count
    disk = DiskTier(folder, depth) if optimizer else None
    if gradients:
        disk.gradients = GradientFiles(folder, depth, scaler)
    return disk, (ParamFiles(folder, depth, config.prefetch) if params else None)


def resident(disk: DiskTier | None, params: ParamFiles | None, changes: bool) -> contextlib.ExitStack:
    """The optimizer tier's states in memory for the block; the parameters' shards too where the block
    `changes` the weights (a load: the masters' new values are published into them)."""
    stack = contextlib.ExitStack()
    for tier in (disk, params if changes else None):
        if tier is not None:
            stack.enter_context(tier.resident(changes))
    return stack


def io_bytes(*tiers: DiskFiles | None) -> tuple[int, int]:
    """(read, written) bytes of the disk tiers given (None: absent) and the optimizer tier's gradients,
    since their construction."""
    present = [tier for tier in tiers if tier is not None]
    present += [tier.gradients for tier in present if isinstance(tier, DiskTier) and tier.gradients is not None]
    return sum(t.bytes_read for t in present), sum(t.bytes_written for t in present)
