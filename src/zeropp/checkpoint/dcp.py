"""Sharded checkpoints with torch.distributed.checkpoint (DCP): save, resume on any world size,
node count, stage or tensor-parallel size, and export one consolidated file.

A checkpoint is a directory ``step-00000120`` holding

- DCP's files (``.metadata`` and one ``__R_0.distcp`` per rank) holding the engine's
  :meth:`~zeropp.engine.ZeroEngine.sharded_state_dict` (``model.<name>``, ``optim.<name>.<key>``,
  ``fixed.<name>``: whole-shaped tensors, a form that does not depend on how the run was
  sharded, see :mod:`zeropp.checkpoint.per_parameter`; each rank writes its blocks) and ``rng.rank<r>``, each rank's
  CPU RNG state (and on CUDA ``rng.cuda.rank<r>``, its device's: dropout draws from it there),
  restored where the world size matches (a rank's stream is its own); a state the checkpoint lacks
  (saved on CPU, loaded on CUDA) leaves that generator as it is.
- ``zeropp.json``: the step, parameter names and shapes, optimizer class and hyperparameters,
  loss-scaler state, what the caller adds (the run config), the world it was saved from, and the
  sha256 of every other file (``files``), checked by :func:`verify_files` on load and export.
- error-feedback residuals (qgZ's, DiLoCo's), rank-specific like the RNG state: loaded where the world
  size and node count match, zeroed otherwise, with a note (:mod:`zeropp.checkpoint.residuals`).
- with DiLoCo's outer loop, every node's replica and the outer step's state
  (:mod:`zeropp.checkpoint.replicas`).

An adapter run saved with ``frozen_base=PATH`` leaves its frozen parameters out, referenced by path
and hash (:mod:`zeropp.checkpoint.adapters`); a peft model's adapter config goes into zeropp.json.

A save refuses weights that hold nan or inf (before writing anything), so a diverged run never
publishes a checkpoint, nor prunes a good one.

Atomic publish: ranks write into ``.step-00000120.partial``; once every rank has written, rank 0
adds zeropp.json and renames the folder to ``step-00000120``, an atomic rename on one file system
(all ranks must see the same directory). A crash before that leaves only a ``.partial`` folder,
which :func:`find_latest` never picks and the next save removes. Old checkpoints beyond
``keep_last`` are pruned after a publish, never before.

Ranks synchronise through the engine's communicator (barriers, and the state API's all-gathers,
one per unit and state). DCP also exchanges its save and load plans with small collectives of its
own; those carry metadata, not tensor data (which goes to storage), and are not in the ledger.

Loading reads into :meth:`~zeropp.engine.ZeroEngine.sharded_state_template`: each rank reads the
pieces of this run's data-parallel world (DCP reassembles them from whatever pieces were
written), so any run loads any checkpoint of the same model.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader, FileSystemWriter

from zeropp.checkpoint import adapters, changes, per_parameter, replicas, residuals
from zeropp.checkpoint.failures import reason, write_failure
from zeropp.checkpoint.per_parameter import CheckpointError, UnsavableStateError

if TYPE_CHECKING:
    from zeropp.engine import ZeroEngine

FORMAT = "zeropp-checkpoint/2"
FLAT_FORMAT = "zeropp-checkpoint/1"  # parameters stored flattened: export reads it, a run cannot load it
META = "zeropp.json"
_NAME = re.compile(r"^step-(\d{8})$")


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
    if not (path / META).is_file() and (latest := find_latest(path)) is not None:  # the run's folder, not a checkpoint
        raise CheckpointError(
            f"{str(path)!r} is a folder of checkpoints, not one; its newest is {str(latest)!r} "
            "(or resume with --resume auto and --checkpoint-dir set to it)"
        )
    try:
        meta = json.loads((path / META).read_text())
        if meta.get("format") not in (FORMAT, FLAT_FORMAT):
            raise ValueError(
                f"format {meta.get('format')!r}, expected {FORMAT!r} (or {FLAT_FORMAT!r}, for export only)"
            )
        FileSystemReader(str(path)).read_metadata()
    except Exception as error:  # unreadable json, truncated or foreign DCP metadata, ...
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise CheckpointError(f"checkpoint {str(path)!r} is incomplete or corrupt ({reason})") from None
    return meta


def verify_files(path: str | Path, meta: dict[str, Any]) -> None:
    """Check every file of a checkpoint against the sha256 recorded when it was published; a
    one-line CheckpointError names the first missing or damaged file."""
    path = Path(path)
    for name, digest in meta.get("files", {}).items():  # checkpoints from before checksums have none
        problem = "is missing" if not (path / name).is_file() else None
        if problem is None and _sha256(path / name) != digest:
            problem = "is damaged (its sha256 differs from the one recorded at save)"
        if problem:
            raise CheckpointError(f"checkpoint {str(path)!r}: file {name!r} {problem}")


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
    engine: ZeroEngine,
    directory: str | Path,
    step: int,
    *,
    extra: dict[str, Any] | None = None,
    keep_last: int = 0,
    frozen_base: str | Path | None = None,
) -> Path:
    """Write a checkpoint of `engine` at `step` into `directory`, publish it atomically, prune old ones.

    Collective: every rank calls it. keep_last = 0 keeps every checkpoint. `frozen_base`: the frozen
    parameters' source (a safetensors file or folder), referenced instead of saved.
    """
    directory = Path(directory)
    final = directory / checkpoint_name(step)
    partial = directory / f".{final.name}.partial"
    rank = engine.topology.rank
    base = None
    if frozen_base is not None:
        quantized = engine.config.quantized_nontrainable_weights
        base = adapters.base_reference(engine.units, engine.module, frozen_base, engine.config.precision, quantized)
    _refuse_non_finite(engine, final)
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        for stale in directory.glob(".step-*.partial"):  # a save that crashed earlier
            shutil.rmtree(stale, ignore_errors=True)
    engine.comm.barrier(engine.topology.world)
    state = _state_to_save(engine, base)
    try:
        dcp.save(state, storage_writer=FileSystemWriter(str(partial)))
    except (Exception, CheckpointException) as error:  # DCP's CheckpointException is a BaseException
        engine.comm.barrier(engine.topology.world)  # every rank is done with the folder
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        engine.comm.barrier(engine.topology.world)  # ... and nobody sees it after the error
        latest = find_latest(directory)
        previous = sum(f.stat().st_size for f in latest.iterdir()) if latest is not None else 0
        raise CheckpointError(write_failure(error, final, state, engine.topology.world_size, previous)) from None
    if rank == 0:
        described = _describe(engine, base["params"] if base else ())
        references = {"frozen_base": base, "adapter": adapters.adapter_meta(engine.module)}
        meta = {"format": FORMAT, "step": step, **described, **{k: v for k, v in references.items() if v}}
        publish(partial, final, {**meta, "extra": extra or {}})
        if keep_last:
            published = sorted(p for p in directory.iterdir() if _NAME.match(p.name))
            for old in published[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
    engine.comm.barrier(engine.topology.world)
    return final


def publish(partial: Path, final: Path, meta: dict[str, Any]) -> None:
    """Add zeropp.json (`meta` with the sha256 of every file written) to `partial` and rename it to
    `final`, replacing a checkpoint of the same step (one process)."""
    meta["files"] = {p.name: _sha256(p) for p in sorted(partial.iterdir()) if p.is_file()}
    (partial / META).write_text(json.dumps(meta, indent=1))
    if final.exists():  # the same step saved again (e.g. after a restart): replace it
        shutil.rmtree(final)
    os.replace(partial, final)
    _fsync_dir(final.parent)


def _refuse_non_finite(engine: ZeroEngine, final: Path) -> None:
    """Refuse to save weights holding nan or inf (collective: one flag all-reduced over the world)."""
    bad = torch.zeros(1, device=engine.topology.device)
    with engine.states_resident():
        if not all(bool(torch.isfinite(unit.master).all()) for unit in engine.units):
            bad.fill_(1.0)
    with engine.comm.ledger.in_phase("other"):
        engine.comm.all_reduce(bad, engine.topology.world, reduce="max")
    if bad.item():
        raise CheckpointError(
            f"not writing checkpoint {str(final)!r}: the weights hold nan or inf; the ones already there are kept"
        )


def _state_to_save(engine: ZeroEngine, base: dict[str, Any] | None = None) -> dict[str, Any]:
    try:
        saved = engine.sharded_state_dict(frozen=base is None)  # a referenced base is not gathered
    except UnsavableStateError as error:
        raise CheckpointError(str(error)) from None
    # See [Note: a frozen base by reference] (docs/design.md)
    for name in base["params"] if base else ():  # referenced, not copied
        saved.pop(per_parameter.fixed_key(name), None)
    saved = replicas.to_save(engine, saved)
    saved.update(_rng_states(engine))
    saved.update(residuals.to_save(engine))
    return saved


def _rng_states(engine: ZeroEngine) -> dict[str, torch.Tensor]:
    """This rank's generator states by checkpoint key: the CPU one, and its CUDA device's."""
    rank, device = engine.topology.rank, engine.topology.device
    states = {f"rng.rank{rank}": torch.get_rng_state()}
    if device.type == "cuda":
        states[f"rng.cuda.rank{rank}"] = torch.cuda.get_rng_state(device)
    return states


def _describe(engine: ZeroEngine, referenced: Collection[str] = ()) -> dict[str, Any]:
    """zeropp.json's description of the engine; `referenced`: frozen parameters left out of ``fixed``."""
    fixed = per_parameter.fixed_shapes(engine.units, engine.module)
    return {
        "world_size": engine.topology.world_size,
        "nodes": engine.topology.nodes,
        "tensor_parallel_size": engine.topology.tensor_parallel.size,
        "context_parallel_size": engine.topology.context_parallel.size,
        "stage": engine.config.stage,
        "params": per_parameter.parameter_shapes(engine.units),
        "fixed": {name: shape for name, shape in fixed.items() if name not in referenced},
        "aliases": per_parameter.tied_aliases(engine.units, engine.module),
        "precision": engine.config.precision,
        "optimizer": " + ".join(f"{type(o).__module__}.{type(o).__qualname__}" for o in engine.optimizers),
        "param_groups": [jsonable({k: v for k, v in g.items() if k != "params"}) for g in _groups(engine)],
        "scaler": engine.scaler.state_dict(),
        "global_step": engine.global_step,
    }


# -- loading --------------------------------------------------------------------------------------


def load_checkpoint(
    engine: ZeroEngine, path: str | Path, *, optimizer_settings: Literal["configured", "checkpoint"] = "configured"
) -> dict[str, Any]:
    """Load a checkpoint into `engine` (any world size, node count or stage); return its zeropp.json.

    Collective. The checkpoint is checked against the engine before anything is read. The engine's
    optimizer settings (lr, weight decay, betas, ...) stay as configured unless `optimizer_settings`
    is "checkpoint"; either way rank 0 names the settings that differ in one line, and a checkpoint
    saved at another stage, world size, node count, tensor-parallel size or precision in another.
    """
    meta = read_meta(path)
    if meta["format"] == FLAT_FORMAT:
        raise CheckpointError(
            f"checkpoint {str(path)!r} was written by an older zeropp ({FLAT_FORMAT}, parameters stored flattened) "
            "and cannot be resumed; export it (zeropp export CKPT model.safetensors) and start from that with --init-from"
        )
    verify_files(path, meta)
    _check_compatible(engine, meta, path, optimizer_settings)
    referenced = meta.get("frozen_base", {}).get("params", {})
    if referenced:
        adapters.check_base(engine.units, engine.module, meta, path)
    saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    replica = replicas.source_prefix(engine, meta, saved, path)  # DiLoCo's: which node's replica
    entries = {k.removeprefix(replica): e for k, e in saved.items() if k.startswith(f"{replica}optim.")}
    wanted = engine.sharded_state_template({k: (tuple(e.size), e.properties.dtype) for k, e in entries.items()})
    for name in referenced:  # the engine's own frozen parameters are the checkpoint's base (checked above)
        del wanted[per_parameter.fixed_key(name)]
    wanted = replicas.renamed(wanted, replica) | replicas.outer_template(engine, saved)
    rng = {k: torch.empty_like(v) for k, v in _rng_states(engine).items() if k in saved}
    if meta["world_size"] == engine.topology.world_size:  # a rank's stream belongs to its rank
        wanted.update(rng)
    wanted.update(residuals.to_load(engine, meta, saved, path))
    _read(wanted, path)
    engine.load_sharded_state_dict(replicas.renamed(wanted, replica, back=True))
    replicas.load_outer(engine, wanted)
    for key in rng.keys() & wanted.keys():
        if key.startswith("rng.cuda."):
            torch.cuda.set_rng_state(wanted[key], engine.topology.device)
        else:
            torch.set_rng_state(wanted[key])
    _say_changes(engine, meta, path, optimizer_settings)
    if engine.scaler.enabled and meta["precision"] == "fp16":  # a bf16/fp32 run's scale (1) means nothing here
        engine.scaler.load_state_dict(meta["scaler"])
    engine.global_step = meta["global_step"]
    return meta


def _say_changes(engine: ZeroEngine, meta: dict[str, Any], path: str | Path, optimizer_settings: str) -> None:
    """Rank 0's lines on what differs from the checkpoint; the checkpoint's optimizer settings taken if asked."""
    groups = _groups(engine)
    lines = [changes.resharding_line(meta, _describe(engine), path)]
    differ = []
    if len(groups) != len(meta["param_groups"]):  # refused above where its settings were to be taken
        ours, saved = (f"{n} param group{'s' * (n != 1)}" for n in (len(groups), len(meta["param_groups"])))
        lines.append(
            f"zeropp: keeping the configured optimizer settings ({ours}) over checkpoint {str(path)!r}'s ({saved})"
        )
    else:
        differ = changes.optimizer_differences(groups, meta["param_groups"])
    if differ and optimizer_settings == "checkpoint":
        for group, saved in zip(groups, meta["param_groups"], strict=True):
            changes.taking(group, saved)
        lines.append(
            f"zeropp: taking checkpoint {str(path)!r}'s optimizer settings over the configured: {', '.join(differ)}"
        )
    elif differ:
        lines.append(
            f"zeropp: keeping the configured optimizer settings over checkpoint {str(path)!r}'s: {', '.join(differ)}"
        )
    for line in lines:
        if line and engine.topology.rank == 0:
            print(line, flush=True)


def _groups(engine: ZeroEngine) -> list[dict[str, Any]]:
    return [group for optimizer in engine.optimizers for group in optimizer.param_groups]


def _check_compatible(engine: ZeroEngine, meta: dict[str, Any], path: str | Path, optimizer_settings: str) -> None:
    here = _describe(engine, meta.get("frozen_base", {}).get("params", {}))
    for kind in ("params", "fixed"):
        saved, ours = meta[kind], here[kind]
        for name in sorted(saved.keys() | ours.keys()):
            if saved.get(name) != ours.get(name):
                raise CheckpointError(
                    f"checkpoint {str(path)!r} holds a different model: {name!r} has shape "
                    f"{_shape(saved.get(name))} there and {_shape(ours.get(name))} here"
                )
    if meta["optimizer"] != here["optimizer"]:
        raise CheckpointError(
            f"checkpoint {str(path)!r} was saved with optimizer {meta['optimizer']}, this run uses {here['optimizer']}"
        )
    saved, ours = len(meta["param_groups"]), len(here["param_groups"])
    if saved != ours and optimizer_settings == "checkpoint":  # the states are per parameter: only settings differ
        raise CheckpointError(
            f"checkpoint {str(path)!r} has {saved} param groups and this run {ours}: its optimizer settings "
            "cannot be taken group by group; keep the configured ones"
        )


def _shape(shape: list[int] | None) -> str:
    return "(absent)" if shape is None else str(tuple(shape))


def _read(wanted: dict[str, Any], path: str | Path) -> None:
    try:
        dcp.load(wanted, storage_reader=FileSystemReader(str(path)))
    except (Exception, CheckpointException) as error:
        raise CheckpointError(f"could not read checkpoint {str(path)!r}: {reason(error)}") from None


# -- export ---------------------------------------------------------------------------------------


def export_checkpoint(path: str | Path, out: str | Path) -> dict[str, Any]:
    """Consolidate a checkpoint into one safetensors file of fp32 ``model.state_dict()`` tensors.

    Runs in one process, whatever world size saved it. Returns the checkpoint's zeropp.json.
    """
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    read_meta(path)  # a missing or damaged checkpoint is named before the output
    out = Path(out)
    if out.is_dir():
        raise CheckpointError(f"cannot write {str(out)!r}: it is a directory; expected a file name")
    if not out.parent.is_dir() or not os.access(out.parent, os.W_OK):
        raise CheckpointError(f"cannot write {str(out)!r}: its folder does not exist or is not writable")
    meta, tensors = consolidated_state(path)
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out), metadata={"step": str(meta["step"])})
    except (OSError, SafetensorError) as error:  # safetensors reports I/O errors as SafetensorError
        raise CheckpointError(f"could not write {str(out)!r} ({reason(error)})") from None
    return meta


def consolidated_state(
    path: str | Path, *, trained_only: bool = False
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A checkpoint's zeropp.json and its whole ``model.state_dict()`` (fp32 floating tensors, tied
    weights under every name, a referenced frozen base read from its path), read in one process
    whatever world size saved it; `trained_only`: the trained parameters alone (an adapter export)."""
    meta = read_meta(path)
    verify_files(path, meta)
    keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    masters = {key: _empty_like_saved(keys[key]) for key in map(per_parameter.model_key, meta["params"])}
    fixed_names = [] if trained_only else meta["fixed"]
    fixed = {key: _empty_like_saved(keys[key]) for key in map(per_parameter.fixed_key, fixed_names)}
    try:
        with warnings.catch_warnings():  # DCP warns that it loads in one process, which is the point here
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({**masters, **fixed}, storage_reader=FileSystemReader(str(path)), no_dist=True)
    except (Exception, CheckpointException) as error:
        raise CheckpointError(f"could not read checkpoint {str(path)!r}: {reason(error)}") from None
    # whole-shaped (0-d parameters as one element; the older format flattened every parameter)
    tensors = {name: masters[per_parameter.model_key(name)].view(shape) for name, shape in meta["params"].items()}
    if trained_only:
        return meta, tensors
    for alias, name in meta["aliases"].items():
        tensors[alias] = tensors[name].clone()  # safetensors stores no shared tensors
    for name in fixed_names:
        value = fixed[per_parameter.fixed_key(name)]
        tensors[name] = value.float() if value.is_floating_point() else value
    if "frozen_base" in meta:
        tensors.update(adapters.read_base(meta))
    return meta, tensors


# -- helpers --------------------------------------------------------------------------------------


def _empty_like_saved(metadata: Any) -> torch.Tensor:
    return torch.empty(tuple(metadata.size), dtype=metadata.properties.dtype)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.item()
    return value
