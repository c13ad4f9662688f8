"""DTensor parameters as one rank holds them: split or whole, the local piece and where it sits in
the whole tensor, and pointing a parameter at new local storage (as FSDP2 does).

A tensor-parallel plan (:mod:`zeropp.tensor_parallel`) turns some parameters into DTensors on the
tensor-parallel group; the engine only ever stores, gathers and reduces their local pieces.

A piece is usually one block of the whole tensor (``Shard(d)``: a range of dimension d). A
``_StridedShard(d, k)`` piece (GPT-2's fused [q | k | v], :mod:`zeropp.tensor_parallel.conv1d`) is a range
of each of the k equal parts of dimension d, side by side: k blocks. :func:`blocks` lists a piece's
blocks, each with where it sits in the piece and in the whole; what cuts or reads pieces of whole
tensors (meta-device initialization, pretrained weights, checkpoints) goes through it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from zeropp.index.flat import chunk_range

Slices = tuple[slice, ...]
EXPERT_SPLIT = "_zeropp_expert_split"  # on a parameter split over the expert-parallel group: that Group


def splits(placement: Placement) -> bool:
    """Whether a placement splits a tensor: ``Shard`` or ``_StridedShard`` (which is not a Shard)."""
    return isinstance(placement, Shard | _StridedShard)


def is_split(param: torch.Tensor) -> bool:
    """Whether a parameter is split over the tensor-parallel ranks (else each holds all of it)."""
    return isinstance(param, DTensor) and any(splits(p) for p in param.placements)


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    """A parameter as this rank holds it: a DTensor's local shard, else itself."""
    return param._local_tensor if isinstance(param, DTensor) else param


def expert_group(param: torch.Tensor) -> Any:
    """The expert-parallel group a parameter's experts (its rows) are split over, or None (See
    :mod:`zeropp.expert_parallel`: each rank keeps rows [rank n/E, (rank + 1) n/E) of stacked weights)."""
    return getattr(param, EXPERT_SPLIT, None)


def whole_shape(param: torch.Tensor) -> tuple[int, ...]:
    """A parameter's shape in the model one process trains: a DTensor's global shape, an expert-parallel
    piece's rows times its group (at least one dimension)."""
    experts = expert_group(param)
    shape = tuple(param.shape) if experts is None else (param.shape[0] * experts.size, *param.shape[1:])
    return shape or (1,)


def blocks(param: torch.Tensor, rows: tuple[int, int] | None = None) -> list[tuple[Slices, Slices]]:
    """This rank's piece of a parameter as blocks of the whole tensor: (where in the piece, where in
    the whole) per block, in the piece's order. One block unless the piece is strided (see above); a
    parameter that is not split: the whole, at the origin. With `rows` = [start, stop): the blocks of
    those rows of the piece (its first dimension), placed in them as if they were the piece."""
    whole = tuple(slice(0, n) for n in param.shape)
    experts = expert_group(param)
    if experts is not None:  # this rank's experts: its rows of the stacked weights (of those `rows`)
        first, last = rows or (0, param.shape[0])
        start = experts.rank * param.shape[0] + first
        return [((slice(0, last - first), *whole[1:]), (slice(start, start + last - first), *whole[1:]))]
    out = [(whole, whole)]
    if is_split(param):
        (placement,) = param.placements  # tensor parallelism: a 1-D mesh
        mesh, dim, n = param.device_mesh, placement.dim, param.shape[placement.dim]
        # a Shard is one torch.chunk range of dim; a _StridedShard(dim, k) that range of each of its k parts
        parts = placement.split_factor if isinstance(placement, _StridedShard) else 1
        start, stop = chunk_range(n // parts, mesh.size(), mesh.get_local_rank())
        indices = [part * (n // parts) + i for part in range(parts) for i in range(start, stop)]
        runs: list[list[int]] = []  # [start, stop) of consecutive indices
        for i in indices:
            if runs and runs[-1][1] == i:
                runs[-1][1] += 1
            else:
                runs.append([i, i + 1])
        out, at = [], 0
        for start, stop in runs or [[0, 0]]:
            cuts = (slice(at, at + stop - start), slice(start, stop))
            out.append(tuple((*whole[:dim], cut, *whole[dim + 1 :]) for cut in cuts))
            at += stop - start
    if rows is None or not whole:
        return out
    first, last = rows
    cut = []
    for piece, where in out:  # the rows of each block among [first, last)
        lo, hi = max(piece[0].start, first), min(piece[0].stop, last)
        if lo < hi:
            shift = where[0].start - piece[0].start
            cut.append(((slice(lo - first, hi - first), *piece[1:]), (slice(lo + shift, hi + shift), *where[1:])))
    return cut


def block_of(whole: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `whole`, a tensor of `param`'s whole shape (a view where it is one block)."""
    (_, where), *rest = pieces = blocks(param)
    if not rest:
        return whole[where]
    out = torch.empty(local_tensor(param).shape, dtype=whole.dtype, device=whole.device)
    for piece, where in pieces:
        out[piece] = whole[where]
    return out


def point_at(param: nn.Parameter, tensor: torch.Tensor) -> None:
    """Make `param` use `tensor` as its storage: a DTensor parameter as its local piece. One taking
    another dtype (mixed precision) or device (from the meta device or the host) becomes a DTensor of
    it, in place (``swap_tensors``: the same object, so the module and the units keep it)."""
    if not isinstance(param, DTensor) and not (param.is_meta and expert_group(param) is not None):
        param.data = tensor
    elif not isinstance(param, DTensor):  # an expert-parallel piece, from the meta device
        experts = expert_group(param)
        torch.utils.swap_tensors(param, nn.Parameter(tensor, requires_grad=param.requires_grad))
        setattr(param, EXPERT_SPLIT, experts)  # swapped with the attributes
    elif (param.dtype, param.device) == (tensor.dtype, tensor.device):
        param._local_tensor = tensor
    else:
        spec = dict(run_check=False, shape=param.shape, stride=param.stride())
        moved = DTensor.from_local(tensor, param.device_mesh, param.placements, **spec)
        torch.utils.swap_tensors(param, nn.Parameter(moved, requires_grad=param.requires_grad))
