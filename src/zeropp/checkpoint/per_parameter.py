"""The engine's training state as per-parameter tensors, independent of how it is sharded.

One form serves checkpoints (save, load on any world size, node count or stage), the
consolidated ``full_state_dict`` and export. Keys:

- ``model.<name>``: the fp32 master of parameter <name>, a DTensor of the parameter's whole shape
  (a 0-d parameter as one element) on :class:`CheckpointMesh`: each rank holds its piece;
- ``optim.<name>.<key>``: the optimizer's per-element state of that parameter the same way, and
  its scalar states (Adam's ``step``) whole on every rank;
- ``fixed.<name>``: what the optimizer does not touch, whole: buffers and frozen parameters (at
  stage 3 the units' frozen parameters are gathered whole to be saved: :func:`fixed_tensors`).

A rank's piece of a parameter: its tensor-parallel piece (the DTensor parameter's own placement;
a parameter the plan left whole is replicated over the tensor-parallel ranks), whose rows are cut
like ``torch.chunk`` over the data-parallel ranks. Every piece is a block of the whole tensor
with its offsets, or several side by side (a strided tensor-parallel piece, GPT-2's fused
[q | k | v]: :func:`~zeropp.zero.weights.dtensor_params.blocks`), which DCP is told as one chunk each
(:func:`_written_as_blocks`). So DCP reshards between meshes by itself: a checkpoint of dp 2 x tp 2
loads at dp 4, at dp 1 x tp 2 and on one rank, and the names and shapes never depend on the mesh.

A unit's fp32 master is a contiguous shard of a padded flat buffer that spans several
parameters' tensor-parallel pieces; the pieces here are cut per parameter. Going from one to the
other is one all-gather per unit and per state (see :func:`param_chunks`
and :func:`flat_from_param_chunks`).
"""

from __future__ import annotations

import math
from collections.abc import Container, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from zeropp.comm.communicator import Communicator
from zeropp.errors import ZeroppError
from zeropp.index.flat import chunk_range
from zeropp.zero.unit import FlatUnit
from zeropp.zero.weights.dtensor_params import Slices, blocks, expert_group, whole_shape

EXPERTS_OP = "ep.whole_experts"  # an expert-parallel parameter's experts gathered whole (full_state_dict)

if TYPE_CHECKING:
    from zeropp.topology import Group, Topology
    from zeropp.zero.optim.owners import WholeParameterStep
    from zeropp.zero.optim.stepping import Stepper


def model_key(name: str) -> str:
    return f"model.{name}"


def optim_key(name: str, key: str) -> str:
    return f"optim.{name}.{key}"


def fixed_key(name: str) -> str:
    return f"fixed.{name}"


def optimizer_entries(entries: Iterable[str], names: Container[str]) -> Iterator[tuple[str, str, str]]:
    """(entry, parameter name, state key) of each ``optim.<name>.<key>`` entry of `entries` whose
    parameter is one of `names`."""
    for entry in entries:
        name, _, key = entry.removeprefix("optim.").rpartition(".")
        if entry.startswith("optim.") and name in names:
            yield entry, name, key


class CheckpointError(ZeroppError, RuntimeError):
    """A checkpoint cannot be written or read. The message is one line and says what to do."""


class UnsavableStateError(ZeroppError, RuntimeError):
    """The optimizer keeps state this per-parameter form cannot express. One line."""


class CheckpointMesh:
    """Every rank as the mesh a parameter's state is cut over: the tensor-parallel dimension first,
    then the data-parallel one (so a rank's rows are rows of its tensor-parallel piece). A dimension
    of one rank is left out (it has no process group); one rank alone is a mesh of one."""

    def __init__(self, topology: Topology, data_parallel: Group | None = None) -> None:
        """`data_parallel`: the group the units shard over (the world's data-parallel group, or with
        DiLoCo a node's: See [Note: the outer loop])."""
        tp, dp = topology.tensor_parallel, data_parallel or topology.data_parallel
        self.data_parallel = dp
        self.dims = tuple(name for name, group in (("tp", tp), ("dp", dp)) if group.size > 1) or ("dp",)
        device = topology.device.type
        if len(self.dims) == 2:  # [tp index, dp index] -> rank: a tensor-parallel group is a run of ranks
            grid = torch.tensor([[rank - tp.rank + t for rank in dp.ranks] for t in range(tp.size)])
            self.mesh = DeviceMesh.from_group([tp.pg, dp.pg], device, grid, mesh_dim_names=self.dims)
        else:  # a data-parallel group of one rank (DiLoCo's node of one) has no process group of its own
            group = tp if self.dims == ("tp",) else dp
            self.mesh = DeviceMesh.from_group(group.pg or topology.alone().pg, device)

    def piece(self, local: torch.Tensor, param: nn.Parameter, local_shape: tuple[int, ...]) -> DTensor:
        """This rank's flat row chunk `local` of `param` (whose tensor-parallel piece has `local_shape`) as
        a DTensor of the parameter's whole shape."""
        tp = param.placements[0] if isinstance(param, DTensor) else Replicate()
        placements = [tp if dim == "tp" else Shard(0) for dim in self.dims]
        shape = whole_shape(param)
        rest = local_shape[1:]
        row = math.prod(rest)
        block = (local.numel() // row if row else 0, *rest) if local_shape else (local.numel(),)
        stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
        piece = DTensor.from_local(
            local.view(block), self.mesh, placements, run_check=False, shape=shape, stride=stride
        )
        # a strided tensor-parallel piece, or this rank's experts (sharded over the ranks holding them,
        # every E-th data-parallel rank): its rows' blocks of the whole tensor
        experts, dp = expert_group(param), self.data_parallel
        holders, holder = (dp.size // experts.size, dp.rank // experts.size) if experts else (dp.size, dp.rank)
        if experts is not None or len(blocks(param)) > 1:
            start, _ = chunk_range(local_shape[0], holders, holder)
            _written_as_blocks(piece, blocks(param, (start, start + block[0])))
        return piece


def _written_as_blocks(piece: DTensor, pieces: list[tuple[Slices, Slices]]) -> None:
    """Have DCP write and read `piece` as the blocks `pieces` of the whole tensor (where in the local
    tensor, where in the whole), one chunk each: DTensor hands DCP's checkpoint questions to its
    local tensor where that answers them (as it does for a local ShardedTensor)."""
    local = piece._local_tensor
    chunks = [
        ChunkStorageMetadata(torch.Size(s.start for s in where), torch.Size(s.stop - s.start for s in where))
        for _, where in pieces
    ]
    views = {chunk.offsets: mine for chunk, (mine, _) in zip(chunks, pieces, strict=True)}
    properties = TensorProperties.create_from_tensor(local)
    local.__create_chunk_list__ = lambda: chunks
    local.__get_tensor_shard__ = lambda index: local[views[index.offset]]
    local.__create_write_items__ = lambda fqn, whole: [
        WriteItem(
            MetadataIndex(fqn, chunk.offsets),
            WriteItemType.SHARD,
            tensor_data=TensorWriteData(chunk=chunk, properties=properties, size=whole.size()),
        )
        for chunk in chunks
    ]


def sharded_state_dict(
    units: list[FlatUnit], states: Stepper | None, module: nn.Module, mesh: CheckpointMesh, frozen: bool = True
) -> dict[str, Any]:
    """The state in the layout above (collective: gathers one unit's flat buffers at a time); without
    `frozen`, the units' frozen parameters are left out; without `states` (the whole-parameter path:
    :func:`owned_state_entries`), the masters' optimizer state too."""
    state: dict[str, Any] = {}
    for k, unit in enumerate(units):
        params = list(zip(unit.names, unit.params, unit.layout.shapes, strict=True))
        for (name, param, shape), piece in zip(params, param_chunks(unit, unit.master.data), strict=True):
            state[model_key(name)] = mesh.piece(piece, param, shape)
        flat, scalars = states.unit_state(k) if states is not None else ({}, {})
        for key, value in flat.items():
            for (name, param, shape), piece in zip(params, param_chunks(unit, value), strict=True):
                state[optim_key(name, key)] = mesh.piece(piece, param, shape)
        for key, by_index in scalars.items():
            for index, value in by_index.items():
                if not (isinstance(value, torch.Tensor) and value.dim() == 0):
                    raise UnsavableStateError(
                        f"optimizer state {key!r} of {type(states.optimizers[0]).__name__} is neither per-element "
                        "nor a scalar tensor; zeropp checkpoints support elementwise optimizers only"
                    )
                state[optim_key(unit.names[index], key)] = value.clone()
    state.update({fixed_key(name): t for name, t in fixed_tensors(units, module, frozen).items()})
    return state


def sharded_state_template(
    units: list[FlatUnit],
    module: nn.Module,
    mesh: CheckpointMesh,
    saved: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
) -> dict[str, Any]:
    """Empty tensors in the layout above, to load into (``fixed`` entries are the module's own, or
    empty whole tensors for the units' frozen parameters).

    `saved`: the shape and dtype of each optimizer state entry of the checkpoint (a parameter never
    stepped has no scalar entries); the optimizer may hold no state yet."""
    state: dict[str, Any] = {}
    keys: dict[str, dict[str, tuple[bool, torch.dtype]]] = {}
    for entry, name, key in optimizer_entries(saved, {name for unit in units for name in unit.names}):
        shape, dtype = saved[entry]
        keys.setdefault(name, {})[key] = (len(shape) > 0, dtype)
    for unit in units:
        for index, name in enumerate(unit.names):
            state[model_key(name)] = empty_piece(unit, index, mesh)
            for key, (per_element, dtype) in keys.get(name, {}).items():
                empty = torch.empty((), dtype=dtype, device=unit.options.device)
                state[optim_key(name, key)] = empty_piece(unit, index, mesh, dtype) if per_element else empty
    state.update({fixed_key(name): t for name, t in fixed_tensors(units, module, whole=False).items()})
    for unit in units:
        frozen = unit.frozen.names if unit.frozen is not None else ()
        for name, shape in zip(frozen, unit.frozen.layout.shapes if frozen else (), strict=True):
            state[fixed_key(name)] = torch.empty(shape, dtype=unit.compute_dtype, device=unit.options.device)
    return state


def empty_piece(unit: FlatUnit, index: int, mesh: CheckpointMesh, dtype: torch.dtype = torch.float32) -> DTensor:
    """An empty piece of `unit`'s parameter `index`, as :meth:`CheckpointMesh.piece` cuts it, to load into."""
    group, layout = unit.groups.shard, unit.layout
    start, stop = layout.row_chunk(index, group.size, group.rank)
    empty = torch.empty(stop - start, dtype=dtype, device=unit.options.device)
    return mesh.piece(empty, unit.params[index], layout.shapes[index])


def load_sharded_state_dict(
    units: list[FlatUnit], states: Stepper | None, module: nn.Module, state: Mapping[str, Any]
) -> None:
    """Set masters, weights and optimizer state from `state` (layout above; collective)."""
    keys: dict[str, set[str]] = {}  # parameter name -> its saved optimizer state keys
    for _, name, key in optimizer_entries(state, {name for unit in units for name in unit.names}):
        keys.setdefault(name, set()).add(key)
    for k, unit in enumerate(units):
        if unit.names:  # a unit of frozen parameters only has no master to load
            unit_keys = sorted(set().union(*(keys.get(name, ()) for name in unit.names)))
            _load_master_and_optimizer(k, unit, states, state, unit_keys)
        unit.clear_gradients()
    for name, target in fixed_tensors(units, module, whole=False).items():
        source = state.get(fixed_key(name))
        if source is not None and source is not target:
            target.copy_(source)
    for unit in units:
        if unit.frozen is not None and all(fixed_key(name) in state for name in unit.frozen.names):
            unit.reshard()
            unit.frozen.load([state[fixed_key(name)] for name in unit.frozen.names])


def _load_master_and_optimizer(
    k: int, unit: FlatUnit, states: Stepper | None, state: Mapping[str, Any], keys: list[str]
) -> None:
    """`keys`: the optimizer state keys any of the unit's parameters has in `state`, in order."""
    master = [state[model_key(name)].to_local() for name in unit.names]
    unit.load_master(flat_from_param_chunks(unit, master))
    if states is None:  # the whole-parameter path: load_owned_states
        return
    flat, scalars = {}, {}
    for key in keys:
        values = {i: state.get(optim_key(name, key)) for i, name in enumerate(unit.names)}
        if any(isinstance(v, DTensor) for v in values.values()):
            whole = flat_from_param_chunks(unit, [v.to_local() for v in values.values()])
            flat[key] = unit.shard_of(whole).to(unit.master.device, copy=True)
        else:
            scalars[key] = {i: v for i, v in values.items() if v is not None}
    states.load_unit_state(k, flat, scalars)


# -- the whole-parameter path (See [Note: the whole-parameter step]) ----------------------------------
# Each owner writes its parameters' ``optim.<name>.<key>`` whole, as its optimizer keeps them: a
# per-element state has the parameter's shape (a flat-path load reads its own pieces of it), others
# (Adafactor's factored moments, a step count) their own shapes; no other rank writes those keys, so
# DCP takes them from the owner, and a load at any world size reads them whole on the new owners.


# A Python number in a state (bitsandbytes' ``step``) is written as a 0-d int64 or float64 tensor and
# read back as the number: torch's own optimizers keep their 0-d states in float32.
PYTHON_NUMBERS = {torch.int64: int, torch.float64: float}


def owned_state_entries(whole: WholeParameterStep) -> dict[str, torch.Tensor]:
    entries = {}
    for name in whole.owned:
        for key, value in whole.owned_state(name).items():
            if type(value) in (int, float):
                value = torch.tensor(value, dtype=torch.int64 if type(value) is int else torch.float64)
            if type(value) is not torch.Tensor:  # a tensor subclass (torchao's quantized states) would load dense
                raise UnsavableStateError(
                    f"optimizer state {key!r} of {name!r} is a {type(value).__name__}, not a plain tensor; "
                    "zeropp checkpoints save plain tensors (save the weights with engine.full_state_dict())"
                )
            entries[optim_key(name, key)] = value
    return entries


def owned_state_template(
    whole: WholeParameterStep, saved: Mapping[str, tuple[tuple[int, ...], torch.dtype]]
) -> dict[str, torch.Tensor]:
    """Empty tensors for the saved entries (`saved`: shape and dtype by key) of the owned parameters;
    a 0-d state on the host, where torch's optimizers keep their step counts."""
    return {
        entry: torch.empty(
            saved[entry][0], dtype=saved[entry][1], device=whole.owned_device(name) if saved[entry][0] else "cpu"
        )
        for entry, name, _ in optimizer_entries(saved, whole.owned)
    }


def load_owned_states(whole: WholeParameterStep, state: Mapping[str, Any]) -> None:
    states: dict[str, dict[str, Any]] = {name: {} for name in whole.owned}
    for entry, name, key in optimizer_entries(state, whole.owned):
        value = state[entry]
        number = PYTHON_NUMBERS.get(value.dtype) if value.dim() == 0 else None
        states[name][key] = value if number is None else number(value.item())
    whole.load_owned_states(states)


def full_state_dict(units: list[FlatUnit], module: nn.Module) -> dict[str, torch.Tensor]:
    """The consolidated fp32 model state (``model.state_dict()`` keys), on CPU, on every rank."""
    full: dict[int, torch.Tensor] = {}
    for unit in units:
        flat = unit.gather_flat(unit.master.data)
        for p, view in zip(unit.params, unit.layout.split(flat), strict=True):
            full[id(p)] = _whole(p, view, unit.comm).to("cpu", torch.float32, copy=True)  # a bf16 master too
    for unit in units:  # frozen parameters of units (stage 3): gathered whole, in fp32
        if unit.frozen is not None:
            for p, value in zip(unit.frozen.params, unit.frozen.whole(), strict=True):
                full[id(p)] = value.to("cpu", torch.float32)
    state = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) in full:
            state[name] = full[id(tensor)]
        else:  # frozen parameters and buffers: floating ones back to fp32, others unchanged
            dtype = torch.float32 if tensor.is_floating_point() else tensor.dtype
            state[name] = tensor.detach().to("cpu", dtype, copy=True)
    return state


def _whole(param: nn.Parameter, local: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """A parameter's whole value from this rank's piece: a tensor-parallel DTensor parameter's pieces
    gathered over its mesh, an expert-parallel one's experts over its group (collective), any other
    as it is."""
    experts = expert_group(param)
    if experts is not None:
        every = local.new_empty((experts.size, *local.shape))
        comm.all_gather(every, local.contiguous(), experts, bucket_numel=local.numel(), label=EXPERTS_OP)
        return every.flatten(0, 1)
    if not isinstance(param, DTensor):
        return local
    mesh, placements = param.device_mesh, param.placements
    return DTensor.from_local(
        local, mesh, placements, run_check=False, shape=param.shape, stride=param.stride()
    ).full_tensor()


def _managed(units: list[FlatUnit]) -> Iterator[tuple[str, nn.Parameter]]:
    for unit in units:
        yield from zip(unit.names, unit.params, strict=True)


def _unit_frozen(units: list[FlatUnit]) -> Iterator[tuple[str, nn.Parameter]]:
    for unit in units:
        if unit.frozen is not None:
            yield from zip(unit.frozen.names, unit.frozen.params, strict=True)


def fixed_tensors(units: list[FlatUnit], module: nn.Module, whole: bool = True) -> dict[str, torch.Tensor]:
    """Buffers and frozen parameters by ``state_dict`` name: the module's own tensors, and with `whole`
    the units' frozen parameters (stage 3) gathered whole, new tensors (collective); without it those
    are left out."""
    managed = {id(p) for _, p in (*_managed(units), *_unit_frozen(units))}
    fixed = {
        name: tensor.detach() for name, tensor in module.state_dict(keep_vars=True).items() if id(tensor) not in managed
    }
    for unit in units if whole else ():
        if unit.frozen is not None:
            fixed.update(zip(unit.frozen.names, unit.frozen.whole(), strict=True))
    return fixed


def fixed_shapes(units: list[FlatUnit], module: nn.Module) -> dict[str, list[int]]:
    """The shapes of :func:`fixed_tensors` (nothing gathered)."""
    shapes = {name: list(t.shape) for name, t in fixed_tensors(units, module, whole=False).items()}
    shapes.update({name: list(p.shape) for name, p in _unit_frozen(units)})
    return shapes


def parameter_shapes(units: list[FlatUnit]) -> dict[str, list[int]]:
    return {name: list(whole_shape(p)) if p.dim() else [] for name, p in _managed(units)}


def tied_aliases(units: list[FlatUnit], module: nn.Module) -> dict[str, str]:
    """state_dict keys that name an already listed parameter (tied weights): key -> parameter name."""
    owner = {id(p): name for name, p in _managed(units)}
    return {
        key: owner[id(tensor)]
        for key, tensor in module.state_dict(keep_vars=True).items()
        if id(tensor) in owner and owner[id(tensor)] != key
    }


def param_chunks(unit: FlatUnit, shard: torch.Tensor) -> list[torch.Tensor]:
    """This rank's piece of every parameter of `unit`'s flat buffer whose shard is `shard`: its rows
    cut like ``torch.chunk`` over the shard group (:meth:`FlatLayout.row_chunk`), flattened; the
    sharding-independent layout of checkpoints. Collective."""
    flat, group = unit.gather_flat(shard), unit.groups.shard
    pieces = []
    for index, view in enumerate(unit.layout.split(flat)):
        start, stop = unit.layout.row_chunk(index, group.size, group.rank)
        pieces.append(view.reshape(-1)[start:stop].clone())
    return pieces


def flat_from_param_chunks(unit: FlatUnit, chunks: list[torch.Tensor]) -> torch.Tensor:
    """The whole padded flat buffer from every rank's :func:`param_chunks` (one all-gather).

    Each rank sends its chunks padded to the largest chunk size of each parameter (rank 0's), so
    the pieces are equal; row r of the gathered matrix holds rank r's chunks, and a parameter's
    chunks read in rank order, cut to its n elements, are the parameter (every chunk but the
    last ones is the largest size)."""
    group, layout = unit.groups.shard, unit.layout
    widths = [stop - start for start, stop in (layout.row_chunk(i, group.size, 0) for i in range(len(chunks)))]
    offsets = [sum(widths[:i]) for i in range(len(widths))]
    send = torch.zeros(sum(widths), dtype=chunks[0].dtype, device=unit.options.device)
    for chunk, offset in zip(chunks, offsets, strict=True):
        send[offset : offset + chunk.numel()].copy_(chunk.reshape(-1))
    rows = torch.empty(group.size * send.numel(), dtype=send.dtype, device=send.device)
    unit.comm.all_gather(rows, send, group, bucket_numel=unit.allgather_bucket)
    rows = rows.view(group.size, -1)
    numels = layout.numels
    params = [rows[:, o : o + w].reshape(-1)[:n] for o, w, n in zip(offsets, widths, numels, strict=True)]
    return layout.join(params, send.dtype, send.device)
