"""The engine's training state as per-parameter tensors, independent of how it is sharded.

One layout serves checkpoints (save, load on any world size, node count or stage), the
consolidated ``full_state_dict`` and export. Keys:

- ``model.<name>``: the fp32 master of parameter <name>, flattened, as a DTensor cut over the
  data-parallel ranks in ``torch.chunk`` pieces (``Shard(0)``): each rank holds its piece;
- ``optim.<name>.<key>``: the optimizer's per-element state of that parameter the same way, and
  its scalar states (Adam's ``step``) whole on every rank;
- ``fixed.<name>``: what the engine keeps whole on every rank (frozen parameters, buffers).

A unit's fp32 master is a contiguous shard of a padded flat buffer that spans several
parameters; the pieces here are cut per parameter. Going from one to the other is one all-gather
per unit and per state (see :meth:`~zeropp.units.FlatUnit.param_chunks` and
:meth:`~zeropp.units.FlatUnit.flat_from_param_chunks`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from zeropp.partition import chunk_range
from zeropp.units import FlatUnit


def model_key(name: str) -> str:
    return f"model.{name}"


def optim_key(name: str, key: str) -> str:
    return f"optim.{name}.{key}"


def fixed_key(name: str) -> str:
    return f"fixed.{name}"


def optimizer_state_name(key: str) -> str | None:
    """<key> of an ``optim.<name>.<key>`` entry (None for other entries)."""
    return key.rsplit(".", 1)[1] if key.startswith("optim.") else None


class StateError(RuntimeError):
    """The optimizer keeps state this layout cannot express. One line."""


def _dtensor(local: torch.Tensor, numel: int, mesh: DeviceMesh) -> DTensor:
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=(numel,), stride=(1,))


def sharded_state_dict(
    units: list[FlatUnit], optimizer: torch.optim.Optimizer, module: nn.Module, mesh: DeviceMesh
) -> dict[str, Any]:
    """The state in the layout above (collective: gathers one unit's flat buffers at a time)."""
    state: dict[str, Any] = {}
    for unit in units:
        numels = unit.layout.numels
        for name, numel, piece in zip(unit.names, numels, unit.param_chunks(unit.master.data), strict=True):
            state[model_key(name)] = _dtensor(piece, numel, mesh)
        for key, value in optimizer.state.get(unit.master, {}).items():
            if isinstance(value, torch.Tensor) and value.shape == unit.master.shape:
                pieces = unit.param_chunks(value)
                for name, numel, piece in zip(unit.names, numels, pieces, strict=True):
                    state[optim_key(name, key)] = _dtensor(piece, numel, mesh)
            elif isinstance(value, torch.Tensor) and value.dim() == 0:
                state.update({optim_key(name, key): value.clone() for name in unit.names})
            else:
                raise StateError(
                    f"optimizer state {key!r} of {type(optimizer).__name__} is neither per-element "
                    "nor a scalar tensor; zeropp checkpoints support elementwise optimizers only"
                )
    state.update({fixed_key(name): t for name, t in fixed_tensors(units, module).items()})
    return state


def sharded_state_template(
    units: list[FlatUnit],
    module: nn.Module,
    mesh: DeviceMesh,
    optimizer_keys: Mapping[str, tuple[bool, torch.dtype]],
) -> dict[str, Any]:
    """Empty tensors in the layout above, to load into (``fixed`` entries are the module's own).

    `optimizer_keys` maps each optimizer state key to (per-element, dtype); the optimizer may hold
    no state yet."""
    state: dict[str, Any] = {}
    for unit in units:
        device, group = unit.options.device, unit.groups.shard
        for name, numel in zip(unit.names, unit.layout.numels, strict=True):
            start, stop = chunk_range(numel, group.size, group.rank)
            local = stop - start
            state[model_key(name)] = _dtensor(torch.empty(local, device=device), numel, mesh)
            for key, (per_element, dtype) in optimizer_keys.items():
                empty = torch.empty(local if per_element else (), dtype=dtype, device=device)
                state[optim_key(name, key)] = _dtensor(empty, numel, mesh) if per_element else empty
    state.update({fixed_key(name): t for name, t in fixed_tensors(units, module).items()})
    return state


def load_sharded_state_dict(
    units: list[FlatUnit], optimizer: torch.optim.Optimizer, module: nn.Module, state: Mapping[str, Any]
) -> None:
    """Set masters, weights and optimizer state from `state` (layout above; collective)."""
    for unit in units:
        master = [state[model_key(name)].to_local() for name in unit.names]
        unit.load_master(unit.flat_from_param_chunks(master))
        prefix = optim_key(unit.names[0], "")
        loaded = {}
        for key in sorted(k[len(prefix) :] for k in state if k.startswith(prefix)):
            values = [state[optim_key(name, key)] for name in unit.names]
            if isinstance(values[0], DTensor):
                flat = unit.flat_from_param_chunks([v.to_local() for v in values])
                loaded[key] = unit.shard_of(flat).to(unit.master.device, copy=True)
            else:
                loaded[key] = values[0]
        if loaded:
            optimizer.state[unit.master] = loaded
        unit.clear_gradients()
    for name, target in fixed_tensors(units, module).items():
        source = state.get(fixed_key(name))
        if source is not None and source is not target:
            target.copy_(source)


def full_state_dict(units: list[FlatUnit], module: nn.Module) -> dict[str, torch.Tensor]:
    """The consolidated fp32 model state (``model.state_dict()`` keys), on CPU, on every rank."""
    full: dict[int, torch.Tensor] = {}
    for unit in units:
        flat = unit.gather_flat(unit.master.data)
        for p, view in zip(unit.params, unit.layout.split(flat), strict=True):
            full[id(p)] = _whole(p, view).to("cpu", copy=True)
    state = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) in full:
            state[name] = full[id(tensor)]
        else:  # frozen parameters and buffers: floating ones back to fp32, others unchanged
            dtype = torch.float32 if tensor.is_floating_point() else tensor.dtype
            state[name] = tensor.detach().to("cpu", dtype, copy=True)
    return state


def _whole(param: nn.Parameter, local: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value from this rank's piece: a tensor-parallel DTensor parameter's pieces
    gathered over its mesh (collective), any other as it is."""
    if not isinstance(param, DTensor):
        return local
    mesh, placements = param.device_mesh, param.placements
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=param.shape, stride=param.stride()).full_tensor()


def _managed(units: list[FlatUnit]) -> Iterator[tuple[str, nn.Parameter]]:
    for unit in units:
        yield from zip(unit.names, unit.params, strict=True)


def fixed_tensors(units: list[FlatUnit], module: nn.Module) -> dict[str, torch.Tensor]:
    """Frozen parameters and buffers: what the engine keeps whole on every rank."""
    managed = {id(p) for _, p in _managed(units)}
    return {
        name: tensor.detach() for name, tensor in module.state_dict(keep_vars=True).items() if id(tensor) not in managed
    }


def parameter_shapes(units: list[FlatUnit]) -> dict[str, list[int]]:
    return {name: list(p.shape) for name, p in _managed(units)}


def tied_aliases(units: list[FlatUnit], module: nn.Module) -> dict[str, str]:
    """state_dict keys that name an already listed parameter (tied weights): key -> parameter name."""
    owner = {id(p): name for name, p in _managed(units)}
    return {
        key: owner[id(tensor)]
        for key, tensor in module.state_dict(keep_vars=True).items()
        if id(tensor) in owner and owner[id(tensor)] != key
    }
