"""What Ulysses context parallelism sends: the all-to-alls of attention (See [Note: Ulysses attention])."""

from __future__ import annotations

from zeropp.context_parallel.ulysses import LEDGER_OP

__all__ = ["LEDGER_OP", "ulysses_bytes"]


def ulysses_bytes(
    rows: int, length: int, heads: int, kv_heads: int, head_size: int, cp: int, element_bytes: int
) -> int:
    """Bytes one rank sends per attention layer and micro-batch, in one direction (forward; backward
    sends the same): queries, keys, values and the output of its (rows x length/cp) slice, each but
    the 1/cp it keeps. `heads`, `kv_heads`: this rank's (a tensor-parallel rank's share). Keys and
    values travel at their own head count where cp divides it, else repeated to one per query head."""
    if cp == 1:
        return 0
    kv_heads = kv_heads if kv_heads % cp == 0 else heads
    per_head = rows * (length // cp) * head_size * element_bytes * (cp - 1) // cp
    return per_head * (2 * heads + 2 * kv_heads)
