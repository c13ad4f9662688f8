"""One run of ``zeropp train`` per checkpoint folder: an exclusive lock on
``<checkpoint_dir>/.zeropp.lock`` for the run's lifetime.

Two runs writing one folder would delete each other's in-progress saves and prune each other's
checkpoints. ``zeropp train``'s launcher (node rank 0) takes the lock before any rank starts and
holds it across restarts; its ranks see :data:`ENV` and take nothing. ``zeropp train`` started by
torchrun directly takes it in rank 0. (The library's ``save_checkpoint`` takes no lock.) The lock is an ``fcntl.flock``, which the kernel drops when its
process dies, so a dead run's lock file is simply taken over; the file says who holds it (host,
pid, port, start time), for the refusal's message.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from zeropp.checkpoint.dcp import CheckpointError

LOCK_NAME = ".zeropp.lock"
ENV = "ZEROPP_CHECKPOINT_LOCK"  # the folder whose lock the launcher holds for its ranks

_held: dict[str, int] = {}  # folder -> open file descriptor of its lock, for this process's lifetime


def hold_for_ranks(directory: str | Path, port: int, node_rank: int) -> None:
    """The launcher's part: node rank 0's launcher takes the lock; every launcher tells its ranks
    (whichever node global rank 0 lands on) that their run holds it."""
    if node_rank == 0:
        hold(directory, port)
    os.environ[ENV] = str(Path(directory).resolve())


def hold(directory: str | Path, port: int | str | None = None) -> None:
    """Take `directory`'s lock until this process exits (a no-op if this process or its launcher holds
    it); refuse in one line, naming the holder, if another run has it."""
    directory = Path(directory)
    key = str(directory.resolve())
    if key in _held or os.environ.get(ENV) == key:
        return
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:
        raise CheckpointError(f"checkpoint directory {str(directory)!r} is not writable ({error.strerror})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _describe(os.pread(fd, 4096, 0))
        os.close(fd)
        raise CheckpointError(
            f"checkpoint directory {str(directory)!r} is in use by another run ({holder}); "
            "wait for it to end or choose another --checkpoint-dir"
        ) from None
    record = {"host": socket.gethostname(), "pid": os.getpid(), "port": port, "started": time.strftime("%F %T")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)
    _held[key] = fd


def _describe(raw: bytes) -> str:
    try:
        r = json.loads(raw)
        return f"host {r['host']}, pid {r['pid']}, port {r['port']}, since {r['started']}"
    except (ValueError, KeyError, TypeError):
        return "holder unknown"
