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

The **prediction** is the estimator's (:mod:`zeropp.tools.estimate`): its bytes per phase of the
busiest node from the run's own config (the same units and collectives as the engine's, gloo's
reduce-scatters counted twice), over the link's nominal rate, overlapped with the same measured
compute as stage 3 pipelines them over its units (:mod:`zeropp.costs.step_time`); the estimator's
error per point is ``predicted / measured - 1``. The intra-node link is loopback here, its cost
part of the compute.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from zeropp.config.rates import parse_bandwidth
from zeropp.config.sections import load_config
from zeropp.costs.step_time import step_seconds
from zeropp.tools.estimate.gpt import gpt_unit_numels
from zeropp.tools.estimate.model import estimate

UNSHAPED = "none"


def busiest_node_bytes(by_rank: Sequence[float], ranks_per_node: int) -> float:
    """The most cross-node bytes one node's ranks send together (ranks are laid out node by node)."""
    nodes = len(by_rank) // ranks_per_node
    return max(sum(by_rank[n * ranks_per_node : (n + 1) * ranks_per_node]) for n in range(nodes))


def estimator_fields(config: dict[str, Any], nodes: int, ranks_per_node: int) -> dict[str, Any]:
    """The estimator's cross-node bytes of one node per step (in all, and per phase as gloo sends
    them) and its units gathered per use, for the run's own config."""
    run = load_config(config)
    world = nodes * ranks_per_node
    est = estimate(gpt_unit_numels(run.model, run.topology.tensor_parallel_size), world, nodes, run.zero)
    return {
        "estimated_node_inter_bytes": est.node_inter_bytes(),
        "estimated_phase_inter_bytes": {p: b["inter"] for p, b in est.phase_bytes("gloo").items()},
        "gathered_units": est.gathered_units,
    }


def add_bounds(rows: list[dict[str, Any]], goodput_bps: dict[str, float]) -> None:
    """Give every shaped zeropp row its bound, measured / bound and the estimator's prediction, the compute
    being the fastest row of the same configuration and nodes, where one of them is unshaped (rows
    without an unshaped run, without a ledger or without the estimator's bytes, as DiLoCo's, get none)."""
    measured = [r for r in rows if "error" not in r]
    unshaped = {(r["name"], r["nodes"]) for r in measured if r["bandwidth"] == UNSHAPED}
    compute = {
        key: min(r["median_step_time_s"] for r in measured if (r["name"], r["nodes"]) == key) for key in unshaped
    }
    for row in rows:
        key = (row["name"], row["nodes"])
        if row["bandwidth"] == UNSHAPED or "error" in row or key not in compute:
            continue
        if not row.get("node_inter_bytes") or "estimated_phase_inter_bytes" not in row:
            continue
        wire_s = 8 * row["node_inter_bytes"] / goodput_bps[row["bandwidth"]]
        bound = max(compute[key], wire_s)
        rate = parse_bandwidth(row["bandwidth"])
        comm = {phase: 8 * sent / rate for phase, sent in row["estimated_phase_inter_bytes"].items()}
        predicted = step_seconds(compute[key], comm, row["gathered_units"]).total_s
        row.update(
            compute_s=compute[key],
            wire_s=wire_s,
            bound_s=bound,
            of_bound=row["median_step_time_s"] / bound,
            predicted_s=predicted,
            estimator_error=predicted / row["median_step_time_s"] - 1,
        )
