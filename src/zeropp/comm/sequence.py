"""The ranks' collective sequences compared: live at a step's end, and from flight records after a failure.

Live (:func:`check_sequences`, called by the engine after the first optimizer step and every
``zero.sequence_check_interval`` after): one all-gather of (count, digest) per rank; where they
differ, the ranks' rings are gathered once and the first differing collective is named in one line
(:class:`SequenceMismatch`). After a collective timed out or failed (:func:`explain_failure`) the
network cannot be trusted: each rank writes its flight record (:mod:`zeropp.comm.trace`), reads the
others' from the same folder, and names the rank that is behind, or the first difference.
See [Note: collective sequences] (docs/design.md).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from zeropp.comm.trace import CollectiveTrace, Entry, read_records
from zeropp.errors import ZeroppError

if TYPE_CHECKING:
    from zeropp.comm.communicator import Communicator

CHECK_LABEL = "sequence.all_gather"  # the ledger's name of the check's own all-gather
RECORD_WAIT_S = 5.0  # how long a failed rank waits for the others' flight records


class SequenceMismatch(ZeroppError, RuntimeError):
    """The ranks issued different collectives (rank-dependent control flow). One line."""


def first_difference(rings: Mapping[int, list[Entry]]) -> tuple[int, dict[int, Entry | None]] | None:
    """The first collective (per group, the earliest started) at which the ranks' rings differ, and
    each rank's entry there (None: not issued); None where they agree on every one they share."""
    by_key = {rank: {(e.group, e.seq): e for e in ring} for rank, ring in rings.items()}
    found = []
    for key in sorted({k for entries in by_key.values() for k in entries}):
        here = {rank: entries.get(key) for rank, entries in by_key.items()}
        if len({e.digest for e in here.values() if e is not None}) > 1:
            found.append((min(e.started for e in here.values() if e is not None), key[1], here))
    if not found:
        return None
    _, seq, here = min(found, key=lambda f: f[0])
    return seq, here


def describe_difference(seq: int, here: Mapping[int, Entry | None]) -> str:
    """'collective #12 (step 1): rank 0 all_gather of unit 'a', rank 1 all_gather of unit 'b'', ranks alike grouped."""
    groups: dict[str, list[int]] = {}
    for rank, entry in sorted(here.items()):
        groups.setdefault("nothing (not issued yet)" if entry is None else entry.describe(), []).append(rank)
    step = next(e.step for e in here.values() if e is not None)
    parts = [f"{_ranks(ranks)} {what}" for what, ranks in groups.items()]
    group = next(e.group for e in here.values() if e is not None)
    return f"collective #{seq} on the {group} group (step {step + 1}): " + "; ".join(parts)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


# -- live ----------------------------------------------------------------------------------------


def check_sequences(comm: Communicator, step: int) -> None:
    """Compare every rank's digest (one small all-gather over the world); SequenceMismatch names the
    first differing collective and its units on each rank. Collective."""
    trace, world = comm.trace, comm.topology.world
    if world.size == 1:
        return
    mine = torch.tensor([trace.count, trace.digest], dtype=torch.int64)
    rows = _all_gather(comm, mine).view(world.size, 2).tolist()
    if len({tuple(r) for r in rows}) == 1:
        return
    ring = json.dumps([asdict(e) for e in trace.ring]).encode()
    sizes = _all_gather(comm, torch.tensor([len(ring)], dtype=torch.int64)).tolist()
    padded = torch.zeros(max(sizes), dtype=torch.uint8)
    padded[: len(ring)] = torch.frombuffer(bytearray(ring), dtype=torch.uint8)
    gathered = _all_gather(comm, padded).view(world.size, -1)
    rings = {
        world.ranks[i]: [Entry(**e) for e in json.loads(bytes(gathered[i, :n].tolist()).decode())]
        for i, n in enumerate(sizes)
    }
    found = first_difference(rings)
    where = describe_difference(*found) if found else f"before the last {trace.ring.maxlen} collectives of each rank"
    raise SequenceMismatch(
        f"zeropp: the ranks issued different collectives by step {step}, first at {where}; "
        "the model's control flow depends on the rank (every rank must run the same units in the same order)"
    )


def _all_gather(comm: Communicator, local: torch.Tensor) -> torch.Tensor:
    world, device = comm.topology.world, comm.topology.device
    local = local.to(device)
    out = torch.empty(world.size * local.numel(), dtype=local.dtype, device=device)
    with comm.ledger.in_phase("other"):
        comm.all_gather(out, local, world, bucket_numel=out.numel(), label=CHECK_LABEL)
    return out.cpu()


# -- after a failure -----------------------------------------------------------------------------


def explain_failure(trace: CollectiveTrace, world_size: int, failed: Entry | None, reason: str) -> str:
    """Write this rank's flight record, wait a little for the others', and say in one clause which
    rank is behind at which unit and op, or where the sequences first differ."""
    if trace.write(reason) is None:
        return f"this rank waited in {_at(failed)}" if failed else ""
    folder = trace.folder
    deadline = time.monotonic() + RECORD_WAIT_S
    records = read_records(folder)
    while len(records) < world_size and time.monotonic() < deadline:
        time.sleep(0.2)
        records = read_records(folder)
    return summarize(records, world_size, folder)


def summarize(records: Mapping[int, dict], world_size: int, folder: Path) -> str:
    """One clause from every rank's flight record: the first difference, or the rank behind."""
    where = f"flight records in {str(folder)!r}"
    rings = {rank: r["entries"] for rank, r in records.items()}
    found = first_difference(rings)
    if found is not None:
        return f"the ranks issued different collectives, first at {describe_difference(*found)} ({where})"
    silent = [r for r in range(world_size) if r not in records]
    waiting = {rank: _waiting(r) for rank, r in records.items()}
    if silent:
        others = "; ".join(f"rank {r} waits in {_at(e)}" for r, e in sorted(waiting.items()) if e is not None)
        return f"{_ranks(silent)} behind (no flight record: stopped or dead); {others} ({where})"
    counts = {rank: r["count"] for rank, r in records.items()}
    behind = min(counts, key=lambda rank: (counts[rank], rank))
    entry = waiting[behind] or (rings[behind][-1] if rings[behind] else None)
    return f"rank {behind} is behind, at {_at(entry)} ({where})"


def _waiting(record: dict) -> Entry | None:
    return next((e for e in record["entries"] if e.completed is None), None)


def _at(entry: Entry | None) -> str:
    if entry is None:
        return "no collective"
    return f"collective #{entry.seq} on the {entry.group} group (step {entry.step + 1}): {entry.describe()}"
