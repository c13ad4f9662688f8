"""How a sharded unit's weights are gathered: inside hpZ's secondary group, as changes since the last
gather (qWD), quantized (qwZ), or plainly."""

from __future__ import annotations

import torch

from zeropp.comm.communicator import Communicator, Pending
from zeropp.comm.quantized import all_gather_quantized
from zeropp.comm.quantized_delta import all_gather_delta
from zeropp.topology import ShardGroups
from zeropp.zero.options import UnitOptions
from zeropp.zero.weights.reference import WeightReference


def start_weight_gather(
    comm: Communicator,
    options: UnitOptions,
    groups: ShardGroups,
    out: torch.Tensor,
    shard: torch.Tensor,
    secondary: torch.Tensor | None,
    reference: WeightReference | None = None,
) -> Pending:
    """Start gathering every rank's `shard` into `out`: from `secondary` (hpZ's copy, when the caller
    says it is valid) inside the secondary group in the compute dtype, else over the shard group (qWD,
    given the unit's `reference`: the changes since it, or the full weights unquantized where it is not
    usable; qwZ: quantized), asynchronously."""
    bucket = options.allgather_bucket
    if secondary is not None:
        return comm.all_gather(out, secondary, groups.secondary, bucket_numel=bucket, async_op=True)
    # offloaded parameters, staged: the gather below is ordered after the copy (NCCL waits on the current
    # stream; qwZ's side stream waits on it and records the staged shard)
    source = shard.to(options.device, non_blocking=True)
    if reference is not None and reference.usable:  # See [Note: qWD's reference] (docs/design.md)
        base = comm.all_gather(out, reference.secondary, groups.secondary, bucket_numel=bucket, async_op=True)
        return all_gather_delta(
            comm, out, source, reference.shard, base, options.weight_quant, groups.shard, options.kernels,
            bucket_numel=bucket, async_op=True, stream=options.quant_stream,
        )  # fmt: skip
    if options.weight_quant is not None and reference is None:  # qwZ
        return all_gather_quantized(
            comm, out, source, options.weight_quant, groups.shard, options.kernels,
            bucket_numel=bucket, async_op=True, stream=options.quant_stream,
        )  # fmt: skip
    return comm.all_gather(out, source, groups.shard, bucket_numel=bucket, async_op=True)
