"""Which parameters form a unit: the modules that are gathered, computed and reduced together.

Default grouping: every child of a repeated container (an ``nn.ModuleList`` / ``nn.Sequential``
whose children include at least two modules of one class, e.g. the transformer layers) is a unit;
one root unit holds everything else. A parameter reachable from two units (a tied weight between
a layer and the root, say) goes to the root unit, which stays gathered for the whole forward.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from torch import nn

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
    model: nn.Module, unit_modules: Iterable[nn.Module]
) -> list[tuple[nn.Module, list[tuple[str, nn.Parameter]]]]:
    """Assign each trainable parameter to exactly one unit; the root (`model`) unit comes last.

    Frozen parameters (requires_grad=False) are left where they are: resident and replicated.
    """
    claims: dict[int, list[int]] = {}
    unit_modules = [m for m in unit_modules if m is not model]
    for index, module in enumerate(unit_modules):
        for p in module.parameters():
            if p.requires_grad:
                claims.setdefault(id(p), []).append(index)
    grouped: list[list[tuple[str, nn.Parameter]]] = [[] for _ in unit_modules] + [[]]
    for name, p in model.named_parameters(remove_duplicate=True):
        if not p.requires_grad:
            continue
        owners = claims.get(id(p), [])
        grouped[owners[0] if len(owners) == 1 else -1].append((name, p))
    modules = [*unit_modules, model]
    return [(m, params) for m, params in zip(modules, grouped, strict=True) if params]


def innermost_units(units: list[FlatUnit]) -> list[FlatUnit]:
    """The units whose module contains no other unit's (the blocks; not a root that calls them)."""
    modules = {id(unit.module) for unit in units}
    return [u for u in units if not any(id(m) in modules for m in u.module.modules() if m is not u.module)]
