"""Pretrained weights straight into the shards: each rank reads only the slices its shards need.

Sources: a safetensors file, or a folder holding ``model.safetensors`` or shards listed in
``model.safetensors.index.json`` (the Hugging Face layout; ``zeropp export`` writes the first
kind). Keys are the model's ``state_dict()`` names; a tied weight may be stored under any of its
names. Every key is checked against the model (names and shapes) before anything is read, and every
problem gets one line, like ``load_state_dict(strict=True)``.

Reading: a unit's fp32 master shard covers a contiguous range of its flat buffer, which crosses
parameters; for each parameter it touches, the rows holding that range are read with safetensors'
lazy slicing (``get_slice``) and cut to the elements needed, so a rank reads about its 1/N of the
model (whole rows at the edges). With tensor parallelism the flat buffer holds each parameter's
tensor-parallel piece, one block of the whole tensor or several side by side (GPT-2's strided
c_attn, :func:`~zeropp.zero.weights.dtensor_params.blocks`): the rows read are rows of those blocks. At
stage 3 a unit's frozen parameters are read the same way into their compute-dtype shard; buffers
(and frozen parameters below stage 3), which every rank keeps whole, are read whole. Optimizer state is left as it is.

A peft model's base (``base_only``) is read from the base model's own weights: the frozen parameters
and buffers under the base's names (:func:`base_name`), the trainable adapters left as they are.
"""

from __future__ import annotations

import json
import math
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from zeropp.checkpoint import per_parameter as state
from zeropp.errors import ZeroppError
from zeropp.index.flat import FlatLayout
from zeropp.zero.weights.dtensor_params import blocks

if TYPE_CHECKING:
    from zeropp.engine import ZeroEngine

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
PEFT_PREFIX = "base_model.model."


class PretrainedError(ZeroppError, RuntimeError):
    """Weights that cannot be loaded: one line per problem, each naming the key or file."""


def weight_files(path: str | Path) -> dict[str, Path]:
    """{key: file holding it} for a safetensors file or a Hugging Face folder."""
    path = Path(path)
    if path.is_file():
        files = [path]
    elif (path / INDEX).is_file():
        try:
            weight_map = json.loads((path / INDEX).read_text())["weight_map"]
        except (ValueError, KeyError) as error:
            raise PretrainedError(f"{str(path / INDEX)!r} is not a safetensors index ({error})") from None
        return {key: path / name for key, name in weight_map.items()}
    elif (path / SINGLE).is_file():
        files = [path / SINGLE]
    else:
        raise PretrainedError(f"{str(path)!r} is neither a safetensors file nor a folder with {SINGLE} or {INDEX}")
    keys: dict[str, Path] = {}
    for file in files:
        with open_safetensors(file) as f:
            keys.update(dict.fromkeys(f.keys(), file))
    return keys


def base_name(name: str) -> str:
    """The base model's own name of a frozen parameter of a peft model (``base_model.model.`` and
    ``.base_layer`` dropped); other names unchanged."""
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def load_pretrained(engine: ZeroEngine, path: str | Path, *, base_only: bool = False) -> None:
    """Set the engine's weights from `path` (collective only in that every rank must call it); with
    `base_only` a peft model's frozen base and buffers from the base model's weights."""
    files = weight_files(path)
    with ExitStack() as stack:
        handles = {file: stack.enter_context(open_safetensors(file)) for file in set(files.values())}
        sources = _match(engine, {key: handles[file] for key, file in files.items()}, base_only)
        stack.enter_context(engine.states_resident(changes=True))  # the disk tier's masters, written back
        for unit in engine.units:
            start, stop = unit.layout.shard_range(unit.groups.shard.rank) if unit.shard_world > 1 else (0, None)
            stop = unit.layout.padded_numel if stop is None else stop
            if not base_only:
                unit.load_master_shard(_read_shard(unit.layout, unit.names, unit.params, sources, start, stop))
            if unit.frozen is not None:  # stage 3: frozen parameters straight into their shard, like the masters
                frozen = unit.frozen
                unit.reshard()
                frozen.load_shard(_read_shard(frozen.layout, frozen.names, frozen.params, sources, *frozen.span))
        for name, tensor in state.fixed_tensors(engine.units, engine.module, whole=False).items():
            key, handle = sources[name]
            tensor.copy_(handle.get_tensor(key))


def _read_shard(
    layout: FlatLayout, names: list[str], params: list[torch.Tensor], sources: dict, start: int, stop: int
) -> torch.Tensor:
    """Elements [start, stop) of the flat buffer of `params` (laid out by `layout`), read from `sources`, in fp32."""
    shard = torch.zeros(stop - start, dtype=torch.float32)
    for index, name in enumerate(names):
        first, last = layout.param_range(index)
        lo, hi = max(first, start), min(last, stop)
        if lo < hi:
            key, handle = sources[name]
            piece = layout.shapes[index], params[index]
            shard[lo - start : hi - start] = _read_elements(handle, key, lo - first, hi - first, *piece)
    return shard


def open_safetensors(file: Path) -> Any:
    try:
        return safe_open(str(file), framework="pt")
    except Exception as error:  # missing file, not safetensors, truncated header, ...
        raise PretrainedError(f"cannot read {str(file)!r} ({str(error).splitlines()[0]})") from None


def _match(engine: ZeroEngine, stored: dict[str, Any], base_only: bool) -> dict[str, tuple[str, Any]]:
    """{tensor name: (stored key, file handle)} for every managed (unless `base_only`) and fixed tensor;
    raise one line per missing, unexpected or wrongly shaped tensor."""
    wanted = {} if base_only else dict(state.parameter_shapes(engine.units))
    wanted.update(state.fixed_shapes(engine.units, engine.module))
    names_of: dict[str, list[str]] = {name: [base_name(name) if base_only else name] for name in wanted}
    for alias, name in state.tied_aliases(engine.units, engine.module).items():
        names_of.get(name, []).append(alias)
    problems, sources, used = [], {}, set()
    for name, shape in wanted.items():
        key = next((k for k in names_of[name] if k in stored), None)
        if key is None:
            problems.append(f"missing key {name!r} (expected shape {tuple(shape)})")
            continue
        used.update(k for k in names_of[name] if k in stored)
        found = list(stored[key].get_slice(key).get_shape())
        if found != shape:
            problems.append(f"key {key!r} has shape {tuple(found)} there and {tuple(shape)} in the model")
        sources[name] = (key, stored[key])
    problems += [f"unexpected key {key!r}" for key in sorted(stored.keys() - used)]
    if problems:
        raise PretrainedError("\n".join(problems))
    return sources


def _read_elements(
    handle: Any, key: str, start: int, stop: int, shape: tuple[int, ...], param: torch.Tensor
) -> torch.Tensor:
    """Elements [start, stop) of this rank's piece of tensor `key`, of `shape`, flattened (a
    tensor-parallel piece of `param`, else the whole tensor), reading only the rows of the piece's
    blocks (:func:`~zeropp.zero.weights.dtensor_params.blocks`) that hold them."""
    if not shape:
        return handle.get_tensor(key).reshape(1).float()
    row = math.prod(shape[1:])
    first, last = start // row, math.ceil(stop / row)
    rows = torch.empty((last - first, *shape[1:]))
    for piece, where in blocks(param, (first, last)):
        rows[piece] = handle.get_slice(key)[where]
    return rows.reshape(-1)[start - first * row : stop - first * row]
