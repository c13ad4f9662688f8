"""The optimizer as the user gave it, read once, before any process group starts.

Four forms: a ``torch.optim.Optimizer`` class and its keyword arguments; a factory called on the
parameters to step; a ``torch.optim.Optimizer`` the user built on the model's own parameters, with
any param groups; or a list of such optimizers over disjoint parameters (Muon for the matrices,
AdamW for the rest). :func:`read_optimizer` reads any of them into an :class:`OptimizerSpec`: each
optimizer's class and its groups (hyperparameters and which of the model's parameters they hold),
and which path steps it. See [Note: the whole-parameter step] (:mod:`zeropp.zero.optim.owners`).

Element-wise optimizers (:data:`~zeropp.zero.optim.stepping.ELEMENTWISE_OPTIMIZERS`, or a class marked
``elementwise = True``) step the pieces of the parameters the shards hold, with any groups and any
number of optimizers (See [Note: segments]); any other steps whole parameters on owner ranks. The
user's own optimizer objects are never stepped: their groups' hyperparameters are copied into the
engine's optimizers before every step, so a learning-rate scheduler built on them drives the engine's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from zeropp.errors import ConfigError
from zeropp.zero.optim.low_precision_adam import low_precision_adam
from zeropp.zero.optim.stepping import is_elementwise
from zeropp.zero.precision import DTYPES

if TYPE_CHECKING:
    from zeropp.config.sections import ZeroConfig

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
NO_CLOSURE = (torch.optim.LBFGS,)  # a step that re-evaluates the model through a closure
SPARSE_ONLY = (torch.optim.SparseAdam,)  # sparse gradients, which zeropp's flat gradients never are


@dataclass
class OptimizerPart:
    """One optimizer to build: its class, its groups' hyperparameters (no ``params``), each group's
    parameters (the user's parameter objects; None: every trainable parameter, in one group), and
    the user's optimizer whose hyperparameters drive it (None for the class and factory forms)."""

    cls: type[torch.optim.Optimizer]
    hyperparameters: list[dict[str, Any]]
    members: list[list[nn.Parameter]] | None = None
    source: torch.optim.Optimizer | None = None

    def groups_over(self, params_of: Callable[[nn.Parameter], nn.Parameter | None], every: list) -> list[dict]:
        """The groups of this optimizer over other tensors: `params_of(p)` stands in for the user's
        parameter `p` (None: not on this rank); `every` is the whole list for the one-group forms."""
        if self.members is None:
            return [{**self.hyperparameters[0], "params": every}]
        return [
            {**hyper, "params": [q for q in map(params_of, members) if q is not None]}
            for hyper, members in zip(self.hyperparameters, self.members, strict=True)
        ]

    def follow_source(self, optimizer: torch.optim.Optimizer) -> None:
        """Copy the hyperparameters of the user's optimizer that changed since the last copy (a scheduler
        built on it changed them); where a scheduler drives the engine's optimizer instead, they do not."""
        if self.source is None:
            return
        for g, (theirs, ours) in enumerate(zip(self.source.param_groups, optimizer.param_groups, strict=True)):
            changed = {k: v for k, v in theirs.items() if k != "params" and self._copied[g].get(k, v) != v}
            ours.update(changed)
            self._copied[g].update(changed)

    def __post_init__(self) -> None:
        self._copied = [dict(h) for h in self.hyperparameters]  # what the engine's optimizer last took


@dataclass
class OptimizerSpec:
    parts: list[OptimizerPart]
    factory: OptimizerFactory | None = None  # one group's optimizer over given tensors (the class and factory forms)
    whole: bool = False  # not element-wise: stepped whole on owner ranks (See [Note: the whole-parameter step])
    described: str = field(default="")  # for messages: "AdamW", "Muon + AdamW"

    def follow_sources(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Each of the engine's `optimizers` (one a part) takes what its user's optimizer's scheduler changed."""
        for part, optimizer in zip(self.parts, optimizers, strict=True):
            part.follow_source(optimizer)


def _name(cls: type) -> str:
    return cls.__name__ if cls.__module__.startswith("torch.optim") else f"{cls.__module__}.{cls.__qualname__}"


def _refuse_unsteppable(cls: type) -> None:
    if issubclass(cls, NO_CLOSURE):
        raise ConfigError(f"optimizer {_name(cls)} re-evaluates the model through a closure, which zeropp's step "
                          "does not take; use a first-order optimizer")  # fmt: skip
    if issubclass(cls, SPARSE_ONLY):
        raise ConfigError(f"optimizer {_name(cls)} needs sparse gradients; zeropp's gradients are dense: use Adam")


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def read_optimizer(optimizer: Any, kwargs: dict[str, Any] | None, model: nn.Module) -> OptimizerSpec:
    """Read what the user gave (module docstring); bad input is refused in one line."""
    is_class = isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer)
    if kwargs and not is_class:
        raise ConfigError("optimizer_kwargs given with an optimizer factory or object; pass them to one or the other")
    if is_class:
        _refuse_unsteppable(optimizer)
        part = OptimizerPart(optimizer, [dict(kwargs or {})])
        fast = is_elementwise(optimizer)
        factory = (lambda masters: optimizer(masters, **(kwargs or {}))) if fast else None
        return OptimizerSpec([part], factory, whole=not fast, described=_name(optimizer))
    if isinstance(optimizer, torch.optim.Optimizer) or (
        isinstance(optimizer, Sequence) and optimizer and all(isinstance(o, torch.optim.Optimizer) for o in optimizer)
    ):
        return _read_objects([optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer), model)
    if not callable(optimizer):
        raise ConfigError(
            f"optimizer {optimizer!r}: give a torch.optim.Optimizer class with its kwargs, an optimizer built on "
            "the model's parameters (or a list of them), or a factory called on the parameters"
        )
    probe = optimizer([nn.Parameter(torch.zeros(1, 1))])  # its class and hyperparameters, on a matrix stand-in
    cls = type(probe)
    _refuse_unsteppable(cls)
    holding = [g for g in probe.param_groups if g["params"]]  # groups beside it may only carry hyperparameters
    if len(holding) != 1:
        raise ConfigError(f"the optimizer factory built {_name(cls)} with {len(holding)} param groups holding the "
                          "parameters it was given; build the optimizer on the model's parameters instead")  # fmt: skip
    part = OptimizerPart(cls, [_hyperparameters(holding[0])])
    fast = is_elementwise(cls)
    return OptimizerSpec([part], optimizer if fast else None, whole=not fast, described=_name(cls))


def _read_objects(optimizers: list[torch.optim.Optimizer], model: nn.Module) -> OptimizerSpec:
    """The user's optimizers over the model's own parameters: every trainable parameter in exactly
    one group of one optimizer, no empty group, no state yet."""
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    trainable = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    seen: dict[int, str] = {}
    parts = []
    for k, opt in enumerate(optimizers):
        cls, label = type(opt), _name(type(opt)) if len(optimizers) == 1 else f"optimizer {k} ({_name(type(opt))})"
        _refuse_unsteppable(cls)
        if opt.state:
            raise ConfigError(f"{label} already has state; build it fresh and resume through a zeropp checkpoint")
        members = []
        for g, group in enumerate(opt.param_groups):
            if not group["params"]:
                raise ConfigError(f"{label}: param group {g} holds no parameters; drop the empty group")
            for p in group["params"]:
                if id(p) not in names:
                    raise ConfigError(f"{label}: param group {g} holds a parameter of shape {tuple(p.shape)} that "
                                      "is not the model's; build the optimizer on this model's parameters")  # fmt: skip
                if id(p) in seen:
                    raise ConfigError(f"parameter {names[id(p)]!r} is in {seen[id(p)]} and in {label} (group {g}); "
                                      "each parameter belongs to one group of one optimizer")  # fmt: skip
                if not p.requires_grad:
                    raise ConfigError(f"{label}: parameter {names[id(p)]!r} does not require grad; leave it out")
                seen[id(p)] = f"{label} (group {g})"
            members.append(list(group["params"]))
        parts.append(OptimizerPart(cls, [_hyperparameters(g) for g in opt.param_groups], members, source=opt))
    missing = [n for i, n in trainable.items() if i not in seen]
    if missing:
        raise ConfigError(f"trainable parameter {missing[0]!r} is in no optimizer ({len(missing)} in all); "
                          "add it to a group, or set requires_grad=False on it")  # fmt: skip
    described = " + ".join(_name(p.cls) for p in parts)
    only = parts[0]
    whole = not all(is_elementwise(p.cls) for p in parts)
    if len(parts) == 1 and len(only.hyperparameters) == 1 and not whole:
        hyper = only.hyperparameters[0]
        return OptimizerSpec(parts, lambda masters: only.cls([{**hyper, "params": masters}]), described=described)
    return OptimizerSpec(parts, whole=whole, described=described)


def flat_only(config: ZeroConfig) -> str | None:
    """The setting of `config` that has element-wise optimizers step one tensor per flat shard (the disk
    tier's files, bf16 states), as the user wrote it; None where they step segments."""
    if config.optimizer_path == "flat":
        return "zero.optimizer_path = 'flat'"
    asking = {
        "offload_optimizer": "nvme" if config.offload.optimizer == "nvme" else None,
        "optimizer_state_dtype": config.optimizer_state_dtype if config.optimizer_state_dtype != "fp32" else None,
        "master_dtype": config.master_dtype if config.master_dtype != "fp32" else None,
    }
    return next((f"zero.{k} = {v!r}" for k, v in asking.items() if v is not None), None)


def read_for(
    optimizer: Any, kwargs: dict[str, Any] | None, model: nn.Module, config: ZeroConfig
) -> tuple[OptimizerSpec, Literal["segments", "flat", "whole"]]:
    """:func:`read_optimizer`, then what `config` asks of it: Adam with bf16 states (``optimizer_state_dtype``
    or ``master_dtype = 'bf16'``: :func:`~zeropp.zero.optim.low_precision_adam.low_precision_adam`) and the
    path that steps it (:func:`optimizer_path`)."""
    spec = read_optimizer(optimizer, kwargs, model)
    low = [f"zero.{k} = 'bf16'" for k in ("optimizer_state_dtype", "master_dtype") if getattr(config, k) != "fp32"]
    if low:  # Adam's moments stored in bf16, bf16 masters Kahan-compensated
        spec.factory = low_precision_adam(optimizer, kwargs or {}, DTYPES[config.optimizer_state_dtype], low[0])
    return spec, optimizer_path(spec, config)


def optimizer_path(spec: OptimizerSpec, config: ZeroConfig) -> Literal["segments", "flat", "whole"]:
    """The path that steps `spec` under `config` (``zero.optimizer_path``; See [Note: segments]); what
    the flat path cannot run is refused in one line."""
    asked = config.optimizer_path
    if asked == "whole" and not spec.whole:
        spec.described += " (zero.optimizer_path = 'whole')"
    needs_flat = flat_only(config)
    if needs_flat and (spec.whole or asked == "whole" or spec.factory is None):
        groups = sum(len(part.hyperparameters) for part in spec.parts)
        raise ConfigError(
            f"{needs_flat} steps one element-wise optimizer with one param group on each unit's flat shard; "
            f"optimizer {spec.described} has {groups} group(s) in {len(spec.parts)} optimizer(s)"
            + (", and does not step element by element" if spec.whole else "")
        )
    if spec.whole or asked == "whole":
        return "whole"
    return "flat" if needs_flat else "segments"
