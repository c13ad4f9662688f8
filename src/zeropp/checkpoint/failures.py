"""Why a checkpoint could not be written or read, in one line: the root cause of a (wrapped, multi-line)
error, and for a write the room it needed against the room there was."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor


def write_failure(error: BaseException, final: Path, state: dict[str, Any], world_size: int, previous: int) -> str:
    """'could not write checkpoint <final>: <reason>; it needs about N MiB in <dir> (F MiB free); the
    checkpoints already there are kept'. `previous`: the bytes of the latest checkpoint there (0: none)."""
    directory = final.parent
    needed, free = space_needed(state, world_size, directory, previous)
    why = reason(error)
    if free is not None and free < needed and why.startswith("RuntimeError"):
        why = "No space left on device"  # torch's zip writer reports a full disk as a short write
    shown = f" ({free / 2**20:,.1f} MiB free)" if free is not None else ""
    return (
        f"could not write checkpoint {str(final)!r}: {why}; it needs about {needed / 2**20:,.1f} MiB in "
        f"{str(directory)!r}{shown}; the checkpoints already there are kept"
    )


def space_needed(state: dict[str, Any], world_size: int, directory: Path, previous: int) -> tuple[float, int | None]:
    """Bytes a checkpoint needs in `directory` (the size of the latest there, or else the tensors':
    whole-shaped ones once, each rank's own, RNG states and qgZ residuals, once per rank) and the bytes
    free there (None where unknown)."""
    tensors = [t for t in state.values() if isinstance(t, torch.Tensor)]
    whole = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, DTensor))  # numel: the whole shape
    own = sum(t.numel() * t.element_size() for t in tensors if not isinstance(t, DTensor))
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        free = None
    return max(whole + own * world_size, previous), free


def reason(error: BaseException) -> str:
    """The root cause of a (possibly wrapped, multi-line) error, on one line."""
    causes = getattr(error, "failures", None)  # DCP's CheckpointException: {rank: exception or (exception, frames)}
    if causes:
        error = next(iter(causes.values()))
        if isinstance(error, tuple) and error and isinstance(error[0], BaseException):
            error = error[0]
        error = getattr(error, "exc", error) if not isinstance(error, BaseException) else error
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    text = str(error).strip().splitlines()
    rust_io = re.search(r'message: "([^"]+)"', text[0]) if text else None  # safetensors: IoError(Os {..})
    if rust_io:
        return rust_io.group(1)
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
