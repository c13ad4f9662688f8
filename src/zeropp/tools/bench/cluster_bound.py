"""How close a step of the cluster benchmark is to what the link and the compute allow, and what the
estimator predicted for it.

A step cannot be faster than its compute, nor than the cross-node bytes of the busiest node over
its link. With perfect overlap of the two it takes their maximum, the **bound**:

    bound = max(compute, node_bytes / goodput)

- compute: the same configuration's fastest median step over the links the run measured, same nodes
  and ranks (normally the unshaped one: everything but the wire, the collectives' CPU work included,
  as it would be on any link). No step is faster than its compute, so this is at least the compute,
  and the bound never exceeds a measured step: one slow unshaped run cannot put a step below it;
- node_bytes: the ledger's cross-node bytes of one step summed over each node's ranks, the busiest
  node's (every node has one shaped link of its own, shaped both ways: what leaves it and what
  enters it are equal here, every collective being symmetric across nodes);
- goodput: the TCP payload rate of one shaped link, probed before the runs
  (:func:`zeropp.tools.cluster.probe_bandwidth`).

``measured / bound`` (at least 1) is how far the step is from the link's limit; exactly 1 where the
step itself is the configuration's fastest. On the unshaped link the bound is the measurement
itself, so only the shaped links are scored.

The **prediction** is the estimator's (:mod:`zeropp.tools.estimate`): its bytes of the busiest
node from the run's own config (the same units and collectives as the engine's), over the
link's nominal rate, added to the same measured compute (the estimator assumes no overlap):

    predicted = compute + estimator_node_bytes / nominal_rate

so ``bound <= measured <= predicted`` when the step overlaps part of its communication, and the
estimator's error per point is ``predicted / measured - 1``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from zeropp.config.rates import parse_bandwidth
from zeropp.config.sections import load_config
from zeropp.tools.estimate.model import estimate, gpt_unit_numels

UNSHAPED = "none"


def busiest_node_bytes(by_rank: Sequence[float], ranks_per_node: int) -> float:
    """The most cross-node bytes one node's ranks send together (ranks are laid out node by node)."""
    nodes = len(by_rank) // ranks_per_node
    return max(sum(by_rank[n * ranks_per_node : (n + 1) * ranks_per_node]) for n in range(nodes))


def estimated_node_bytes(config: dict[str, Any], nodes: int, ranks_per_node: int) -> float:
    """The estimator's cross-node bytes per step of one node, for the run's own config."""
    run = load_config(config)
    world = nodes * ranks_per_node
    est = estimate(gpt_unit_numels(run.model, run.topology.tensor_parallel_size), world, nodes, run.zero)
    return est.node_inter_bytes()


def add_bounds(rows: list[dict[str, Any]], goodput_bps: dict[str, float]) -> None:
    """Give every shaped zeropp row its bound, measured / bound and the estimator's prediction, the compute
    being the fastest row of the same configuration and nodes, where one of them is unshaped (rows
    without an unshaped run, or without a ledger, get none)."""
    measured = [r for r in rows if "error" not in r]
    unshaped = {(r["name"], r["nodes"]) for r in measured if r["bandwidth"] == UNSHAPED}
    compute = {
        key: min(r["median_step_time_s"] for r in measured if (r["name"], r["nodes"]) == key) for key in unshaped
    }
    for row in rows:
        key = (row["name"], row["nodes"])
        if row["bandwidth"] == UNSHAPED or "error" in row or key not in compute or not row.get("node_inter_bytes"):
            continue
        wire_s = 8 * row["node_inter_bytes"] / goodput_bps[row["bandwidth"]]
        bound = max(compute[key], wire_s)
        predicted = compute[key] + 8 * row["estimated_node_inter_bytes"] / parse_bandwidth(row["bandwidth"])
        row.update(
            compute_s=compute[key],
            wire_s=wire_s,
            bound_s=bound,
            of_bound=row["median_step_time_s"] / bound,
            predicted_s=predicted,
            estimator_error=predicted / row["median_step_time_s"] - 1,
        )
