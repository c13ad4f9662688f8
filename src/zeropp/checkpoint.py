"""Sharded checkpoints with torch.distributed.checkpoint (DCP): save, resume on any world size,
node count or stage, and export one consolidated file.

A checkpoint is a directory ``step-00000120`` holding

- DCP's files (``.metadata`` and one ``__R_0.distcp`` per rank) with tensors in a layout that does
  not depend on how they were sharded: ``model.<name>`` is the fp32 master of parameter <name>,
  flattened, as a DTensor cut over the ranks in torch.chunk pieces (each rank writes its piece);
  ``optim.<name>.<key>`` is the optimizer's per-element state of that parameter the same way, and
  its scalar states (Adam's ``step``) whole; ``fixed.<name>`` holds frozen parameters and buffers
  whole (written once); ``rng.rank<r>`` each rank's RNG state.
- ``zeropp.json``: the step, parameter names and shapes, optimizer class and hyperparameters,
  loss-scaler state, what the caller adds (the run config), and the world it was saved from.

Atomic publish: ranks write into ``.step-00000120.partial``; once every rank has written, rank 0
adds zeropp.json and renames the folder to ``step-00000120``, an atomic rename on one file system
(all ranks must see the same directory). A crash before that leaves only a ``.partial`` folder,
which :func:`find_latest` never picks and the next save removes. Old checkpoints beyond
``keep_last`` are pruned after a publish, never before.

Ranks synchronise through the engine's communicator (barriers, and one all-gather per unit for the
flat buffers below). DCP also exchanges its save and load plans with small collectives of its
own; those carry metadata, not tensor data (which goes to storage), and are not in the ledger.

Loading reads, one unit at a time, the whole of each of its tensors on every rank (DCP assembles
them from whatever pieces were written) and keeps this rank's shard, so any run loads any
checkpoint of the same model. Saving gathers one unit's flat buffers at a time for the same
reason (a redistribution by all-to-all would move less; not done yet).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader, FileSystemWriter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

if TYPE_CHECKING:
    from zeropp.engine import ZeroEngine
    from zeropp.units import FlatUnit

FORMAT = "zeropp-checkpoint/1"
META = "zeropp.json"
_NAME = re.compile(r"^step-(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read. The message is one line and says what to do."""


# -- finding checkpoints --------------------------------------------------------------------------


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def find_latest(directory: str | Path) -> Path | None:
    """The published checkpoint with the highest step in `directory` (partial saves are never picked)."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    found = [p for p in directory.iterdir() if _NAME.match(p.name) and (p / META).is_file()]
    return max(found, key=lambda p: int(_NAME.match(p.name).group(1)), default=None)


def read_meta(path: str | Path) -> dict[str, Any]:
    """A checkpoint's zeropp.json, checked; one-line CheckpointError if missing or damaged."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    try:
        meta = json.loads((path / META).read_text())
        if meta.get("format") != FORMAT:
            raise ValueError(f"format {meta.get('format')!r}, expected {FORMAT!r}")
        FileSystemReader(str(path)).read_metadata()
    except Exception as error:  # unreadable json, truncated or foreign DCP metadata, ...
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise CheckpointError(f"checkpoint {str(path)!r} is incomplete or corrupt ({reason})") from None
    return meta


def check_writable(directory: str | Path) -> None:
    """Refuse a checkpoint directory that cannot be created or written (call before any collective)."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise CheckpointError(f"checkpoint directory {str(directory)!r} is not writable ({error.strerror})") from None


# -- saving ---------------------------------------------------------------------------------------


def save_checkpoint(
    engine: ZeroEngine, directory: str | Path, step: int, *, extra: dict[str, Any] | None = None, keep_last: int = 0
) -> Path:
    """Write a checkpoint of `engine` at `step` into `directory`, publish it atomically, prune old ones.

    Collective: every rank calls it. keep_last = 0 keeps every checkpoint.
    """
    directory = Path(directory)
    final = directory / checkpoint_name(step)
    partial = directory / f".{final.name}.partial"
    rank = engine.topology.rank
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        for stale in directory.glob(".step-*.partial"):  # a save that crashed earlier
            shutil.rmtree(stale, ignore_errors=True)
    engine.comm.barrier(engine.topology.world)
    try:
        dcp.save(_state_to_save(engine), storage_writer=FileSystemWriter(str(partial)))
    except (Exception, CheckpointException) as error:  # DCP's CheckpointException is a BaseException
        engine.comm.barrier(engine.topology.world)  # every rank is done with the folder
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        engine.comm.barrier(engine.topology.world)  # ... and nobody sees it after the error
        raise CheckpointError(f"could not write checkpoint {str(final)!r}: {_reason(error)}") from None
    if rank == 0:
        meta = {"format": FORMAT, "step": step, **_describe(engine), "extra": extra or {}}
        (partial / META).write_text(json.dumps(meta, indent=1))
        if final.exists():  # the same step saved again (e.g. after a restart): replace it
            shutil.rmtree(final)
        os.replace(partial, final)
        _fsync_dir(directory)
        if keep_last:
            published = sorted(p for p in directory.iterdir() if _NAME.match(p.name))
            for old in published[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
    engine.comm.barrier(engine.topology.world)
    return final


def _state_to_save(engine: ZeroEngine) -> dict[str, Any]:
    world = engine.topology.world_size
    mesh = init_device_mesh(engine.topology.device.type, (world,))
    rank = engine.topology.rank
    state: dict[str, Any] = {}

    def chunked(flat: torch.Tensor, start: int, stop: int) -> DTensor:
        pieces = torch.chunk(flat[start:stop], world)
        local = pieces[rank] if rank < len(pieces) else flat[:0]
        return DTensor.from_local(local.clone(), mesh, [Shard(0)], run_check=False, shape=(stop - start,), stride=(1,))

    for unit in engine.units:
        master = unit.gather_flat(unit.master.data)
        optim_state = engine.optimizer.state.get(unit.master, {})
        per_element = {k: unit.gather_flat(v) for k, v in optim_state.items() if _is_per_element(unit, v)}
        for index, name in enumerate(unit.names):
            start, stop = unit.layout.param_range(index)
            state[f"model.{name}"] = chunked(master, start, stop)
            for key, value in optim_state.items():
                if key in per_element:
                    state[f"optim.{name}.{key}"] = chunked(per_element[key], start, stop)
                elif isinstance(value, torch.Tensor) and value.dim() == 0:
                    state[f"optim.{name}.{key}"] = value.clone()
                else:
                    raise CheckpointError(
                        f"optimizer state {key!r} of {type(engine.optimizer).__name__} is neither per-element "
                        "nor a scalar tensor; zeropp checkpoints support elementwise optimizers only"
                    )
    for name, tensor in _fixed_tensors(engine).items():
        state[f"fixed.{name}"] = tensor
    state[f"rng.rank{rank}"] = torch.get_rng_state()
    return state


def _is_per_element(unit: FlatUnit, value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.shape == unit.master.shape


def _fixed_tensors(engine: ZeroEngine) -> dict[str, torch.Tensor]:
    """Frozen parameters and buffers: what the engine keeps whole on every rank."""
    managed = {id(p) for unit in engine.units for p in unit.params}
    return {
        name: tensor.detach()
        for name, tensor in engine.module.state_dict(keep_vars=True).items()
        if id(tensor) not in managed
    }


def _aliases(engine: ZeroEngine) -> dict[str, str]:
    """state_dict keys that name an already listed parameter (tied weights): key -> parameter name."""
    owner = {id(p): name for unit in engine.units for name, p in zip(unit.names, unit.params, strict=True)}
    return {
        key: owner[id(tensor)]
        for key, tensor in engine.module.state_dict(keep_vars=True).items()
        if id(tensor) in owner and owner[id(tensor)] != key
    }


def _describe(engine: ZeroEngine) -> dict[str, Any]:
    optimizer = engine.optimizer
    return {
        "world_size": engine.topology.world_size,
        "nodes": engine.topology.nodes,
        "stage": engine.config.stage,
        "params": {
            name: list(p.shape) for unit in engine.units for name, p in zip(unit.names, unit.params, strict=True)
        },
        "fixed": {name: list(t.shape) for name, t in _fixed_tensors(engine).items()},
        "aliases": _aliases(engine),
        "precision": engine.config.precision,
        "optimizer": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}",
        "param_groups": [_jsonable({k: v for k, v in g.items() if k != "params"}) for g in optimizer.param_groups],
        "scaler": engine.scaler.state_dict(),
        "global_step": engine.global_step,
    }


# -- loading --------------------------------------------------------------------------------------


def load_checkpoint(engine: ZeroEngine, path: str | Path) -> dict[str, Any]:
    """Load a checkpoint into `engine` (any world size, node count or stage); return its zeropp.json.

    Collective. The checkpoint is checked against the engine before anything is read.
    """
    meta = read_meta(path)
    _check_compatible(engine, meta, path)
    keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    rank = engine.topology.rank
    for unit in engine.units:
        first = f"optim.{unit.names[0]}."
        optim_keys = sorted(k[len(first) :] for k in keys if k.startswith(first))
        wanted = {f"model.{n}": _empty_like_saved(keys[f"model.{n}"]) for n in unit.names}
        wanted.update(
            {f"optim.{n}.{k}": _empty_like_saved(keys[f"optim.{n}.{k}"]) for n in unit.names for k in optim_keys}
        )
        _read(wanted, path)
        unit.load_master(_assemble(unit, [wanted[f"model.{n}"] for n in unit.names]))
        state = {}
        for key in optim_keys:
            values = [wanted[f"optim.{n}.{key}"] for n in unit.names]
            state[key] = values[0] if values[0].dim() == 0 else unit.shard_of(_assemble(unit, values)).clone()
        if state:
            engine.optimizer.state[unit.master] = state
        unit.clear_gradients()
    fixed = {f"fixed.{name}": tensor for name, tensor in _fixed_tensors(engine).items()}
    rng = f"rng.rank{rank}"
    if rng in keys and meta["world_size"] == engine.topology.world_size:
        fixed[rng] = torch.empty_like(torch.get_rng_state())
    if fixed:
        _read(fixed, path)
        if rng in fixed:
            torch.set_rng_state(fixed.pop(rng))
    for group, saved in zip(engine.optimizer.param_groups, meta["param_groups"], strict=True):
        for key, value in saved.items():
            group[key] = type(group[key])(value) if isinstance(group.get(key), tuple) else value
    if engine.scaler.enabled and meta["precision"] == "fp16":  # a bf16/fp32 run's scale (1) means nothing here
        engine.scaler.load_state_dict(meta["scaler"])
    engine.global_step = meta["global_step"]
    return meta


def _check_compatible(engine: ZeroEngine, meta: dict[str, Any], path: str | Path) -> None:
    here = _describe(engine)
    for kind in ("params", "fixed"):
        saved, ours = meta[kind], here[kind]
        for name in sorted(saved.keys() | ours.keys()):
            if saved.get(name) != ours.get(name):
                raise CheckpointError(
                    f"checkpoint {str(path)!r} holds a different model: {name!r} has shape "
                    f"{_shape(saved.get(name))} there and {_shape(ours.get(name))} here"
                )
    if meta["optimizer"] != here["optimizer"] or len(meta["param_groups"]) != len(here["param_groups"]):
        raise CheckpointError(
            f"checkpoint {str(path)!r} was saved with optimizer {meta['optimizer']} "
            f"({len(meta['param_groups'])} param groups), this run uses {here['optimizer']} "
            f"({len(here['param_groups'])})"
        )


def _shape(shape: list[int] | None) -> str:
    return "(absent)" if shape is None else str(tuple(shape))


def _empty_like_saved(metadata: Any) -> torch.Tensor:
    return torch.empty(tuple(metadata.size), dtype=metadata.properties.dtype)


def _assemble(unit: FlatUnit, pieces: list[torch.Tensor]) -> torch.Tensor:
    """The unit's padded flat buffer from its parameters' flat tensors (zeros in the padding)."""
    flat = torch.zeros(unit.layout.padded_numel, dtype=pieces[0].dtype, device=unit.master.device)
    for index, piece in enumerate(pieces):
        start, stop = unit.layout.param_range(index)
        flat[start:stop].copy_(piece)
    return flat


def _read(state: dict[str, torch.Tensor], path: str | Path) -> None:
    try:
        dcp.load(state, storage_reader=FileSystemReader(str(path)))
    except (Exception, CheckpointException) as error:
        raise CheckpointError(f"could not read checkpoint {str(path)!r}: {_reason(error)}") from None


# -- export ---------------------------------------------------------------------------------------


def export_checkpoint(path: str | Path, out: str | Path) -> dict[str, Any]:
    """Consolidate a checkpoint into one safetensors file of fp32 ``model.state_dict()`` tensors.

    Runs in one process, whatever world size saved it. Returns the checkpoint's zeropp.json.
    """
    from safetensors.torch import save_file

    meta = read_meta(path)
    out = Path(out)
    if not out.parent.is_dir() or not os.access(out.parent, os.W_OK):
        raise CheckpointError(f"cannot write {str(out)!r}: its folder does not exist or is not writable")
    keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    flat = {f"model.{name}": _empty_like_saved(keys[f"model.{name}"]) for name in meta["params"]}
    fixed = {f"fixed.{name}": _empty_like_saved(keys[f"fixed.{name}"]) for name in meta["fixed"]}
    try:
        with warnings.catch_warnings():  # DCP warns that it loads in one process, which is the point here
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({**flat, **fixed}, storage_reader=FileSystemReader(str(path)), no_dist=True)
    except (Exception, CheckpointException) as error:
        raise CheckpointError(f"could not read checkpoint {str(path)!r}: {_reason(error)}") from None
    tensors = {name: flat[f"model.{name}"].view(shape) for name, shape in meta["params"].items()}
    for alias, name in meta["aliases"].items():
        tensors[alias] = tensors[name].clone()  # safetensors stores no shared tensors
    for name in meta["fixed"]:
        value = fixed[f"fixed.{name}"]
        tensors[name] = value.float() if value.is_floating_point() else value
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out), metadata={"step": str(meta["step"])})
    except OSError as error:
        raise CheckpointError(f"could not write {str(out)!r} ({error.strerror})") from None
    return meta


# -- helpers --------------------------------------------------------------------------------------


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _reason(error: BaseException) -> str:
    """The root cause of a (possibly wrapped, multi-line) error, on one line."""
    causes = getattr(error, "failures", None)  # DCP's CheckpointException: {rank: exception}
    if causes:
        error = next(iter(causes.values()))
        error = getattr(error, "exc", error) if not isinstance(error, BaseException) else error
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.item()
    return value
