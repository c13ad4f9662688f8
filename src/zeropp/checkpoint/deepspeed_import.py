"""A DeepSpeed ZeRO checkpoint written as a zeropp checkpoint (``zeropp import-deepspeed``).

The DeepSpeed files are read whole in one process (:mod:`~zeropp.checkpoint.deepspeed_files`) and
written with DCP's single-process save in the per-parameter form every zeropp checkpoint has
(:mod:`~zeropp.checkpoint.per_parameter`): ``model.<name>`` (fp32 masters), ``optim.<name>.<key>`` (the
optimizer's states), ``fixed.<name>`` (buffers, frozen parameters), then zeropp.json. So
``zeropp train --resume`` loads it on any world size and stage, and ``zeropp export`` consolidates it.

zeropp.json records the step, the optimizer (torch's class, and DeepSpeed's param groups in their
order, each with the keys torch's class knows), the fp16 loss scaler in zeropp's terms, and under
``extra.deepspeed`` where it came from and DeepSpeed's lr-scheduler state (zeropp's schedule is
a function of the step, which carries on from the imported one).

Everything is read and checked before OUT_DIR is touched; the checkpoint is published atomically
(``.step-N.partial`` renamed to ``step-N``), so a refused or failed import leaves nothing there.
"""

from __future__ import annotations

import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter

from zeropp.checkpoint import per_parameter
from zeropp.checkpoint.dcp import FORMAT, CheckpointError, check_writable, checkpoint_name, jsonable, publish
from zeropp.checkpoint.deepspeed_files import DeepSpeedCheckpointError, DeepSpeedState, read_checkpoint


@dataclass
class Imported:
    """An import's result: the zeropp checkpoint written, what was read, and notes for the user."""

    path: Path
    source: DeepSpeedState
    notes: list[str]


def import_deepspeed(source: str | Path, out_dir: str | Path) -> Imported:
    """Write DeepSpeed checkpoint `source` (a save_checkpoint folder, whose ``latest`` names the tag,
    or a ``global_stepN`` folder) as zeropp checkpoint ``out_dir/step-<N>``.

    Raises :class:`DeepSpeedCheckpointError` (the DeepSpeed side) or
    :class:`~zeropp.checkpoint.dcp.CheckpointError` (the output), one line each, before writing anything."""
    state = read_checkpoint(source)
    out_dir = Path(out_dir)
    final = out_dir / checkpoint_name(state.step)
    if final.exists():
        raise CheckpointError(f"{str(final)!r} already exists; import into another folder or remove it")
    bad = sorted(name for name, t in state.masters.items() if not bool(torch.isfinite(t).all()))
    if bad:
        raise DeepSpeedCheckpointError(f"DeepSpeed's fp32 master of {bad[0]!r} holds nan or inf; not importing it")
    groups, notes = _param_groups(state), []
    meta = {
        "format": FORMAT,
        "step": state.step,
        "world_size": state.world_size,
        "nodes": 1,
        "tensor_parallel_size": 1,
        "stage": state.stage,
        "params": {name: list(t.shape) for name, t in state.masters.items()},
        "fixed": {name: list(t.shape) for name, t in state.fixed.items()},
        "aliases": state.aliases,
        "precision": state.precision,
        "optimizer": f"{getattr(torch.optim, state.optimizer).__module__}.{state.optimizer}",
        "param_groups": [jsonable(group) for group in groups],
        "scaler": _scaler(state.loss_scaler),
        "global_step": state.step,
        "extra": {"deepspeed": _provenance(state)},
    }
    if state.untied:
        notes.append(
            f"{', '.join(state.untied)}: tied to a parameter the stage-3 files do not name; a resumed run ties "
            "it again, export leaves it out (as DeepSpeed's zero_to_fp32 does)"
        )
    check_writable(out_dir)
    partial = out_dir / f".{final.name}.partial"
    try:
        with warnings.catch_warnings():  # DCP warns that it saves in one process, which is the point here
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(_tensors(state), storage_writer=FileSystemWriter(str(partial)), no_dist=True)
        publish(partial, final, meta)
    except (Exception, CheckpointException) as error:  # DCP's CheckpointException is a BaseException
        shutil.rmtree(partial, ignore_errors=True)
        raise CheckpointError(f"could not write {str(final)!r}: {str(error).splitlines()[0]}") from None
    return Imported(final, state, notes)


def _tensors(state: DeepSpeedState) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors in zeropp's per-parameter form (a 0-d parameter as one element)."""
    tensors = {}
    for name, master in state.masters.items():
        tensors[per_parameter.model_key(name)] = master.float().reshape(master.shape or (1,))
        for key, value in state.optimizer_state[name].items():
            tensors[per_parameter.optim_key(name, key)] = value.reshape(master.shape or (1,)) if value.dim() else value
    tensors.update({per_parameter.fixed_key(name): t for name, t in state.fixed.items()})
    return tensors


def _param_groups(state: DeepSpeedState) -> list[dict[str, Any]]:
    """DeepSpeed's param groups in order, each torch's defaults for the class with the group's values
    (a resumed run with as many groups may take them: load_checkpoint's optimizer_settings)."""
    cls = getattr(torch.optim, state.optimizer)
    defaults = cls([torch.zeros(1, requires_grad=True)]).defaults
    return [{key: saved.get(key, value) for key, value in defaults.items()} for saved in state.param_groups]


def _scaler(saved: dict[str, Any]) -> dict[str, Any]:
    """DeepSpeed's loss scaler in zeropp's terms: the clean steps since the last overflow are
    ``cur_iter - last_overflow_iter - 1`` (DeepSpeed grows the scale when that count + 1 divides the window)."""
    scaler = {"scale": float(saved.get("cur_scale", 1.0)), "clean_steps": 0}
    if saved.get("dynamic"):
        scaler["clean_steps"] = int(saved["cur_iter"] - saved["last_overflow_iter"] - 1)
        if "cur_hysteresis" in saved:
            scaler["hysteresis"] = int(saved["cur_hysteresis"])
    return scaler


def _provenance(state: DeepSpeedState) -> dict[str, Any]:
    return {
        "source": str(state.folder.resolve()),
        "ds_version": state.ds_version,
        "stage": state.stage,
        "data_parallel_size": state.world_size,
        "lr_scheduler": jsonable(state.lr_scheduler),
    }
