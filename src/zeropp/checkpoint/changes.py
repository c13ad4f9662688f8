"""What differs between a checkpoint and the run loading it, each said in one line.

Resharding is a feature (any stage, world size, node count, tensor- or context-parallel size or precision
loads any checkpoint of the same model), but it should not pass unsaid; and the optimizer
settings the run was configured with win over the checkpoint's unless the caller asks for the
checkpoint's (``load_checkpoint(..., optimizer_settings="checkpoint")``), with the difference named.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

MESH = {  # zeropp.json key -> how it is said
    "stage": "stage",
    "world_size": "world size",
    "nodes": "nodes",
    "tensor_parallel_size": "tensor parallel",
    "context_parallel_size": "context parallel",  # the shards do not depend on it; the rows each rank reads do
    "precision": "precision",
}


def resharding_line(saved: Mapping[str, Any], here: Mapping[str, Any], path: str | Path) -> str | None:
    """'zeropp: resharding checkpoint ... saved at stage 1, world size 4 for this run's stage 3, world size 2',
    naming only what differs; None where nothing does."""
    changed = [key for key in MESH if key in saved and saved[key] != here[key]]
    if not changed:
        return None
    then = ", ".join(f"{MESH[k]} {saved[k]}" for k in changed)
    now = ", ".join(f"{MESH[k]} {here[k]}" for k in changed)
    return f"zeropp: resharding checkpoint {str(path)!r}, saved at {then}, for this run's {now}"


def optimizer_differences(groups: Sequence[Mapping[str, Any]], saved: Sequence[Mapping[str, Any]]) -> list[str]:
    """'weight_decay = 0.05 (the checkpoint has 0.1)' for each setting of the first group that differs
    (a setting differing only in a later group is named with its group)."""
    said: list[str] = []
    for index, (group, stored) in enumerate(zip(groups, saved, strict=True)):
        where = f" in group {index}" if index else ""
        for key in sorted(stored.keys() & group.keys() - {"params"}):
            ours, theirs = group[key], stored[key]
            if _plain(ours) != _plain(theirs):
                said.append(f"{key}{where} = {ours!r} (the checkpoint has {_as(theirs, ours)!r})")
    return said


def taking(group: dict[str, Any], stored: Mapping[str, Any]) -> None:
    """Set `group`'s settings to the checkpoint's (tuples stay tuples)."""
    for key, value in stored.items():
        group[key] = _as(value, group.get(key))


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _as(value: Any, like: Any) -> Any:
    return tuple(value) if isinstance(like, tuple) and isinstance(value, list) else value
