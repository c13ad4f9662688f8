"""Benchmarks run from the command line: ``zeropp bench NAME [options]``, grouped by subject.

- :mod:`~zeropp.tools.bench.speed`: step time against plain PyTorch, FSDP2 and DeepSpeed, the stages,
  host overhead, the host optimizer, generation, the sequence check;
- :mod:`~zeropp.tools.bench.memory`: peak memory against the formulas, the largest model that fits,
  activation checkpoints;
- :mod:`~zeropp.tools.bench.quality`: convergence over seeds and the weight error of quantization;
- :mod:`~zeropp.tools.bench.cluster`: zeropp against its rivals on an emulated cluster;
- :mod:`~zeropp.tools.bench.gpu`: the CUDA path in one command, and the Triton kernels;
- :mod:`~zeropp.tools.bench.rivals`, :mod:`~zeropp.tools.bench.runs`: what they share (the rival
  libraries' training loops, ``zeropp train`` runs read back).

A module is a benchmark when its docstring starts with ````zeropp bench NAME````; :func:`available`
finds them without importing them.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).parent


def available() -> dict[str, tuple[str, str]]:
    """{name: (module, what it measures)} of every benchmark, from the first line of its docstring."""
    out = {}
    for source in sorted(PACKAGE.rglob("*.py")):
        doc = ast.get_docstring(ast.parse(source.read_text())) or ""
        if found := re.match(r"``zeropp bench ([\w-]+)``: (.*)", doc):
            parts = source.relative_to(PACKAGE.parents[2]).with_suffix("").parts
            out[found.group(1)] = (".".join(parts), found.group(2).strip())
    return dict(sorted(out.items()))
