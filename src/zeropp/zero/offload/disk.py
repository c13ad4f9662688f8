"""ZeRO-Infinity's disk tier for the optimizer: each rank's fp32 master shards and optimizer states
live in files, and the optimizer step streams them through host memory unit by unit. The files, the
swaps and the I/O thread are :class:`DiskFiles`, which the parameters' disk tier
(:mod:`zeropp.zero.offload.disk_params`) shares.

A unit's states are one file, ``unit-NNNN.bin`` in the rank's folder: its master, then each
per-element optimizer state (Adam's ``exp_avg``, ``exp_avg_sq``) in key order. Swapped out, the
tensors keep their identity (the optimizer's state is keyed by the master parameter) and shape, but
their storage is resized to nothing; swapped in, the storage is allocated again and read back. The
scalar states (Adam's ``step``) stay in memory.

The ring that bounds host memory and overlaps the I/O: see [Note: the disk tier's ring] (docs/design.md).

The files are read and written with direct I/O (``O_DIRECT``), so their pages never enter the page
cache: a memory limit (a cgroup's ``memory.max``) is charged for the ring, not for the files. Direct
I/O needs page-aligned buffers, offsets and lengths, so every tensor starts at a multiple of 4 KiB
of its file, and the bytes travel through a page-aligned staging buffer of 4 MiB per thread (copied
to and from the tensor's own storage, which torch aligns to 64 bytes only). A file system that
refuses ``O_DIRECT`` gets buffered files instead, said once in one line.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import shutil
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from zeropp.errors import ConfigError
from zeropp.zero.optim.stepping import steps_unit_by_unit

if TYPE_CHECKING:
    from zeropp.zero.offload.disk_gradients import GradientFiles
    from zeropp.zero.unit import FlatUnit

ALIGN = 4096  # direct I/O's alignment of buffers, offsets and lengths (the page size)
STAGING_BYTES = 4 << 20  # the page-aligned buffer each I/O thread copies through
_staging = threading.local()
_buffered_note: set[str] = set()  # file systems already said to refuse direct I/O


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _staging_buffer() -> mmap.mmap:
    """This thread's staging buffer: an anonymous mapping (page-aligned), private (mmap's default is
    shared: a process forked after this thread made one would write into the same pages)."""
    if getattr(_staging, "buffer", None) is None:
        _staging.buffer = mmap.mmap(-1, STAGING_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return _staging.buffer


def open_direct(path: Path) -> int:
    """`path` opened for direct I/O, or buffered (with a one-line note, once per folder) where the file
    system refuses it."""
    flags = os.O_RDWR | os.O_CREAT
    direct = getattr(os, "O_DIRECT", 0)
    try:
        return os.open(path, flags | direct, 0o600)
    except OSError as error:
        if not direct or error.errno != errno.EINVAL:
            raise
    if str(path.parent) not in _buffered_note:
        _buffered_note.add(str(path.parent))
        print(f"zeropp: {path.parent} does not take direct I/O (O_DIRECT): the offload files go through the page cache")
    return os.open(path, flags, 0o600)


def write_at(fd: int, data: memoryview, offset: int) -> None:
    """`data` into file `fd` at `offset` (a multiple of ALIGN) through the staging buffer, its last
    block padded with zeros to ALIGN."""
    staging, done = _staging_buffer(), 0
    while done < len(data):
        n = min(STAGING_BYTES, len(data) - done)
        staging[:n] = data[done : done + n]
        padded = _aligned(n)
        staging[n:padded] = bytes(padded - n)
        written = os.pwritev(fd, [memoryview(staging)[:padded]], offset + done)
        if written != padded:
            raise OSError(f"wrote {written} of {padded} bytes")
        done += n


def read_at(fd: int, data: memoryview, offset: int) -> None:
    """Fill `data` from file `fd` at `offset` (a multiple of ALIGN) through the staging buffer."""
    staging, done = _staging_buffer(), 0
    while done < len(data):
        n = min(STAGING_BYTES, len(data) - done)
        read = os.preadv(fd, [memoryview(staging)[: _aligned(n)]], offset + done)
        if read < n:
            raise OSError(f"read {read} of {n} bytes (a damaged offload file)")
        data[done : done + n] = staging[:n]
        done += n


class DiskFiles:
    """Tensors kept in files, one file per unit (``PREFIX-NNNN.bin`` in `folder`), swapped in and out
    with their storage resized (their identity and shape never change), by one I/O thread: the
    machinery both disk tiers share. What a unit's file holds is the subclass's :meth:`tensors`."""

    PREFIX = "unit"

    def __init__(self, folder: Path, depth: int) -> None:
        self.folder = folder
        self.depth = depth
        self.bytes_read = 0  # once counting: the steps', checkpoints' and state dicts' I/O
        self.bytes_written = 0
        self.counting = False  # construction's writes aside
        self._files: list[int] = []
        self._resident_depth = 0  # nested resident() blocks
        self._changed = False
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zeropp-disk")

    def tensors(self, index: int) -> list[torch.Tensor]:
        raise NotImplementedError

    def _open(self) -> None:
        """The next unit's file, written out at once (its memory freed)."""
        path = self.folder / f"{self.PREFIX}-{len(self._files):04d}.bin"
        self._files.append(open_direct(path))
        self._write_out(len(self._files) - 1)

    def _write_out(self, index: int) -> None:
        """Write the unit's states to its file and free their memory. The byte counts are the tensors'
        (each one's padding to ALIGN, under 4 KiB, is not counted)."""
        offset, payload = 0, 0
        for tensor in self.tensors(index):
            buffer = bytes_of(tensor)
            try:
                write_at(self._files[index], buffer, offset)
            except OSError as error:
                raise OSError(f"{error} to {self.folder}") from None
            offset, payload = offset + _aligned(len(buffer)), payload + len(buffer)
            tensor.untyped_storage().resize_(0)
        self.bytes_written += payload if self.counting else 0

    def _read_in(self, index: int) -> None:
        offset, payload = 0, 0
        for tensor in self.tensors(index):
            tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())
            buffer = bytes_of(tensor)
            try:
                read_at(self._files[index], buffer, offset)
            except OSError as error:
                raise OSError(f"{error} from {self.folder}") from None
            offset, payload = offset + _aligned(len(buffer)), payload + len(buffer)
        self.bytes_read += payload

    def _free(self, index: int) -> None:
        for tensor in self.tensors(index):
            tensor.untyped_storage().resize_(0)

    def in_memory(self, index: int) -> bool:
        return all(t.untyped_storage().nbytes() > 0 for t in self.tensors(index))

    def streamed(self, batches: Sequence[Sequence[int]], write_back: bool = True) -> Iterator[Sequence[int]]:
        """Yield each batch of unit indices once its states are in memory; write it back (and free
        it; only free it where not `write_back`) when the caller asks for the next one. A caller that
        stops early (closes the generator) leaves the batch it holds and those read ahead freed, not
        written back: their files keep the states before it. See [Note: the disk tier's ring]."""
        reads: dict[int, Future] = {}

        def read_ahead(position: int) -> None:
            if position < len(batches):
                reads[position] = self._io.submit(lambda: [self._read_in(i) for i in batches[position]])

        for position in range(self.depth):
            read_ahead(position)
        writes: list[Future] = []
        held: Sequence[int] = ()  # the batch the caller holds
        try:
            for position, batch in enumerate(batches):
                reads.pop(position).result()
                held = batch
                yield batch
                held = ()
                done = self._write_out if write_back else self._free
                writes.append(self._io.submit(lambda batch=batch, done=done: [done(i) for i in batch]))
                read_ahead(position + self.depth)
        finally:  # the writes waited for (their errors raised), what the caller stopped before freed
            unused = [*held, *(i for position in reads for i in batches[position])]
            writes.append(self._io.submit(lambda: [self._free(i) for i in unused]))
            for write in writes:
                write.result()

    @contextlib.contextmanager
    def resident(self, changes: bool = False) -> Iterator[None]:
        """Every unit's states in memory for the block (checkpoints, state dicts: host memory of the
        whole shard's states); at the exit of the outermost block written back where any block
        said `changes`, else only freed. Tensors taken from them must not outlive the block."""
        outermost = self._resident_depth == 0
        if outermost:
            self._io.submit(lambda: None).result()  # what the I/O thread still had to write is written
            for index in range(len(self._files)):
                if not self.in_memory(index):
                    self._read_in(index)
        self._resident_depth += 1
        self._changed |= changes
        try:
            yield
        finally:
            self._resident_depth -= 1
            if outermost:
                for index in range(len(self._files)):
                    if self._changed:
                        self._write_out(index)
                    else:
                        self._free(index)
                self._changed = False

    @property
    def is_resident(self) -> bool:
        return self._resident_depth > 0

    def close(self) -> None:
        """Remove the files, and the rank's folder once empty (a clean exit; a crashed run's folder is
        cleared by the next start)."""
        self._io.shutdown(wait=True)
        for index, fd in enumerate(self._files):
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.folder / f"{self.PREFIX}-{index:04d}.bin")
        self._files = []
        with contextlib.suppress(OSError):
            self.folder.rmdir()


class DiskTier(DiskFiles):
    """The masters (one per unit, each handed to :meth:`add` as its unit is built and written out at
    once) and their optimizer states (once :attr:`optimizer` is set), kept in files under `folder`."""

    def __init__(self, folder: Path, depth: int) -> None:
        super().__init__(folder, depth)
        self.masters: list[nn.Parameter] = []
        self.optimizer: torch.optim.Optimizer | None = None
        self.gradients: GradientFiles | None = None  # the reduced gradients' files (stages 2-3)

    def add(self, master: nn.Parameter, unit: FlatUnit | None = None) -> None:
        """Take a unit's master (before the optimizer is built on it): written out, its memory freed;
        the `unit`'s reduced gradients go to :attr:`gradients` where it holds them (See [Note:
        gradients on disk])."""
        self.masters.append(master)
        self._open()
        if unit is not None and self.gradients is not None:
            self.gradients.add(unit)
            unit.gradient_files = self.gradients

    def close(self) -> None:
        if self.gradients is not None:
            self.gradients.close()
        super().close()

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer built on the masters; its per-element states join them in the files."""
        if not steps_unit_by_unit(optimizer):
            raise ConfigError(
                f"zero.offload_optimizer = 'nvme' streams the optimizer unit by unit, which "
                f"{type(optimizer).__name__} may not allow; expected one of torch's per-parameter optimizers "
                "(SGD, Adam, AdamW, ...)"
            )
        self.optimizer = optimizer
        self.counting = True

    def tensors(self, index: int) -> list[torch.Tensor]:
        """The unit's master, then its per-element optimizer states in key order."""
        master = self.masters[index]
        state = self.optimizer.state.get(master, {}) if self.optimizer is not None else {}
        per_element = [state[k] for k in sorted(state) if isinstance(state[k], torch.Tensor) and state[k].dim() > 0]
        return [master.data, *per_element]


def bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable in place, for as long as the tensor lives (not
    through ``numpy()``, which would make its storage impossible to resize, hence to free)."""
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
HOST_MMAP_THRESHOLD = 1 << 20


def fix_mmap_threshold() -> None:
    """Have glibc map every host allocation of 1 MiB or more and unmap it when freed, for the rest of the
    process. The disk tiers allocate and free unit-sized buffers all through a step; by default glibc
    raises its mmap threshold (up to 32 MiB) after the first such free and serves later buffers from
    its heap, which keeps their memory resident once freed: the process then holds much more than the
    rings (a 0.2B GPT with both tiers, bf16, one rank: a step's peak resident set 1.78 GB by default,
    0.98 GB with the threshold fixed). A no-op where the C library has no ``mallopt``."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, HOST_MMAP_THRESHOLD)


def rank_folder(path: str, rank: int) -> Path:
    """This rank's scratch folder under `path` (checked by the config), emptied of what a crashed run
    left there."""
    folder = Path(path).expanduser() / "zeropp-offload" / f"rank-{rank}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return folder


def check_free_space(folder: Path, needed: int, what: str) -> None:
    """One line before any unit is built when the offload folder cannot hold this rank's `what`."""
    free = shutil.disk_usage(folder).free
    if free < needed:
        raise ConfigError(
            f"zero.offload_path: {folder} has {free / 2**30:.2f} GiB free, this rank's {what} need "
            f"{needed / 2**30:.2f} GiB",
            "zero.offload_path",
            str(folder),
        )
