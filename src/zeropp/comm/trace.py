"""What this rank's collectives were: a running digest of every one issued, and the last few of them.

Every collective the :class:`~zeropp.comm.communicator.Communicator` issues (DTensor's observed ones
too) is one :class:`Entry`: its number on this rank, the optimizer step, the ledger's op and phase,
the unit it belongs to (set by whoever issues it: :meth:`CollectiveTrace.labelled`), the bytes of
its buffer (equal on every rank of a group when the ranks agree), when it started and completed.

The digest is a CRC-32 chained over the entries (op, unit, phase, bytes): ranks that issued the
same collectives in the same order hold the same digest, so comparing one number per rank at a
point where they synchronize anyway checks the whole sequence (:mod:`zeropp.comm.sequence`). Each
entry keeps the digest after it, so the first entry whose digests differ is the first difference.
The last ``keep`` entries stay in a ring: the flight recorder writes them to ``folder`` on a
timeout, an error or a signal (:meth:`CollectiveTrace.write`). See [Note: collective sequences].
"""

from __future__ import annotations

import contextlib
import json
import time
import zlib
from collections import deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

NO_UNIT = "-"  # collectives of no unit: the step's norms, the trainer's means, checkpoints


@dataclass
class Entry:
    seq: int  # its number among this rank's collectives on `group`
    group: str  # the group's role: world, data_parallel, intra_node, inter_node, ...
    step: int
    op: str
    unit: str
    phase: str
    bytes: int
    digest: int  # of the sequence up to and including this entry
    started: float
    completed: float | None = None

    def describe(self) -> str:
        unit = "no unit" if self.unit == NO_UNIT else f"unit {self.unit!r}"
        return f"{self.op} of {unit} ({self.phase}, {self.group}, {self.bytes:,} bytes)"


class CollectiveTrace:
    """This rank's running digest of collectives and a ring of the last `keep`."""

    def __init__(self, rank: int = 0, world_size: int = 1, keep: int = 256) -> None:
        self.rank, self.world_size = rank, world_size
        self.count = 0
        self.digests: dict[str, int] = {}  # per group: only a group's own order must agree across ranks
        self.counts: dict[str, int] = {}
        self.step = 0  # the engine's optimizer steps taken when the entry was issued
        self.unit = NO_UNIT
        self.ring: deque[Entry] = deque(maxlen=keep)
        self.folder: Path | None = None  # where write() puts this rank's record (None: nowhere)

    @contextlib.contextmanager
    def labelled(self, unit: str) -> Iterator[None]:
        """Collectives issued inside belong to `unit`."""
        previous, self.unit = self.unit, unit
        try:
            yield
        finally:
            self.unit = previous

    @property
    def digest(self) -> int:
        """Of every group's sequence (collectives on different groups may interleave differently)."""
        return zlib.crc32(json.dumps(sorted(self.digests.items())).encode())

    def issue(self, op: str, phase: str, nbytes: int, group: str = "world") -> Entry:
        """Record one collective as it starts (a few microseconds: one CRC of a short string)."""
        digest = zlib.crc32(f"{op}|{self.unit}|{phase}|{nbytes};".encode(), self.digests.get(group, 0))
        seq = self.counts.get(group, 0)
        self.digests[group], self.counts[group] = digest, seq + 1
        entry = Entry(seq, group, self.step, op, self.unit, phase, nbytes, digest, time.time())
        self.count += 1
        self.ring.append(entry)
        return entry

    def waiting(self) -> Entry | None:
        """The oldest entry of the ring not completed yet."""
        return next((e for e in self.ring if e.completed is None), None)

    def write(self, reason: str) -> Path | None:
        """This rank's record, ``flight-rank<r>.json`` in `folder`: the ring and why it was written."""
        if self.folder is None:
            return None
        path = self.folder / f"flight-rank{self.rank}.json"
        record = {"rank": self.rank, "reason": reason, "count": self.count, "step": self.step, "written": time.time()}
        record["entries"] = [asdict(e) for e in self.ring]
        with contextlib.suppress(OSError):  # a record is a courtesy: never the error itself
            self.folder.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(".partial")
            partial.write_text(json.dumps(record))
            partial.replace(path)
            return path
        return None


def read_records(folder: Path) -> dict[int, dict]:
    """Every rank's flight record in `folder`, by rank."""
    records = {}
    for path in sorted(folder.glob("flight-rank*.json")):
        with contextlib.suppress(OSError, ValueError):
            record = json.loads(path.read_text())
            record["entries"] = [Entry(**e) for e in record["entries"]]
            records[record["rank"]] = record
    return records
