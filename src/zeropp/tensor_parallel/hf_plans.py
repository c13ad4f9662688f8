"""transformers' own tensor-parallel plans as DTensor plans: ``config.base_model_tp_plan`` (the plan its
``tp_plan="auto"`` applies) translated style by style into torch's ``ParallelStyle`` s, named from the
top of the model, for :func:`zeropp.parallelize`.

A Hugging Face plan maps module (or parameter) patterns to style strings:

- ``colwise`` / ``rowwise``: Megatron's pair, :class:`ColwiseParallel` (output this rank's columns)
  and :class:`RowwiseParallel` (output all-reduced); an attention whose q, k and v are column-wise
  computes this rank's heads: its forward reshapes with ``-1`` heads of ``head_dim``;
- ``colwise_rep`` (``colwise_gather_output``): column-wise, the output all-gathered whole;
  ``rowwise_rep`` (``rowwise_split_input``): row-wise taking a whole input, cut locally;
- ``embedding_rowwise`` / ``embedding_colwise``: the vocabulary split (lookups all-reduced) or the
  hidden dimension (gathered);
- ``replicated_with_grad_allreduce``: a whole module fed this rank's heads (Qwen3's and Gemma 3's
  q/k norms): its weights ``Replicate`` DTensors whose gradients come back ``Partial`` and are summed
  over the group with the unit's gradients (:meth:`~zeropp.zero.unit.FlatUnit.add_grad`);
- ``moe_tp_experts`` with its parameters' entries (``packed_colwise`` for ``gate_up_proj``,
  ``rowwise`` for ``down_proj``): every expert split Megatron's way, :class:`MoeExperts`; under
  expert parallelism left out (``experts_whole``): each tensor-parallel rank runs its experts whole;
- ``all_reduce`` (``gather`` in older releases): the module's output all-reduced;
  ``replicate``: whole. ``local_*`` (older releases: the same split on local tensors) are their
  style without the prefix.

Anything else (sequence parallelism, MLA, expert-parallel dispatch) is refused in one line naming the
pattern and the style; zeropp's own sequence parallelism is :func:`~zeropp.tensor_parallel.plans.sequence_parallel_plan`.
Entries matching no module are dropped, as transformers drops them. See [Note: translated plans].
"""

from __future__ import annotations

from collections.abc import Callable
from fnmatch import fnmatch

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel
from torch.distributed.tensor.placement_types import _StridedShard

from zeropp.errors import ConfigError

Plan = dict[str, ParallelStyle]  # module name (fnmatch patterns allowed) -> how to split it
HEAD_KEYS = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "moe_intermediate_size")

# Hugging Face's module styles -> the DTensor style
STYLES: dict[str, Callable[[], ParallelStyle | None]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_colwise": lambda: ColwiseParallel(output_layouts=Replicate()),
    "replicated_with_grad_allreduce": lambda: SequenceParallel(
        sequence_dim=-2, use_local_output=True
    ),  # the heads dimension
    "moe_tp_experts": lambda: MoeExperts(),
    "all_reduce": lambda: AllReducedOutput(),
    "replicate": lambda: None,
}
ALIASES = {
    "colwise_gather_output": "colwise_rep",
    "rowwise_split_input": "rowwise_rep",
    "gather": "all_reduce",
    "local_colwise": "colwise",
    "local_rowwise": "rowwise",
    "local_packed_rowwise": "packed_rowwise",
    "local": "replicate",
}
# a parameter's own entry (under a module style such as moe_tp_experts) -> its placement, by dimensions
PARAMETER_STYLES: dict[str, Callable[[int], Placement]] = {
    "colwise": lambda ndim: Shard(max(ndim - 2, 0)),
    "rowwise": lambda ndim: Shard(ndim - 1) if ndim > 1 else Replicate(),
    "packed_colwise": lambda ndim: _StridedShard(ndim - 2, split_factor=2) if ndim > 1 else Shard(0),
    "packed_rowwise": lambda ndim: _StridedShard(ndim - 1, split_factor=2) if ndim > 1 else Replicate(),
}


def has_hf_plan(model: nn.Module) -> bool:
    """Whether `model` is a transformers model whose config carries a tensor-parallel plan."""
    return bool(getattr(getattr(model, "config", None), "base_model_tp_plan", None))


def hf_plan(model: nn.Module, tp: int, experts_whole: bool = False) -> Plan:
    """``model.config.base_model_tp_plan`` as a DTensor plan over tp ranks, named from the model's top;
    one-line ConfigErrors for a style zeropp has no translation of and for shapes tp ranks cannot share.
    `experts_whole` (expert parallelism): the experts modules' entries (``moe_tp_experts`` and those of
    their parameters) left out, so every tensor-parallel rank runs them whole (the routers, which
    transformers' plans leave whole, too)."""
    prefix = base_prefix(model)
    entries = {
        prefix + pattern: _canonical(prefix + pattern, style)
        for pattern, style in model.config.base_model_tp_plan.items()
    }
    experts = [pattern for pattern, style in entries.items() if experts_whole and style == "moe_tp_experts"]
    entries = {p: s for p, s in entries.items() if not any(p == e or p.startswith(f"{e}.") for e in experts)}
    _require_divisible(model, tp, entries)
    modules = dict(model.named_modules())
    plan: Plan = {}
    for pattern, style in entries.items():
        if not any(matches(name, pattern) for name in modules):
            continue
        if style not in STYLES:  # a parameter's style on a whole module
            raise ConfigError(
                f"no translation of transformers' tensor-parallel style {style!r} for the module {pattern}"
            )
        translated = STYLES[style]()
        if translated is not None:
            plan[pattern] = translated
    for pattern, style in entries.items():  # parameter entries: their placement on their module's style
        owner, _, leaf = pattern.rpartition(".")
        owners = [m for name, m in modules.items() if matches(name, owner) and leaf in m._parameters]
        if style in PARAMETER_STYLES and owners:
            module_style = plan.get(owner)
            if not isinstance(module_style, MoeExperts):
                raise ConfigError(
                    f"no translation of transformers' tensor-parallel style {style!r} for {pattern} "
                    "outside an experts module"
                )
            module_style.param_placements[leaf] = PARAMETER_STYLES[style](getattr(owners[0], leaf).dim())
    return plan


def base_prefix(model: nn.Module) -> str:
    """The base model's name inside `model` followed by a dot ('' when `model` is the base model)."""
    base = getattr(model, "base_model", model)
    name = next((n for n, m in model.named_modules() if m is base), "")
    return f"{name}." if name else ""


def blocks_name(model: nn.Module) -> str:
    """The transformer blocks' container named from the model's top: the ``base_model_pp_plan`` entry
    that is a module list (``model.layers``, ``transformer.h``)."""
    prefix, modules = base_prefix(model), dict(model.named_modules())
    for name in getattr(model.config, "base_model_pp_plan", None) or {}:
        if isinstance(modules.get(prefix + name), nn.ModuleList):
            return prefix + name
    raise ConfigError(f"{type(model).__name__}'s config has no base_model_pp_plan entry naming its blocks")


def _canonical(pattern: str, style: str) -> str:
    style = ALIASES.get(style, style)
    if style not in STYLES and style not in PARAMETER_STYLES:
        raise ConfigError(
            f"no translation of transformers' tensor-parallel style {style!r} (for {pattern}); "
            f"pass a plan of your own: zeropp.parallelize(model, topology, plan={{...}})"
        )
    return style


def matches(name: str, pattern: str) -> bool:
    """Whether module `name` matches plan `pattern` (fnmatch per dotted atom, as ``parallelize_module``)."""
    atoms, names = pattern.split("."), name.split(".")
    return len(atoms) == len(names) and all(fnmatch(n, a) for n, a in zip(names, atoms, strict=True))


def _require_divisible(model: nn.Module, tp: int, entries: dict[str, str]) -> None:
    """Each rank whole heads and equal shares: the config's head counts and widths, then every split
    dimension of a matched linear, checked before any split (one line naming what tp does not divide)."""
    if any(style in ("colwise", "moe_tp_experts") for style in entries.values()):
        config, split_experts = model.config, "moe_tp_experts" in entries.values()
        keys = [k for k in HEAD_KEYS if split_experts or k != "moe_intermediate_size"]  # whole experts: any width
        require_equal_shares(tp, {k: getattr(config, k) for k in keys if isinstance(getattr(config, k, None), int)})
    for name, module in model.named_modules():
        for pattern, style in entries.items():
            dims = {"colwise": "out_features", "rowwise": "in_features"}
            attribute = dims.get(style.removesuffix("_rep"))
            if attribute and matches(name, pattern) and getattr(module, attribute, 0) % tp:
                raise ConfigError(
                    f"topology.tensor_parallel_size = {tp} is not allowed with {name}.{attribute} = "
                    f"{getattr(module, attribute)}; expected a multiple of it ({style} splits it)"
                )


def require_equal_shares(tp: int, sizes: dict[str, int]) -> None:
    """Refuse, in one line, a head count or MLP width that tp ranks cannot share equally: each rank
    computes whole heads, and a row-wise linear takes its input as tp equal pieces."""
    for key, size in sizes.items():
        if size % tp:
            raise ConfigError(
                f"topology.tensor_parallel_size = {tp} is not allowed with {key} = {size}; "
                "expected a divisor of it (each rank computes whole heads and an equal share of the MLP)"
            )


class MoeExperts(ParallelStyle):
    """transformers' ``moe_tp_experts``: every expert split Megatron's way (``gate_up_proj``'s gate and
    up halves column-wise, each rank its chunk of both, ``down_proj`` row-wise), its forward run on this
    rank's pieces as local tensors. The input (tokens and routing weights, whole on every rank) comes
    in as it is and its gradient, a partial sum, is all-reduced in backward; the output, a partial sum,
    is all-reduced in forward: Megatron's two all-reduces per MLP. `param_placements`: each parameter's
    own entry (``packed_colwise``, ``rowwise``, ...) as a placement; the others stay whole."""

    def __init__(self) -> None:
        super().__init__()
        self.param_placements: dict[str, Placement] = {}

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for key, placement in self.param_placements.items():
            param = getattr(module, key)
            split = distribute_tensor(param, device_mesh, [placement], src_data_rank=self.src_data_rank)
            module.register_parameter(key, nn.Parameter(split, requires_grad=param.requires_grad))
        forward = module.forward

        def local_forward(*args, **kwargs):
            # the parameters swapped for their local pieces for this call only: restored however the
            # call ends (activation checkpointing's recomputation stops a forward early by raising)
            dtensors = {k: p for k, p in module._parameters.items() if isinstance(p, DTensor)}
            module._parameters.update({k: p.to_local() for k, p in dtensors.items()})
            try:
                args = tuple(_gradient_summed(a, device_mesh) if a.is_floating_point() else a for a in args)
                output = forward(*args, **kwargs)
            finally:
                module._parameters.update(dtensors)
            return _all_reduced(output, device_mesh)

        module.forward = local_forward
        return module


class AllReducedOutput(ParallelStyle):
    """transformers' ``all_reduce``: the module's output, a partial sum on each rank, all-reduced."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_hook(lambda _module, _args, output: _all_reduced(output, device_mesh))
        return module


def _all_reduced(x, mesh: DeviceMesh):
    """`x`, this rank's partial sum, summed over the group in forward (its gradient passes as it is)."""
    return DTensor.from_local(x, mesh, [Partial()], run_check=False).full_tensor()


def _gradient_summed(x, mesh: DeviceMesh):
    """`x` (whole on every rank) as it is in forward, its gradient all-reduced in backward."""
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])
