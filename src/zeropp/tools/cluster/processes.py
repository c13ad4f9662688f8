"""The processes a cluster starts: finding them by their marker, stopping them, copying their output."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import IO

MARKER_ENV = "ZEROPP_CLUSTER_RUN"  # set in every process the cluster starts (cleanup finds strays by it)


def marked_pids(marker: str) -> list[int]:
    """Processes whose environment carries MARKER_ENV=marker (what this run started, wherever it is now)."""
    needle = f"{MARKER_ENV}={marker}".encode() + b"\0"
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read() + b"\0":
                    found.append(int(entry))
        except OSError:
            continue
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):  # a zombie is gone for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    return True


def kill(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def wait_gone(pids: Sequence[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    left = [p for p in pids if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if alive(p)]
    return left


class Pump(threading.Thread):
    """Copies a node's output to its log file (and optionally to a stream), keeping the tail."""

    def __init__(self, source: IO[bytes], log: Path, echo: IO[str] | None, tail_lines: int = 200) -> None:
        super().__init__(daemon=True)
        self.source, self.log, self.echo = source, log, echo
        self.tail: deque[str] = deque(maxlen=tail_lines)

    def run(self) -> None:
        with open(self.log, "w", encoding="utf-8", errors="replace") as log:
            for raw in iter(self.source.readline, b""):
                line = raw.decode("utf-8", errors="replace")
                log.write(line)
                log.flush()
                self.tail.append(line.rstrip("\n"))
                if self.echo is not None:
                    with contextlib.suppress(ValueError, OSError):
                        self.echo.write(line)
                        self.echo.flush()


def exit_status(code: int | None) -> int:
    """A shell's view of a child's exit: 128 + N for death by signal N."""
    if code is None:
        return 128 + signal.SIGKILL
    return 128 - code if code < 0 else code
