"""DTensor styles for transformers' ``Conv1D``, the linear layer of Hugging Face's GPT-2 (its plan:
:func:`zeropp.tensor_parallel.plans.gpt2_plan`).

GPT-2's linear layers are ``Conv1D``: a weight of (in, out) and ``addmm(bias, x, weight)``, which
torch's ColwiseParallel and RowwiseParallel refuse (they know ``nn.Linear``, whose weight is (out,
in)). The styles here are those two with the weight's other dimension: column-wise splits the weight
on dim 1 and the bias on dim 0, row-wise the weight on dim 0 and keeps the bias whole (added once,
after the all-reduce). Their input and output hooks are torch's own, so the traffic is Megatron's.

Attention's ``c_attn`` computes [q | k | v] side by side (3 x hidden columns). A plain column split
would give the first rank all of q and part of k; each rank needs its heads of all three. Its
weight and bias are therefore ``_StridedShard(dim, split_factor=3)``: rank r holds chunk r of each
third, and DTensor's ``addmm`` keeps that placement through forward and backward (no traffic), while
``full_tensor()`` is the Hugging Face layout, so checkpoints and exports are standard. Such a piece
is not one block of the whole tensor; :func:`zeropp.zero.weights.dtensor_params.blocks` says which blocks it is.
"""

from __future__ import annotations

from functools import partial

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.distributed.tensor.placement_types import Placement, _StridedShard


def _split(dim: int, fused: int) -> Placement:
    """A split on `dim`; of each of `fused` side-by-side parts when there are several."""
    return Shard(dim) if fused == 1 else _StridedShard(dim, split_factor=fused)


def _distribute(style: ColwiseParallel | RowwiseParallel, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """`module`'s parameters placed as ``style.param_placements`` says, with the style's own hooks."""
    if type(module).__name__ != "Conv1D":
        raise NotImplementedError(
            f"{type(style).__name__} supports transformers' Conv1D only, not {type(module).__name__}"
        )

    def partition(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for key, placement in style.param_placements.items():
            param = getattr(module, key)
            split = distribute_tensor(param, mesh, [placement], src_data_rank=style.src_data_rank)
            module.register_parameter(key, nn.Parameter(split, requires_grad=param.requires_grad))

    return distribute_module(
        module,
        mesh,
        partition,
        partial(style._prepare_input_fn, style.input_layouts, style.desired_input_layouts),
        partial(style._prepare_output_fn, style.output_layouts, style.use_local_output),
    )


class Conv1DColwise(ColwiseParallel):
    """ColwiseParallel for ``Conv1D``: weight split on dim 1, bias on dim 0; of each of `fused`
    side-by-side outputs (GPT-2's c_attn: 3) when there are several."""

    def __init__(self, fused: int = 1, input_layouts: Placement | None = None) -> None:
        super().__init__(input_layouts=input_layouts, output_layouts=_split(-1, fused))
        self.param_placements = {"weight": _split(1, fused), "bias": _split(0, fused)}

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return _distribute(self, module, device_mesh)


class Conv1DRowwise(RowwiseParallel):
    """RowwiseParallel for ``Conv1D``: weight split on dim 0, bias whole (added after the all-reduce)."""

    def __init__(self, output_layouts: Placement | None = None) -> None:
        super().__init__(output_layouts=output_layouts)
        self.desired_input_layouts = (Shard(-1),)
        self.param_placements = {"weight": Shard(0), "bias": Replicate()}

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return _distribute(self, module, device_mesh)


class LocalHeads(ParallelStyle):
    """GPT2Attention computing its rank's heads: ``split_size`` (where its forward cuts c_attn's output
    into q, k and v) becomes hidden / tp, the width of each of them on this rank; ``num_heads``
    becomes n_head / tp, as torchtitan sets its attention's n_heads (its forward infers the heads
    from the width; ``head_dim`` and the scaling stay)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp = device_mesh.size()
        module.split_size //= tp
        module.num_heads //= tp
        return module
