"""Which parameters form a unit: the modules that are gathered, computed and reduced together.

Default grouping: every child of a repeated container (an ``nn.ModuleList`` / ``nn.Sequential``
whose children include at least two modules of one class, e.g. the transformer layers) is a unit;
one root unit holds everything else. A unit inside another (expert parallelism's experts container
inside its block) takes its own parameters; a parameter reachable from two units not nested (a
tied weight between a layer and the root, say) goes to the root unit, which stays gathered for the
whole forward.

A mixture-of-experts layer calls only the experts its tokens are routed to, and routing differs from
rank to rank: an expert that is a unit of its own would be gathered (and its gradient reduced) on some
ranks only, a hang. Such groupings are refused (:func:`refuse_expert_units`); an expert inside its
block's unit costs nothing special: the block is called on every rank, and parameters without a
gradient are reduced at the end of backward in a fixed order, the same on every rank.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from torch import nn

from zeropp.errors import ConfigError

if TYPE_CHECKING:
    from zeropp.zero.unit import FlatUnit


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """Children of containers holding >= 2 modules of the same class, outermost first, in order."""
    blocks: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, (nn.ModuleList, nn.Sequential)):
                kinds = [type(m) for m in child.children()]
                if any(kinds.count(k) >= 2 for k in kinds):
                    blocks.extend(m for m in child.children() if any(True for _ in m.parameters()))
                    continue
            visit(child)

    visit(model)
    return blocks


def group_parameters(
    model: nn.Module, unit_modules: Iterable[nn.Module], frozen: bool = False
) -> list[tuple[nn.Module, list[tuple[str, nn.Parameter]]]]:
    """Assign each trainable parameter (with `frozen`, each floating frozen one too: stage 3) to
    exactly one unit; the root (`model`) unit comes last.

    Without `frozen`, frozen parameters (requires_grad=False) are left where they are: resident and replicated.
    """

    def grouped_here(p: nn.Parameter) -> bool:
        return p.requires_grad or (frozen and p.is_floating_point())

    claims: dict[int, list[int]] = {}
    unit_modules = [m for m in unit_modules if m is not model]
    for index, module in enumerate(unit_modules):
        for p in module.parameters():
            if grouped_here(p):
                claims.setdefault(id(p), []).append(index)
    grouped: list[list[tuple[str, nn.Parameter]]] = [[] for _ in unit_modules] + [[]]
    inside = {i: {id(m) for m in module.modules()} for i, module in enumerate(unit_modules)}
    for name, p in model.named_parameters(remove_duplicate=True):
        if not grouped_here(p):
            continue
        owners = claims.get(id(p), [])
        # nested units (an experts container inside its block): the innermost; others (tied): the root
        innermost = [i for i in owners if all(id(unit_modules[i]) in inside[j] for j in owners)]
        grouped[innermost[0] if innermost else -1].append((name, p))
    modules = [*unit_modules, model]
    return [(m, params) for m, params in zip(modules, grouped, strict=True) if params]


def refuse_expert_units(model: nn.Module, unit_modules: Iterable[nn.Module]) -> None:
    """Refuse, in one line, a unit inside an ``experts`` container (a single expert, or a part of one):
    routing decides per rank whether it is called. The experts container itself (always called) and
    the blocks holding it are fine."""
    names = {id(m): n for n, m in model.named_modules()}
    for module in unit_modules:
        atoms = names.get(id(module), "").split(".")
        if "experts" in atoms[:-1]:
            raise ConfigError(
                f"unit {names[id(module)]} is not allowed: an expert in a unit of its own is called only on the "
                "ranks whose tokens reach it (a hang); expected its block (the default units) or the experts container"
            )


def innermost_units(units: list[FlatUnit]) -> list[FlatUnit]:
    """The units whose module contains no other unit's (the blocks; not a root that calls them)."""
    modules = {id(unit.module) for unit in units}
    return [u for u in units if not any(id(m) in modules for m in u.module.modules() if m is not u.module)]
