"""The package keeps its layers: every import (function-level ones too; ``TYPE_CHECKING`` blocks
aside) points at the same or an earlier layer, no two modules import each other through any
chain, the package's top level holds at most five modules and no folder more than twelve (its
``__init__.py`` counted): a subject grows into a sub-package rather than a grab bag."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

PACKAGE = Path(
    importlib.util.find_spec("zeropp").origin
).parent  # found, not imported: a broken import still fails here
LAYERS = (
    "errors", "config", "index", "topology", "quant", "comm", "zero", "runtime", "tensor_parallel", "context_parallel",
    "expert_parallel", "costs", "checkpoint", "engine", "integrations", "app", "tools", "cli",
)  # fmt: skip


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def layer_of(module: str) -> int | None:
    """The layer's index; None for the package root (it re-exports the public API)."""
    parts = module.split(".")
    return None if len(parts) == 1 else LAYERS.index(parts[1])


def _type_checking_blocks(tree: ast.AST) -> set[int]:
    """ids of the nodes inside ``if TYPE_CHECKING:`` blocks."""
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            inside.update(id(n) for child in node.body for n in ast.walk(child))
    return inside


def imports_of(source: str, module: str, is_package: bool) -> set[str]:
    """The zeropp modules `source` imports: a name imported from a package resolves to its
    submodule when there is one, to the package (its ``__init__``) otherwise."""
    tree = ast.parse(source)
    skip = _type_checking_blocks(tree)
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "zeropp")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] != "zeropp":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in MODULES else base)
    out.discard(module)
    return out


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    return {
        name: imports_of(path.read_text(), name, path.name == "__init__.py") & set(modules)
        for name, path in modules.items()
    }


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, targets in graph.items():
        own = layer_of(module)
        for target in sorted(targets):
            theirs = layer_of(target)
            if own is not None and (theirs is None or theirs > own):
                bad.append(
                    f"{module} imports {target} (layer {LAYERS[own]} may not import {target.split('.')[1] if theirs is not None else 'the package root'})"
                )
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_module_belongs_to_a_layer():
    unknown = [m for m in MODULES if m != "zeropp" and m.split(".")[1] not in LAYERS]
    assert not unknown, f"modules outside the layers {LAYERS}: {unknown}"


def test_no_module_imports_a_later_layer():
    assert upward_imports(import_graph(MODULES)) == []


def test_no_import_cycles():
    assert cycles(import_graph(MODULES)) == []


def test_the_top_level_holds_at_most_five_modules():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 5, top


def test_no_folder_holds_more_than_twelve_modules():
    crowded = {
        str(folder.relative_to(PACKAGE.parent)): count
        for folder in [PACKAGE, *(p for p in PACKAGE.rglob("*") if p.is_dir() and p.name != "__pycache__")]
        if (count := len(list(folder.glob("*.py")))) > 12
    }
    assert crowded == {}


def test_the_checks_fail_on_an_upward_import_and_a_cycle():
    """The checks can fail: a deliberate upward import and a two-module cycle are both caught."""
    graph = import_graph(MODULES)
    graph["zeropp.quant.spec"] = graph["zeropp.quant.spec"] | {"zeropp.engine"}
    assert upward_imports(graph) == ["zeropp.quant.spec imports zeropp.engine (layer quant may not import engine)"]
    graph["zeropp.engine"] = graph["zeropp.engine"] | {"zeropp.quant.spec"}
    assert any({"zeropp.engine", "zeropp.quant.spec"} <= set(component) for component in cycles(graph))


def test_function_level_imports_count_and_type_checking_ones_do_not():
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from zeropp.engine import ZeroEngine\n"
        "def f():\n    from zeropp.app import trainer\n"
    )
    assert imports_of(source, "zeropp.quant.spec", False) == {"zeropp.app.trainer"}
