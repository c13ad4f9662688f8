"""Error-feedback residuals in a checkpoint: qgZ's per unit and hop
(``qgz_residual.rank<r>.<unit>.<hop>``) and DiLoCo's outer exchange's (``outer_residual.rank<r>.<hop>``:
``inter``, its chunks of the change, and ``gather``, the mean chunk it owns; with Streaming DiLoCo's
fragments ``outer_residual.rank<r>.fragment<f>.<hop>``, each fragment's own).

What a rank's quantizations dropped belongs to that rank, like its RNG state: the residuals are saved
per rank and loaded where the world size, node count and tensor-parallel size match the checkpoint's;
a run on another world starts them from zero, and rank 0 says so.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from zeropp.comm.feedback import HOPS

if TYPE_CHECKING:
    from zeropp.engine import ZeroEngine

PREFIXES = ("qgz_residual.", "outer_residual.")


def _qgz_key(rank: int, unit: int, hop: str) -> str:
    return f"qgz_residual.rank{rank}.{unit}.{hop}"


def _outer_key(rank: int, hop: str) -> str:
    return f"outer_residual.rank{rank}.{hop}"


def _outer_residuals(engine: ZeroEngine) -> dict[str, torch.Tensor]:
    return {} if engine.outer is None else engine.outer.residuals()


def to_save(engine: ZeroEngine) -> dict[str, torch.Tensor]:
    """This rank's residuals under their checkpoint keys."""
    rank = engine.topology.rank
    saved = {
        _qgz_key(rank, index, hop): residual
        for index, unit in enumerate(engine.units)
        if unit.error_feedback is not None
        for hop, residual in unit.error_feedback.residuals.items()
    }
    saved.update((_outer_key(rank, hop), residual) for hop, residual in _outer_residuals(engine).items())
    return saved


def to_load(engine: ZeroEngine, meta: Mapping[str, Any], saved: Mapping[str, Any], path: str | Path) -> dict:
    """This rank's residual tensors to read where the checkpoint's world matches this run's (every
    residual is zeroed first; `saved`: the checkpoint's metadata by key)."""
    rank, topo = engine.topology.rank, engine.topology
    engine.reset_error_feedback()
    outer = _outer_residuals(engine)
    for residual in outer.values():
        residual.zero_()
    feedback = [(i, u.error_feedback) for i, u in enumerate(engine.units) if u.error_feedback is not None]
    if not (feedback or outer) or not any(key.startswith(PREFIXES) for key in saved):
        return {}
    saved_mesh = (meta["world_size"], meta["nodes"], meta.get("tensor_parallel_size", 1))
    if saved_mesh != (topo.world_size, topo.nodes, topo.tensor_parallel.size):
        if rank == 0:
            print(
                f"zeropp: error-feedback residuals start from zero: checkpoint {str(path)!r} was saved on "
                "{} ranks x {} nodes (tensor parallel {}), this run has ".format(*saved_mesh)
                + f"{topo.world_size} x {topo.nodes} (tensor parallel {topo.tensor_parallel.size})"
            )
        return {}
    wanted = {}
    for index, ef in feedback:
        unit = engine.units[index]
        shard, groups = unit.layout.shard_numel, unit.groups  # rows: qgZ's slices of the shard group, its nodes
        for hop, rows in zip(HOPS, (groups.shard.size, groups.inter_node.size), strict=True):
            key = _qgz_key(rank, index, hop)
            if key in saved and tuple(saved[key].size) == (rows, shard):  # else (another layout) from zero
                ef.residuals[hop] = torch.zeros(rows, shard, device=topo.device)
                wanted[key] = ef.residuals[hop]
    for hop, residual in outer.items():
        key = _outer_key(rank, hop)
        if key in saved and tuple(saved[key].size) == tuple(residual.shape):
            wanted[key] = residual
    mine = [key for key in saved if key.startswith(PREFIXES) and key.split(".")[1] == f"rank{rank}"]
    if rank == 0 and len(wanted) < len(mine):  # the same world, another layout (outer_fragments, qgZ, units)
        print(
            f"zeropp: {len(mine) - len(wanted)} of this rank's {len(mine)} error-feedback residuals in checkpoint "
            f"{str(path)!r} have another layout here and start from zero"
        )
    return wanted
