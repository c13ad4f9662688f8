"""The time of one NCCL collective on a cluster of nodes: alpha-beta links, ring and tree algorithms.

A link moves b bytes in α + b/β seconds (its latency, its bandwidth). A cluster has two kinds
(:class:`Fabric`): each GPU's link inside its node (NVLink / NVSwitch, one direction) and each node's
NICs together (the inter-node bandwidth of a node, shared by its GPUs). A collective runs over a
:class:`Group` of n ranks spanning m nodes, g = n/m of them on each node; every rank of a node runs
such a collective at once (data parallelism: the world ring once, or the G/g rings of a node's
ranks side by side, G ranks per node), so G/g groups share a node's NICs.

Closed forms (B: the buffer, the gathered or reduced tensor; S: what one rank sends):

- **ring** all-gather / reduce-scatter: n-1 steps, S = (n-1)/n B; all-reduce: 2(n-1) steps,
  S = 2(n-1)/n B. The ring is a pipeline, so its bandwidth is its slowest link's: inside a node
  S/β_intra, across nodes each group's edge rank sends S over the NICs, (G/g) S / β_node. Latency:
  a chunk crosses every hop of the ring, p(m-1) of its p(n-1) steps between nodes (p = 1 pass, 2
  for the all-reduce), as NCCL's tuner counts them.
  Time = p(m-1) α_inter + p(n-m) α_intra + max(S/β_intra, (G/g) S/β_node).
- **tree** all-reduce (NCCL's double binary tree between nodes, a chain inside each): B goes up
  and comes down, 2B per rank, 2(log2 m α_inter + (g-1) α_intra) of latency. NCCL takes the faster
  of ring and tree (its tuner does, by the same kind of model): :func:`all_reduce_seconds`.
- **all-to-all** (pairwise): each rank sends B/n to every other rank, (g-1)/n B inside its node and
  (n-g)/n B to other nodes, n-1 messages one after the other in latency.

**gloo** (``backend="gloo"``, CPU ranks) has no tree and performs a reduce-scatter as an all-reduce
(:mod:`zeropp.costs.step_time`): both are priced as the ring all-reduce of the buffer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

RING_PASSES = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2}


@dataclass(frozen=True)
class Link:
    """α + b/β: `latency_s` (α) and `bytes_per_s` (β, as achieved: the line rate times NCCL's efficiency)."""

    bytes_per_s: float
    latency_s: float


@dataclass(frozen=True)
class Fabric:
    """A GPU's link inside its node, a node's NICs together, and the GPUs a node holds."""

    intra: Link
    inter: Link
    ranks_per_node: int


@dataclass(frozen=True)
class Group:
    """n ranks over m nodes, as many on each (n/m)."""

    ranks: int
    nodes: int = 1

    @property
    def per_node(self) -> int:
        return self.ranks // self.nodes

    def sharing_nics(self, fabric: Fabric) -> int:
        """Groups of the same collective a node's ranks run at once: G/g."""
        return fabric.ranks_per_node // self.per_node


def ring_seconds(op: str, buffer_bytes: float, group: Group, fabric: Fabric) -> float:
    """A ring all-gather, reduce-scatter or all-reduce of `buffer_bytes` (see the module docstring)."""
    n, passes = group.ranks, RING_PASSES[op]
    if n == 1:
        return 0.0
    sent = passes * (n - 1) / n * buffer_bytes
    steps = passes * (n - 1)
    if group.nodes == 1:
        return steps * fabric.intra.latency_s + sent / fabric.intra.bytes_per_s
    inter = group.sharing_nics(fabric) * sent / fabric.inter.bytes_per_s
    intra = sent / fabric.intra.bytes_per_s if group.per_node > 1 else 0.0
    inter_steps = passes * (group.nodes - 1)
    return inter_steps * fabric.inter.latency_s + (steps - inter_steps) * fabric.intra.latency_s + max(intra, inter)


def tree_all_reduce_seconds(buffer_bytes: float, group: Group, fabric: Fabric) -> float:
    """NCCL's tree all-reduce: up and down a chain inside each node and a binary tree between nodes."""
    if group.ranks == 1:
        return 0.0
    latency = 2 * (math.log2(group.nodes) * fabric.inter.latency_s + (group.per_node - 1) * fabric.intra.latency_s)
    intra = 2 * buffer_bytes / fabric.intra.bytes_per_s if group.per_node > 1 else 0.0
    inter = group.sharing_nics(fabric) * 2 * buffer_bytes / fabric.inter.bytes_per_s if group.nodes > 1 else 0.0
    return latency + max(intra, inter)


def all_reduce_seconds(buffer_bytes: float, group: Group, fabric: Fabric) -> float:
    """The faster of ring and tree, as NCCL's tuner picks (tree only between nodes)."""
    ring = ring_seconds("all_reduce", buffer_bytes, group, fabric)
    return min(ring, tree_all_reduce_seconds(buffer_bytes, group, fabric)) if group.nodes > 1 else ring


def all_to_all_seconds(buffer_bytes: float, group: Group, fabric: Fabric) -> float:
    """Pairwise all-to-all of `buffer_bytes` per rank (B/n to each peer)."""
    n, g = group.ranks, group.per_node
    if n == 1:
        return 0.0
    alpha = fabric.inter.latency_s if group.nodes > 1 else fabric.intra.latency_s
    intra = (g - 1) / n * buffer_bytes / fabric.intra.bytes_per_s
    inter = group.sharing_nics(fabric) * g * (n - g) / n * buffer_bytes / fabric.inter.bytes_per_s
    return (n - 1) * alpha + max(intra, inter)


def collective_seconds(op: str, sent: float, group: Group, fabric: Fabric, backend: str = "nccl") -> float:
    """The time of a collective given what one rank sends under the ledger's byte model
    (:mod:`zeropp.comm.ledger`: S = (n-1)/n B, all-reduce 2(n-1)/n B): B recovered from S; `backend`
    ``"gloo"``: reductions as gloo runs them (see the module docstring)."""
    n = group.ranks
    if n == 1 or sent == 0:
        return 0.0
    passes = RING_PASSES.get(op, 1)
    buffer_bytes = sent * n / ((n - 1) * passes)
    if backend == "gloo" and op in ("all_reduce", "reduce_scatter"):
        return ring_seconds("all_reduce", buffer_bytes, group, fabric)
    if op == "all_reduce":
        return all_reduce_seconds(buffer_bytes, group, fabric)
    if op == "all_to_all":
        return all_to_all_seconds(buffer_bytes, group, fabric)
    return ring_seconds(op, buffer_bytes, group, fabric)
