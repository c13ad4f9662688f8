"""What a plan costs, without applying it: the elements each tensor-parallel rank holds of every
parameter (for the estimator; the model may live on the meta device) and the bytes a transformer
block sends per micro-batch (Megatron's layout, with or without sequence parallelism).
"""

from __future__ import annotations

import math
from fnmatch import fnmatch

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from zeropp.costs.volume import SEQUENCE_PARALLEL_RECOMPUTED, megatron_transfers, sequence_parallel_transfers
from zeropp.tensor_parallel.plans import Plan
from zeropp.zero.dtensor_params import splits

# (style, module type) -> {parameter: the dimension the style shards it on}; what parallelize_module does
# (a style with ``param_placements``, such as zeropp.tensor_parallel.conv1d's, says it itself)
SHARDED_DIMS: tuple[tuple[type[ParallelStyle], type[nn.Module], dict[str, int]], ...] = (
    (ColwiseParallel, nn.Linear, {"weight": 0, "bias": 0}),
    (ColwiseParallel, nn.Embedding, {"weight": 1}),
    (RowwiseParallel, nn.Linear, {"weight": 1}),  # the bias stays whole: added once, after the all-reduce
    (RowwiseParallel, nn.Embedding, {"weight": 0}),
)


def local_numels(model: nn.Module, plan: Plan, tp: int) -> dict[str, int]:
    """{parameter name: elements the first tensor-parallel rank holds} once `plan` splits `model` over
    tp ranks, without splitting it (the model may live on the meta device): a sharded dimension of n
    becomes ceil(n / tp), as ``torch.chunk`` gives the first rank; the rest stays whole."""
    styles = {}
    for name, module in model.named_modules():
        for pattern, style in plan.items():
            atoms, names = pattern.split("."), name.split(".")
            if len(atoms) == len(names) and all(fnmatch(n, a) for n, a in zip(names, atoms, strict=True)):
                styles[name] = (style, module)
    out = {}
    for name, param in model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        dims = {}
        if owner in styles:
            style, module = styles[owner]
            placements = getattr(style, "param_placements", None)
            if placements is not None:
                dims = {key: p.dim for key, p in placements.items() if splits(p)}
            else:
                dims = next((d for s, m, d in SHARDED_DIMS if isinstance(style, s) and isinstance(module, m)), {})
        shape = list(param.shape)
        if leaf in dims:
            shape[dims[leaf]] = math.ceil(shape[dims[leaf]] / tp)
        out[name] = math.prod(shape)
    return out


def megatron_bytes_per_block(
    batch: int, seq: int, hidden: int, tp: int, element_bytes: int, recomputed: int = 0, sequence_parallel: bool = False
) -> int:
    """Bytes one rank sends per transformer block and micro-batch under Megatron's layout: 4 ring
    all-reduces of batch*seq*hidden, plus the `recomputed` forward all-reduces activation checkpointing
    repeats (:attr:`~zeropp.costs.memory.Activations.recomputed_all_reduces`), 2 (tp-1)/tp of it each. With
    `sequence_parallel` the same bytes without recomputation: 4 all-gathers and 4 reduce-scatters,
    (tp-1)/tp of it each, plus those recomputation repeats (:data:`~zeropp.costs.volume.SEQUENCE_PARALLEL_RECOMPUTED`)."""
    elements = batch * seq * hidden
    if sequence_parallel:
        transfers = sequence_parallel_transfers(elements, element_bytes, tp, SEQUENCE_PARALLEL_RECOMPUTED[recomputed])
    else:
        transfers = megatron_transfers(elements, element_bytes, tp, recomputed)
    return sum(t.sent for t in transfers)
