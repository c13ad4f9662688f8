"""The communication ledger: bytes each rank sends, by op, by phase, intra- vs inter-node.

Byte model (per calling rank; B = bytes of the full buffer, n = group size):

- all-gather / reduce-scatter (ring): a rank sends n-1 chunks of B/n to its ring successor,
  the next rank of the group. Sent = (n-1)/n * B. It counts as inter-node when that successor
  is on another node. The average over ranks of the inter-node share is therefore
  (#ring edges that cross nodes) / n: 1/2 for 2 nodes x 2 ranks.
- all-reduce (ring): a reduce-scatter followed by an all-gather, 2 (n-1)/n * B, same successor.
- broadcast (pipelined ring): every rank forwards the whole buffer B to its successor, except
  the rank whose successor is the source.
- all-to-all (pairwise): a rank sends the j-th of n equal chunks, B/n, straight to group rank j;
  sent = (n-1)/n * B, each chunk intra- or inter-node by where its peer lives.

Quantized collectives (qwZ, qgZ) are these same operations on int8/int4 data plus fp32 scales;
the ledger counts both.

These are what NCCL's ring algorithms put on the wire per rank. gloo differs in two places,
measured on the emulated cluster (docs/cluster.md): its reduce-scatter runs as an all-reduce and
sends twice the ring figure, and its broadcast is a tree. The ledger keeps the algorithm's
figures (the same on every backend); ``zeropp cluster`` prints them next to the wire counters.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

PHASES = ("forward", "backward", "step", "eval", "other")
PA_GATHER = "pa.all_gather"  # the ledger's name of Pa's all-gather (on the tensor-parallel group)


@dataclass
class Ledger:
    """Accumulates bytes sent by this rank. Keys: (op, phase, 'intra' | 'inter')."""

    bytes: dict[tuple[str, str, str], int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    phase: str = "other"
    steps: int = 0

    @contextlib.contextmanager
    def in_phase(self, phase: str) -> Iterator[None]:
        assert phase in PHASES, phase
        previous, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = previous

    def record(self, op: str, intra: int, inter: int) -> None:
        self.calls[(op, self.phase)] += 1
        if intra:
            self.bytes[(op, self.phase, "intra")] += intra
        if inter:
            self.bytes[(op, self.phase, "inter")] += inter

    def total(self, *, op: str | None = None, phase: str | None = None, link: str | None = None) -> int:
        return sum(
            b
            for (o, p, k), b in self.bytes.items()
            if (op is None or o == op) and (phase is None or p == phase) and (link is None or k == link)
        )

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()
        self.steps = 0

    def as_dict(self) -> dict[str, dict[str, dict[str, int]]]:
        """{op: {phase: {'intra': bytes, 'inter': bytes}}} with every recorded combination."""
        out: dict[str, dict[str, dict[str, int]]] = {}
        for (op, phase, link), b in sorted(self.bytes.items()):
            out.setdefault(op, {}).setdefault(phase, {"intra": 0, "inter": 0})[link] += b
        return out


def bytes_under(ledger: dict[str, dict[str, dict[str, float]]], prefix: str) -> float:
    """Bytes of the ops of a ledger's :meth:`Ledger.as_dict` named ``prefix.*`` (``tp``, ``cp``, ``pa``),
    every phase and link."""
    return sum(
        sum(links.values()) for op, phases in ledger.items() if op.startswith(f"{prefix}.") for links in phases.values()
    )


def ring_bytes(buffer_bytes: int, group_size: int, passes: int = 1) -> int:
    """Bytes one rank sends in `passes` ring passes (all-gather / reduce-scatter: 1, all-reduce: 2)."""
    return passes * buffer_bytes * (group_size - 1) // group_size
