"""Benchmarks run from the command line: ``zeropp bench NAME [options]`` runs ``zeropp.tools.bench.NAME.main``.

A module of this package is a benchmark when its docstring starts with ````zeropp bench NAME````
(:func:`available` finds them without importing them); the other modules are helpers (``runs``,
``peers``).
"""

from __future__ import annotations

import ast
import pkgutil
from pathlib import Path


def available() -> dict[str, str]:
    """{name: what it measures} of every benchmark, from the first line of its docstring."""
    out = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        source = Path(__path__[0], f"{info.name}.py")
        doc = ast.get_docstring(ast.parse(source.read_text())) if source.is_file() else None
        head = f"``zeropp bench {info.name}``:"
        if doc and doc.startswith(head):
            out[info.name] = doc.splitlines()[0].removeprefix(head).strip()
    return out
