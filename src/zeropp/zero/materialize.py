"""Bringing a model onto the ranks one unit at a time: no rank ever holds the whole model.

Each unit owns a *scope*: the modules of its subtree that no nested unit owns (the root unit owns
every module outside the units). Before a unit is flattened and sharded, the tensors of its scope
are made real, one scope at a time:

- **Meta-device models** (built under ``torch.device("meta")``): the scope's meta tensors are
  allocated on the host and initialized there under a seed of the unit's own, derived from the
  engine's ``seed`` and the unit's module name. The weights are therefore the same at every world
  size, node count and stage, and on every device (initialization runs on the host). The
  initializer is ``init_fn(module)`` for every module of the scope when given; otherwise the
  module's own ``reset_parameters()`` followed by ``_init_weights(module)`` of the outermost module
  around it that has one, the root or a model nested in a wrapper (the convention of Hugging Face models and of nanoGPT-style models, which also computes
  Hugging Face's rotary ``inv_freq`` buffers). A module is initialized only when every tensor it
  holds directly is still on the meta device (a tensor shared with an already materialized unit is
  never written twice). Every tensor is filled with a sentinel (NaN, or the smallest integer) first:
  one that no initializer wrote is refused in one line, rather than trained from garbage. A
  parameter split by tensor parallelism (a DTensor) is initialized whole, in the same order and
  under the same seed, and this rank keeps its piece: the weights do not depend on the
  tensor-parallel size either (the scope's split parameters exist whole on the host meanwhile).
- **Materialized models** (on the host or a device): every rank must start from rank 0's values,
  as with DistributedDataParallel. Each unit's parameters go to the device as one flat fp32 buffer
  that is broadcast once (:class:`~zeropp.zero.unit.FlatUnit` with ``broadcast_initial``), and the
  scope's other tensors (frozen parameters, buffers) are broadcast packed into one buffer per dtype.

Either way the scope's frozen parameters and floating buffers end on the device in the compute
dtype, like the managed parameters; the whole model is never moved with ``model.to``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from zeropp.comm.communicator import Communicator
from zeropp.errors import ZeroppError
from zeropp.topology import Group
from zeropp.zero.weights.dtensor_params import block_of, expert_group, point_at, whole_shape

if TYPE_CHECKING:
    from zeropp.topology import ShardGroups
    from zeropp.zero.options import UnitOptions
    from zeropp.zero.stages import StagePolicy

InitFn = Callable[[nn.Module], None]


class MaterializeError(ZeroppError, RuntimeError):
    """A meta-device tensor that no initializer set. One line."""


def is_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def unit_scopes(model: nn.Module, unit_modules: list[nn.Module]) -> dict[int, list[tuple[str, nn.Module]]]:
    """{id(unit module): [(qualified name, module)]}: each module goes to the innermost unit module
    containing it, the rest to the root (`model`)."""
    units = {id(m) for m in unit_modules} | {id(model)}
    scopes: dict[int, list[tuple[str, nn.Module]]] = {}

    def visit(name: str, module: nn.Module, owner: int) -> None:
        owner = id(module) if id(module) in units else owner
        scopes.setdefault(owner, []).append((name, module))
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child, owner)

    visit("", model, id(model))
    return scopes


def direct_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from ((k, t) for k, t in module._parameters.items() if t is not None)
    yield from ((k, t) for k, t in module._buffers.items() if t is not None)


def host_flat(
    params: list[tuple[str, nn.Parameter]], groups: ShardGroups, policy: StagePolicy, options: UnitOptions
) -> tuple[torch.Tensor | None, dict[int, torch.Tensor]]:
    """A unit's fp32 flat buffer on the host and {id(parameter): its view}, for meta fp32
    parameters (others are initialized in their own dtype and flattened afterwards)."""
    from zeropp.zero.unit import FlatUnit

    tensors = [p for _, p in params]
    if not tensors or not all(p.is_meta and p.dtype == torch.float32 for p in tensors):
        return None, {}
    layout = FlatUnit.layout_of(tensors, groups, policy, options)
    flat = torch.zeros(layout.padded_numel, dtype=torch.float32)
    return flat, dict(zip((id(p) for p in tensors), layout.split(flat), strict=True))


def unit_seed(seed: int, unit_name: str) -> int:
    digest = hashlib.sha256(f"{seed}/{unit_name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def initialize_scope(
    scope: list[tuple[str, nn.Module]],
    root: nn.Module,
    seed: int,
    init_fn: InitFn | None,
    storage: dict[int, torch.Tensor] | None = None,
) -> None:
    """Allocate the scope's meta tensors on the host and initialize them (see the module docstring).

    `storage` maps id(tensor) to host memory to initialize it in (the unit's flat buffer, so the
    unit needs no second copy); other tensors get memory of their own."""
    storage = storage or {}
    fresh: dict[int, tuple[str, torch.Tensor]] = {}
    split: list[tuple[nn.Module, str, DTensor, torch.Tensor]] = []  # tensor parallel: (module, key, param, whole)
    initializable = []
    for name, module in scope:
        tensors = list(direct_tensors(module))
        if tensors and all(t.is_meta or id(t) in fresh for _, t in tensors):
            initializable.append(module)
        for key, tensor in tensors:
            if tensor.is_meta and (isinstance(tensor, DTensor) or expert_group(tensor) is not None):
                # a tensor-parallel or expert-parallel piece: initialized whole in its place, cut below
                whole = nn.Parameter(torch.full(whole_shape(tensor), _sentinel(tensor.dtype), dtype=tensor.dtype))
                module._parameters[key] = whole
                split.append((module, key, tensor, whole))
                tensor = whole
            elif tensor.is_meta:
                _swap_to_host(tensor, storage.get(id(tensor)))
            else:
                continue
            fresh[id(tensor)] = (f"{name}.{key}" if name else key, tensor)
    if not fresh:
        return
    init = init_fn or default_init(root)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(unit_seed(seed, scope[0][0]))
        for module in initializable:
            init(module)
    for name, tensor in fresh.values():
        if tensor.numel() and tensor.dtype != torch.bool and _all_sentinel(tensor):
            raise MaterializeError(
                f"zeropp: {name} was built on the meta device and no initializer set it; pass init_fn= to "
                "ZeroEngine (called on every module), give its module reset_parameters(), or build it for real"
            )
    for module, key, param, whole in split:  # this rank's piece of the whole values, into the unit's memory
        piece, memory = block_of(whole.detach(), param), storage.get(id(param))
        point_at(param, piece.clone() if memory is None else memory.copy_(piece))
        module._parameters[key] = param


def _swap_to_host(tensor: torch.Tensor, memory: torch.Tensor | None = None) -> None:
    """Give a meta tensor host storage in place (same object: tied weights and hooks stay), in
    `memory` when given (a view of its shape and dtype)."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype) if memory is None else memory
    host.fill_(_sentinel(tensor.dtype))
    if isinstance(tensor, nn.Parameter):
        host = nn.Parameter(host, requires_grad=tensor.requires_grad)
    torch.utils.swap_tensors(tensor, host)


def _all_sentinel(tensor: torch.Tensor) -> bool:
    if tensor.is_floating_point() or tensor.is_complex():
        return bool(tensor.isnan().all())
    return bool((tensor == _sentinel(tensor.dtype)).all())


def _sentinel(dtype: torch.dtype) -> float | int | bool:
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    return False if dtype == torch.bool else torch.iinfo(dtype).min


def default_init(root: nn.Module) -> InitFn:
    """The initializer without `init_fn`: a module's own ``reset_parameters()``, then ``_init_weights`` of
    the outermost module around it that has one: the root's, or that of a Hugging Face model nested in a
    wrapper (a LightningModule, a value head, a PeftModel), which initializes its modules as it would whole."""
    model_init: dict[int, Callable[[nn.Module], None]] = {}

    def visit(module: nn.Module, outer: Callable[[nn.Module], None] | None) -> None:
        own = getattr(module, "_init_weights", None)
        outer = outer or (own if callable(own) else None)
        if outer is not None:
            model_init.setdefault(id(module), outer)
        for child in module.children():
            visit(child, outer)

    visit(root, None)
    adapters = _lora_adapters(root)

    def init(module: nn.Module) -> None:
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()
        if id(module) in model_init:
            model_init[id(module)](module)
        if id(module) in adapters:  # after the model's own: B zero, so the adapter starts as the identity
            layer, name, how = adapters[id(module)]
            layer.reset_lora_parameters(name, how)

    return init


PEFT_META_INITS = (True, False, "gaussian")  # peft's LoRA inits that read nothing but the adapter's shape


def _lora_adapters(root: nn.Module) -> dict[int, tuple[nn.Module, str, bool | str]]:
    """peft's LoRA adapter modules in `root` (found by peft's own attributes, peft not imported): id ->
    (their LoRA layer, the adapter's name, its ``init_lora_weights``), initialized as peft initializes
    them. An init that reads the base weights (PiSSA, OLoRA, LoftQ, ...) or DoRA's magnitude, which
    the meta device does not have yet, is refused in one line."""
    configs = next((m.peft_config for m in root.modules() if isinstance(getattr(m, "peft_config", None), dict)), {})
    found = {}
    for layer in root.modules():
        if not callable(getattr(layer, "reset_lora_parameters", None)):
            continue
        for attribute in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"):
            holder = getattr(layer, attribute, {})
            for name, adapter in holder.items():
                how = getattr(configs.get(name), "init_lora_weights", True)
                if how not in PEFT_META_INITS or getattr(configs.get(name), "use_dora", False):
                    what = "use_dora = True" if how in PEFT_META_INITS else f"init_lora_weights = {how!r}"
                    raise MaterializeError(
                        f"zeropp: LoRA adapter {name!r} was built on the meta device with {what}, which reads the "
                        f"base weights it does not have yet; build the peft model on the loaded base, or use "
                        f"init_lora_weights in {list(PEFT_META_INITS)}"
                    )
                # an embedding's adapters are parameters of a ParameterDict, a linear's modules of their own
                found[id(adapter if isinstance(adapter, nn.Module) else holder)] = (layer, name, how)
    return found


def initialize_model(
    model: nn.Module, unit_modules: list[nn.Module], seed: int = 0, init_fn: InitFn | None = None
) -> nn.Module:
    """Materialize a meta-device model on the host in one process, with the weights the engine gives
    it with the same units, seed and init_fn at any world size (e.g. for a single-process reference)."""
    scopes = unit_scopes(model, unit_modules)
    for module in [*(m for m in unit_modules if m is not model), model]:
        initialize_scope(scopes.get(id(module), []), model, seed, init_fn)
    return model


def place_fixed(
    scope: list[tuple[str, nn.Module]],
    managed: set[int],
    device: torch.device,
    compute_dtype: torch.dtype,
    comm: Communicator,
    broadcast_from: Group | None,
) -> None:
    """Move the scope's unmanaged tensors (frozen parameters, buffers) to the device, floating ones in
    the compute dtype; with `broadcast_from`, every rank takes rank 0's values (one broadcast per dtype)."""
    moved: list[torch.Tensor] = []
    for _, module in scope:
        for key, tensor in list(direct_tensors(module)):
            if id(tensor) in managed:
                continue
            dtype = compute_dtype if tensor.is_floating_point() else tensor.dtype
            if key in module._parameters:
                tensor.data = tensor.data.to(device, dtype)
                moved.append(tensor.data)
            else:
                module._buffers[key] = tensor.to(device, dtype)
                moved.append(module._buffers[key])
    if broadcast_from is not None:
        broadcast_packed(comm, moved, broadcast_from)


def broadcast_packed(comm: Communicator, tensors: list[torch.Tensor], group: Group) -> None:
    """Broadcast the group's first rank's `tensors` as one flat buffer per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        comm.broadcast(flat, group, src=group.ranks[0])
        for t, piece in zip(same, flat.split([t.numel() for t in same]), strict=True):
            t.copy_(piece.view(t.shape))
