"""DTensor parameters as one rank holds them: split or whole, the local piece and where it sits in
the whole tensor, and pointing a parameter at new local storage (as FSDP2 does).

A tensor-parallel plan (:mod:`zeropp.tensor_parallel`) turns some parameters into DTensors on the
tensor-parallel group; the engine only ever stores, gathers and reduces their local pieces.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def is_split(param: torch.Tensor) -> bool:
    """Whether a parameter is split over the tensor-parallel ranks (else each holds all of it)."""
    return isinstance(param, DTensor) and any(p.is_shard() for p in param.placements)


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    """A parameter as this rank holds it: a DTensor's local shard, else itself."""
    return param._local_tensor if isinstance(param, DTensor) else param


def local_block(param: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shape of this rank's piece of a parameter and its offset in the whole tensor, per dimension
    (a parameter that is not a DTensor: the whole, at the origin)."""
    if not isinstance(param, DTensor):
        return tuple(param.shape), (0,) * param.dim()
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(shape), tuple(offset)


def block_of(whole: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `whole`, a tensor of `param`'s whole shape (a view)."""
    shape, offset = local_block(param)
    return whole[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]


def point_at(param: nn.Parameter, tensor: torch.Tensor) -> None:
    """Make `param` use `tensor` as its storage: a DTensor parameter as its local piece. One taking
    another dtype (mixed precision) or device (from the meta device or the host) becomes a DTensor of
    it, in place (``swap_tensors``: the same object, so the module and the units keep it)."""
    if not isinstance(param, DTensor):
        param.data = tensor
    elif (param.dtype, param.device) == (tensor.dtype, tensor.device):
        param._local_tensor = tensor
    else:
        spec = dict(run_check=False, shape=param.shape, stride=param.stride())
        moved = DTensor.from_local(tensor, param.device_mesh, param.placements, **spec)
        torch.utils.swap_tensors(param, nn.Parameter(moved, requires_grad=param.requires_grad))
