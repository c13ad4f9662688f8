"""What Ulysses context parallelism sends: the all-to-alls of attention (See [Note: Ulysses attention])."""

from __future__ import annotations

from collections.abc import Iterator

from zeropp.costs.memory import Activations
from zeropp.costs.volume import Transfer

LEDGER_OP = "cp.all_to_all"


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


def ulysses_transfers(activations: Activations, tp: int, element_bytes: int, micro: int) -> Iterator[Transfer]:
    """Every all-to-all of one step's attention layers, as multi-head attention over the hidden width
    (a tensor-parallel rank's 1/tp of it): per block and micro-batch, q, k, v and the output forward,
    their gradients backward, and with activation checkpointing the forward's four again in backward
    (the recomputation); inside one node (the context-parallel group is)."""
    cp = activations.context_parallel
    if cp == 1:
        return
    width = activations.hidden // tp
    per_tensor = ulysses_bytes(activations.batch, activations.seq, 1, 1, width, cp, element_bytes) // 4
    backward = 8 if activations.activation_checkpointing else 4
    for _ in range(micro * activations.layers):
        for phase, calls in (("forward", 4), ("backward", backward)):
            for _ in range(calls):
                yield Transfer(LEDGER_OP, phase, per_tensor, 0.0)
