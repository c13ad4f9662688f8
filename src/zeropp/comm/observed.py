"""Collectives zeropp does not issue itself, observed and recorded in the ledger.

DTensor (tensor parallelism, :mod:`zeropp.tensor_parallel`) runs its own functional collectives
(``torch.ops._c10d_functional.*``) inside the model's forward, inside autograd's backward and when a
gradient is redistributed to its parameter's placement. :class:`ObservedCollectives` is a
``TorchDispatchMode`` (as torch's ``CommDebugMode``): it lets DTensor turn an operation into local
operations and collectives first (``NotImplemented`` for DTensor arguments), then sees each
collective on plain tensors and records it through the :class:`~zeropp.comm.Communicator`'s byte
model, under the ledger's phase, labelled by its group (``tp.<op>`` on the tensor-parallel group).
A functional collective the table below does not know stops the run rather than going uncounted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from zeropp.errors import ZeroppError

if TYPE_CHECKING:
    from zeropp.comm.communicator import Communicator

NAMESPACES = ("_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "_dtensor")
NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd")  # completion and autograd wrappers

# functional collective -> (the ledger's op, ring passes or None for a pairwise exchange, whose bytes are
# the buffer B of the byte model: the input's, or the output's for a gather)
BYTE_MODEL: dict[str, tuple[str, int | None, str]] = {
    "all_reduce": ("all_reduce", 2, "input"),
    "all_reduce_": ("all_reduce", 2, "input"),
    "all_reduce_coalesced": ("all_reduce", 2, "input"),
    "all_reduce_coalesced_": ("all_reduce", 2, "input"),
    "all_gather_into_tensor": ("all_gather", 1, "output"),
    "all_gather_into_tensor_out": ("all_gather", 1, "output"),
    "all_gather_into_tensor_coalesced": ("all_gather", 1, "output"),
    "reduce_scatter_tensor": ("reduce_scatter", 1, "input"),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 1, "input"),
    "all_to_all_single": ("all_to_all", None, "input"),
    "shard_dim_alltoall": ("all_to_all", None, "input"),
    "broadcast": ("broadcast", 0, "input"),
    "broadcast_": ("broadcast", 0, "input"),
}


class UncountedCollective(ZeroppError, RuntimeError):
    """A functional collective whose bytes the ledger has no model for. One line."""


class ObservedCollectives(TorchDispatchMode):
    def __init__(self, comm: Communicator) -> None:
        super().__init__()
        self.comm = comm

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if any(t is DTensor or issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor desugar into local operations and collectives first
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        namespace = getattr(func, "namespace", None)
        if namespace in NAMESPACES:
            name = func._overloadpacket.__name__
            if name not in NOT_COLLECTIVES:
                self._record(name, args, out)
        return out

    def _record(self, name: str, args: tuple, out: Any) -> None:
        if name not in BYTE_MODEL:
            raise UncountedCollective(
                f"zeropp: the ledger has no byte model for the collective {name}; add it to comm/observed.py"
            )
        op, passes, which = BYTE_MODEL[name]
        group = self.comm.topology.group_named(_group_name(args))
        tensors = tree_flatten(out if which == "output" else args[0])[0]
        buffer = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
        self.comm.record_observed(op, group, buffer, passes)


def _group_name(args: tuple) -> str:
    """Functional collectives name their process group last among their string arguments."""
    names = [a for a in args if isinstance(a, str)]
    return names[-1]
