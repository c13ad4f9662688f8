"""DiLoCo's replicas in a checkpoint: See [Note: the outer loop] (docs/design.md).

Between synchronizations every node's replica has weights and inner optimizer states of its own, so
a checkpoint of an outer-loop run holds one replica per node, cut over that node's ranks: node 0's
under the plain keys (``model.<name>``, ``optim.<name>.<key>``: what export, a plain run and every
other reader take), node k's under ``node<k>.``. The outer step's state is held once, cut like the
masters: ``outer.anchor.<name>`` (the weights of the last synchronization, the same on every node,
so DCP keeps one copy) and, once the outer optimizer has stepped, ``outer.momentum.<name>``; each
rank's error-feedback residual is rank-specific (:mod:`zeropp.checkpoint.residuals`).

A run resumes on its node k the replica of saved node k mod N (N the saved node count; rank 0 says
so where N differs), a plain run (one node, or no outer loop) node 0's; a DiLoCo run started from a
plain checkpoint takes its masters as the last synchronization's weights.
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zeropp.checkpoint import per_parameter

if TYPE_CHECKING:
    from zeropp.engine import ZeroEngine

ANCHOR, MOMENTUM = "outer.anchor.", "outer.momentum."
MOMENTUM_STATE = "momentum_buffer"  # torch SGD's state key


def _node_prefix(node: int) -> str:
    return "" if node == 0 else f"node{node}."


def _of_replica(key: str) -> bool:
    return key.startswith(("model.", "optim."))


def to_save(engine: ZeroEngine, state: dict[str, Any]) -> dict[str, Any]:
    """`state` (:meth:`~zeropp.engine.ZeroEngine.sharded_state_dict`) under this node's keys, with the
    outer step's state (collective: one all-gather per unit and tensor)."""
    outer = engine.outer
    if outer is None:
        return state
    prefix = _node_prefix(engine.topology.node_of(engine.topology.rank))
    saved = {prefix + key if _of_replica(key) else key: value for key, value in state.items()}
    mesh = engine.checkpoint_mesh
    for unit, anchor in zip(engine.units, outer.anchors, strict=True):
        momentum = outer.optimizer.state.get(anchor, {}).get(MOMENTUM_STATE)
        for prefix, value in ((ANCHOR, anchor), (MOMENTUM, momentum)):
            if value is not None:  # the momentum exists from its fragment's first synchronization on, on every rank
                pieces = per_parameter.param_chunks(unit, value)
                for name, param, shape, piece in zip(unit.names, unit.params, unit.layout.shapes, pieces, strict=True):
                    saved[prefix + name] = mesh.piece(piece, param, shape)
    return saved


def source_prefix(engine: ZeroEngine, meta: Mapping[str, Any], saved: Container[str], path: str | Path) -> str:
    """The key prefix of the saved replica this rank resumes (`saved`: the checkpoint's keys)."""
    names = meta["params"]
    saved_nodes = meta["nodes"] if any(ANCHOR + name in saved for name in names) else 1
    if saved_nodes == 1:
        return ""
    here = engine.topology.nodes if engine.outer is not None else 1
    if here != saved_nodes and engine.topology.rank == 0:
        which = "node 0's" if here == 1 else f"on its node k saved node k mod {saved_nodes}'s"
        print(
            f"zeropp: checkpoint {str(path)!r} holds DiLoCo replicas of {saved_nodes} nodes; this run continues {which}"
        )
    return _node_prefix(engine.topology.node_of(engine.topology.rank) % saved_nodes if here > 1 else 0)


def renamed(state: dict[str, Any], prefix: str, *, back: bool = False) -> dict[str, Any]:
    """`state` with its replica's keys under `prefix` (`back`: without it again)."""
    if back:
        return {key.removeprefix(prefix) if key.startswith(prefix) else key: v for key, v in state.items()}
    return {prefix + key if _of_replica(key) else key: value for key, value in state.items()}


def outer_template(engine: ZeroEngine, saved: Container[str]) -> dict[str, Any]:
    """Empty pieces for the outer state the checkpoint holds (none without the outer loop here)."""
    if engine.outer is None:
        return {}
    mesh = engine.checkpoint_mesh
    return {
        prefix + name: per_parameter.empty_piece(unit, index, mesh)
        for unit in engine.units
        for index, name in enumerate(unit.names)
        for prefix in (ANCHOR, MOMENTUM)
        if prefix + name in saved
    }


def load_outer(engine: ZeroEngine, state: Mapping[str, Any]) -> None:
    """After the masters are loaded: the outer step's anchors and momentum from `state` where it holds
    them, else the masters as the last synchronization's weights and the momentum from zero (collective)."""
    outer = engine.outer
    if outer is None:
        return
    outer.restart()
    for unit, anchor in zip(engine.units, outer.anchors, strict=True):
        for prefix in (ANCHOR, MOMENTUM) if unit.names else ():
            if prefix + unit.names[0] not in state:
                continue
            pieces = [state[prefix + name].to_local() for name in unit.names]
            shard = unit.shard_of(per_parameter.flat_from_param_chunks(unit, pieces)).to(anchor.device)
            if prefix == ANCHOR:
                anchor.copy_(shard)
            else:
                outer.optimizer.state[anchor][MOMENTUM_STATE] = shard.clone()
