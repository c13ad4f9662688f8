"""Bytes per optimizer step that plain ZeRO would record in the ledger, computed without running it.

The baseline ZeRO++ is measured against (``zeropp train`` prints it beside the ledger). Per rank,
averaged over ranks, with the ledger's ring model (comm/ledger.py): a collective over the world
sends ``(W-1)/W * B`` per rank, and a rank's bytes cross nodes when its ring successor is on
another node, which holds for ``nodes`` of the W ranks (none on one node).
"""

from __future__ import annotations

from collections.abc import Iterable

from zeropp.comm.ledger import ring_bytes
from zeropp.topology import Layout


def zero3_step_bytes(
    units: Iterable[tuple[int, bool]],
    layout: Layout,
    *,
    compute_bytes: int,
    grad_bytes: int,
    accumulation: int = 1,
) -> dict[str, dict[str, float]]:
    """{phase: {'intra', 'inter'}} for ZeRO-3 over units given as (padded numel, resident).

    Sharded units gather their weights in forward and again in backward and reduce-scatter their
    gradients, every micro-batch; resident units only reduce-scatter, then all-gather the updated
    weights in the step.
    """
    world = layout.world_size
    crossing = layout.nodes / world if layout.nodes > 1 else 0.0
    sent = {"forward": 0, "backward": 0, "step": 0}
    for padded, resident in units:
        gather, reduce = ring_bytes(padded * compute_bytes, world), ring_bytes(padded * grad_bytes, world)
        sent["backward"] += accumulation * reduce
        if resident:
            sent["step"] += gather
        else:
            sent["forward"] += accumulation * gather
            sent["backward"] += accumulation * gather
    return {phase: {"intra": b * (1 - crossing), "inter": b * crossing} for phase, b in sent.items()}
