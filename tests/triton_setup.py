"""Triton set-up shared by the kernel test modules: the kernels compiled on a GPU, else under
Triton's CPU interpreter.

Kernels are decorated at import, so kernel modules are imported through ``import_kernels``, with
``TRITON_INTERPRET=1`` where there is no GPU; the variable is put back afterwards so nothing else
in the session sees it. On a GPU machine, ``TRITON_INTERPRET=1 pytest ...`` runs the interpreter
cases instead. The interpreter costs milliseconds per program instance: tensors stay small.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from unittest import mock

import pytest
import torch

CUDA = torch.cuda.is_available()
pytest.importorskip("triton", reason="the Triton kernels need the triton package (pip install -e '.[test]')")
if not CUDA:
    pytest.importorskip("numpy", reason="Triton's CPU interpreter needs numpy")


def import_kernels(name: str) -> ModuleType:
    """Import the module `name` (which decorates Triton kernels) interpreted where there is no GPU."""
    with mock.patch.dict(os.environ, {"TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "0" if CUDA else "1")}):
        return importlib.import_module(name)


tk = import_kernels("zeropp.quant.triton.kernels")
DEVICE = "cpu" if tk.INTERPRETED else "cuda"
NEEDS_GPU_OR_INTERPRETER = pytest.mark.skipif(not CUDA and DEVICE == "cuda", reason="no GPU and TRITON_INTERPRET=0")
