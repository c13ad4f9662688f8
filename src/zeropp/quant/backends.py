"""The quantization backends, one record each, and the choice among them.

A backend is the four :class:`~zeropp.quant.spec.QuantKernels` functions plus the companions that
a feature picks with them, so the fast paths of qgZ's options always run on the same backend as its
quantization: the Hadamard rotation of blocks (``gradient_hadamard``) and LoCo's residual update
(``gradient_error_feedback``, where a backend has a one-pass version; otherwise
:mod:`zeropp.comm.feedback` runs the torch ops, bit for bit the same).

``torch``: :mod:`zeropp.quant.reference` on every device. ``triton``: the kernels of
:mod:`zeropp.quant.triton`, on CUDA tensors, or on CPU tensors under Triton's interpreter.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib.util import find_spec
from typing import Literal

import torch

from zeropp.quant import hadamard, reference
from zeropp.quant.spec import Quantized, QuantKernels

BackendName = Literal["auto", "torch", "triton"]
Rotation = Callable[..., torch.Tensor]  # (x, block, *, inverse=False) -> rotated copy
ResidualUpdate = Callable[[torch.Tensor, torch.Tensor, Quantized, float], None]


@dataclass(frozen=True)
class Backend:
    name: str
    kernels: QuantKernels
    rotate: Rotation
    update_residual: ResidualUpdate | None  # None: comm.feedback's torch ops


TORCH = Backend("torch", reference, hadamard.rotate, None)
TRITON_KERNELS = "zeropp.quant.triton.kernels"


@functools.cache
def triton_backend() -> Backend:
    """The Triton kernels (imported on first use: Triton is an optional extra)."""
    try:
        from zeropp.quant.triton import feedback, kernels
        from zeropp.quant.triton import hadamard as triton_hadamard
    except ImportError as error:
        raise RuntimeError(f"zeropp: quantization backend 'triton' needs the triton package ({error})") from error
    return Backend("triton", kernels, triton_hadamard.rotate, feedback.update_residual)


def backend_for(device: torch.device, backend: BackendName = "auto") -> Backend:
    """The backend that ``quant_backend = backend`` selects for tensors on `device`: ``auto`` is
    Triton on CUDA when it is installed, the torch reference otherwise."""
    device = torch.device(device)
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"zeropp: unknown quantization backend {backend!r} (auto, torch or triton)")
    if backend == "torch" or (backend == "auto" and (device.type != "cuda" or find_spec("triton") is None)):
        return TORCH
    chosen = triton_backend()
    if device.type != "cuda" and not chosen.kernels.INTERPRETED:
        raise RuntimeError(
            "zeropp: Triton kernels on CPU tensors need the interpreter: set TRITON_INTERPRET=1 before "
            "zeropp.quant.triton.kernels is first imported"
        )
    return chosen


def kernels_for(device: torch.device, backend: BackendName = "auto") -> QuantKernels:
    """The ``QuantKernels`` of :func:`backend_for`."""
    return backend_for(device, backend).kernels


def backend_of(kernels: QuantKernels) -> Backend:
    """The backend whose kernels these are; a user's own ``QuantKernels`` gets the torch companions."""
    if kernels is sys.modules.get(TRITON_KERNELS):  # loaded: Triton is installed
        return triton_backend()
    return TORCH
