"""Wire bytes against the ledger: what each node's link carried beside what the run summary accounts for."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from zeropp.app.summary import RunSummary

if TYPE_CHECKING:
    from zeropp.tools.cluster.run import ClusterResult


def gloo_broadcast_crossings(world: int, nproc_per_node: int, src: int = 0) -> list[int]:
    """How many times gloo's broadcast from `src` sends the whole buffer out of each node.

    gloo (gloo/broadcast.cc) broadcasts along a binomial tree, nearest first: in round k
    (k = 0, 1, ...) every rank at distance d < 2^k from the root sends to the rank at d + 2^k. With
    ranks laid out node by node, 0 -> 1 stays inside node 0 while 0 -> 2 and 1 -> 3 cross: for
    2 nodes x 2 ranks the weights leave node 0 twice (the ledger's ring model says once). Measured
    on the emulated wire (docs/cluster.md).
    """
    nodes = world // nproc_per_node
    out = [0] * nodes
    step = 1
    while step < world:
        for d in range(step):
            if d + step < world:
                a, b = (src + d) % world, (src + d + step) % world
                if a // nproc_per_node != b // nproc_per_node:
                    out[a // nproc_per_node] += 1
        step *= 2
    return out


HEADER_BYTES = 66  # Ethernet 14 + IPv4 20 + TCP 20 + timestamps 12: once per packet the counters count


def compare_to_ledger(
    summary: RunSummary,
    nodes: int,
    nproc_per_node: int,
    node_tx_bytes: Sequence[int],
    node_tx_packets: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Set the bytes each node sent over its inter-node link beside what the ledger accounts for.

    Expected (application bytes out of node n):

    - ledger steps: the summary's inter-node bytes per step of each rank on n (rank r lives on node
      r // nproc_per_node) times the steps run; the ledger counts training steps only;
    - gloo reduce-scatter: gloo runs reduce_scatter as an all-reduce (measured: 2x the ring's bytes),
      so each reduce-scatter's inter-node bytes count twice (ZeRO-1/2/3 gradients; qgZ has none);
    - broadcast (outside the ledger): with ``train.init = "eager"`` the initial weight broadcast from
      rank 0, fp32 parameters (4 bytes each) times gloo_broadcast_crossings() (gloo's binomial tree,
      not the ledger's ring); a meta-built model is initialized on every rank and broadcasts nothing;
    - eval (outside the ledger): at stage 3 each evaluation pass gathers the weights again: its
      first batch over the world (one forward gather), later batches from hpZ's secondary copy
      (inside a node: nothing) or over the world again (no hpZ); equal for every node (ring).

    Measured: the interface counters count each packet's 66 bytes of Ethernet/IP/TCP headers once
    (a GSO packet too), so wire - 66 x packets is the TCP payload, which is compared with the
    expected bytes (`ratio`; `wire_ratio` is the raw wire). The rest of the payload is what no
    ledger models: gloo's framing of every message, rendezvous/store traffic, the loss all-reduces,
    the summary's gathers and TCP retransmissions (docs/cluster.md has the measured sizes).
    """
    world = nodes * nproc_per_node
    steps_run = max(1, summary.steps - summary.start_step)
    by_rank = summary.inter_node_bytes_per_step_by_rank
    ledger_steps = [
        sum(by_rank[r] for r in range(n * nproc_per_node, (n + 1) * nproc_per_node)) * steps_run for n in range(nodes)
    ]
    reduce_scatter = sum(v.get("inter", 0.0) for v in summary.ledger.get("reduce_scatter", {}).values()) * world
    eager = summary.config.get("train", {}).get("init", "eager") == "eager"  # meta-built models broadcast nothing
    param_bytes = 4 * summary.param_count if eager else 0
    parts = {
        "ledger_step_bytes": ledger_steps,
        "gloo_reduce_scatter_extra_bytes": [reduce_scatter * steps_run / nodes] * nodes,  # ring: all nodes alike
        "broadcast_bytes": [c * param_bytes for c in gloo_broadcast_crossings(world, nproc_per_node)],
        "eval_bytes": [_eval_bytes(summary, world) / nodes] * nodes,
    }
    packets = list(node_tx_packets) if node_tx_packets is not None else [0] * nodes
    rows = [
        {"node": n, **_row(node_tx_bytes[n], packets[n], {k: v[n] for k, v in parts.items()})} for n in range(nodes)
    ]
    total = _row(sum(node_tx_bytes), sum(packets), {k: sum(r[k] for r in rows) for k in parts})
    return {
        "steps_run": steps_run,
        "world_size": world,
        "ledger_inter_node_bytes_per_step": summary.inter_node_bytes_per_step * world,
        "nodes": rows,
        "total": total,
    }


def _eval_bytes(summary: RunSummary, world: int) -> float:
    """Inter-node bytes of the run's evaluations, all ranks (0 below stage 3: nothing is gathered)."""
    if summary.stage != 3:
        return 0.0
    train, zero = summary.config["train"], summary.config["zero"]
    gathers = summary.ledger.get("all_gather", {})
    accumulation = int(zero.get("gradient_accumulation_steps", 1))
    hpz = summary.zeropp.hpz_group_size > 1
    forward = gathers.get("forward", {}).get("inter", 0.0) * world  # all ranks, per step
    backward = gathers.get("backward", {}).get("inter", 0.0) * world
    first = forward / (1 if hpz else accumulation)  # one world gather of every unit
    later = backward / accumulation if hpz else first  # one gather from the secondary copy, or the world's
    per_pass = first + max(0, int(train.get("eval_batches", 1)) - 1) * later
    interval = int(train.get("eval_interval", 0) or 0)
    middle = sum(1 for k in range(summary.start_step + 1, summary.steps) if interval and k % interval == 0)
    return per_pass * (middle + 1)  # the evaluations between steps, and the final one


def _row(wire: float, packets: float, parts: dict[str, float]) -> dict[str, float]:
    expected = sum(parts.values())
    headers = HEADER_BYTES * packets
    return {
        "wire_bytes": wire,
        "packets": packets,
        "header_bytes": headers,
        "tcp_payload_bytes": wire - headers,
        **parts,
        "expected_bytes": expected,
        "ratio": (wire - headers) / expected if expected else math.inf,
        "wire_ratio": wire / expected if expected else math.inf,
    }


def per_step_wire_bytes(short: ClusterResult, long: ClusterResult) -> dict[str, float]:
    """Bytes of one training step on the wire, from two runs that differ only in --steps:
    everything that is not a step (set-up, broadcast, evaluation, summary) is the same in both and
    cancels. Beside it the ledger's bytes per step (all ranks; + gloo's reduce-scatter doubling)."""
    assert isinstance(short.summary, RunSummary) and isinstance(long.summary, RunSummary), "both need a summary"
    steps = long.summary.steps - short.summary.steps
    assert steps > 0, "the second run must have more steps"
    wire = (sum(long.node_tx_bytes) - sum(short.node_tx_bytes)) / steps
    packets = (sum(long.wire_packets.values()) - sum(short.wire_packets.values())) / steps
    comparison = long.comparison
    assert comparison is not None
    expected = (
        comparison["total"]["ledger_step_bytes"] + comparison["total"]["gloo_reduce_scatter_extra_bytes"]
    ) / comparison["steps_run"]
    payload = wire - HEADER_BYTES * packets
    return {
        "wire_bytes_per_step": wire,
        "packets_per_step": packets,
        "tcp_payload_bytes_per_step": payload,
        "ledger_bytes_per_step": comparison["ledger_inter_node_bytes_per_step"],
        "expected_bytes_per_step": expected,
        "ratio": payload / expected if expected else math.inf,
        "wire_ratio": wire / expected if expected else math.inf,
    }
