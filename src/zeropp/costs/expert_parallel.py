"""What expert parallelism sends: each mixture-of-experts layer's counts, dispatch and combine (See
[Note: expert dispatch]), with routing spread evenly over the experts (the real split is the router's)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from zeropp.comm.ledger import ring_bytes
from zeropp.costs.volume import Transfer
from zeropp.expert_parallel.dispatch import COUNTS_OP, LEDGER_OP

COUNT_BYTES = 8  # a token count per expert (int64)


@dataclass(frozen=True)
class MixtureOfExperts:
    """A model's mixture-of-experts layers as the costs see them."""

    layers: int
    experts: int
    top_k: int
    expert_parallel: int = 1


def dispatch_bytes(tokens: int, top_k: int, hidden: int, element_bytes: int, expert_parallel: int) -> int:
    """Bytes one rank sends in one all-to-all of one layer (its dispatch, or its combine, or either's
    backward): its tokens' top_k rows of `hidden` elements, all but the 1/E bound for its own experts."""
    return tokens * top_k * hidden * element_bytes * (expert_parallel - 1) // expert_parallel


def expert_transfers(
    moe: MixtureOfExperts, tokens: int, hidden: int, element_bytes: int, micro: int, recomputed: bool = False
) -> Iterator[Transfer]:
    """Every collective of one step's mixture-of-experts layers on one rank, `tokens` per micro-batch:
    per layer the counts' all-gather and two all-to-alls forward, two backward, and with activation
    checkpointing the forward's three again in backward (inside one node: the group is)."""
    ep = moe.expert_parallel
    if ep == 1:
        return
    counts = ring_bytes(moe.experts * COUNT_BYTES * ep, ep)
    rows = dispatch_bytes(tokens, moe.top_k, hidden, element_bytes, ep)
    for _ in range(micro * moe.layers):
        for phase, again in (("forward", False), ("backward", recomputed)):
            if phase == "forward" or again:
                yield Transfer(COUNTS_OP, phase, counts, 0.0)
                yield from (Transfer(LEDGER_OP, phase, rows, 0.0) for _ in range(2))
            if phase == "backward":
                yield from (Transfer(LEDGER_OP, phase, rows, 0.0) for _ in range(2))
