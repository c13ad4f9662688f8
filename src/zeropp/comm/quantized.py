"""ZeRO++'s quantized collectives, built on the Communicator's recorded all-gather and all-to-all.

- qwZ (:func:`all_gather_quantized`): every rank's block-quantized shard (int8 or int4 data plus
  fp32 scales) is all-gathered and dequantized on arrival, own shard included, so every rank
  computes with the same weights.
- qgZ (:func:`reduce_scatter_quantized`): a reduce-scatter-mean made of two all-to-alls. The
  flat gradient (W = X ranks per node * Y nodes slices, slice z owned by rank z) is quantized
  in the send order of :func:`~zeropp.partition.qgz_send_order`, exchanged inside the node,
  dequantized and summed in fp32, quantized again, exchanged across nodes (one rank per node),
  dequantized, summed in fp32 and divided by W. Each rank sends (X-1)/X of its bits inside the
  node and (Y-1)/(X*Y) across nodes: with int4 against 16-bit gradients a quarter of what the
  ring reduce-scatter sends per node, or less.

Pipelining: the columns of the slices are cut into chunks (``stages`` per reduce bucket). All
chunks start their intra-node exchange at once; as each finishes it is reduced, re-quantized
and its inter-node exchange starts, so the inter-node hop of chunk k runs while the intra-node
hop of chunk k+1 is still in flight (ZeRO++ section 4.1.2). Chunk k's columns of every slice form
pipeline stage k of Algorithm 2 (:func:`~zeropp.partition.qgz_slice_order`).

Error bound of qgZ per element, with a = the block absmax of each input and of each node's
partial sum: |result - exact mean| <= (sum over ranks of a_rank + sum over nodes of a_node)
/ (2 * qmax * W), plus the rounding of the output dtype.
"""

from __future__ import annotations

import functools
import math
from types import ModuleType

import torch

from zeropp.comm import Communicator, Pending
from zeropp.partition import column_chunks, qgz_send_order
from zeropp.quant import Quantized, QuantSpec
from zeropp.topology import Group


def all_gather_quantized(
    comm: Communicator,
    out: torch.Tensor,
    shard: Quantized,
    group: Group,
    kernels: ModuleType,
    *,
    bucket_numel: int,
    async_op: bool = False,
) -> Pending:
    """Gather every group rank's quantized shard (one row of `shard.n` values) into `out`, dequantized."""
    n = group.size
    data = torch.empty((n, shard.data.shape[-1]), dtype=shard.data.dtype, device=out.device)
    scales = torch.empty((n, shard.scales.shape[-1]), dtype=torch.float32, device=out.device)
    works = [
        comm.all_gather(data, shard.data.reshape(-1), group, bucket_numel=bucket_numel, async_op=True),
        comm.all_gather(scales, shard.scales.reshape(-1), group, bucket_numel=bucket_numel, async_op=True),
    ]

    def land() -> None:
        kernels.dequantize(Quantized(data, scales, shard.n, shard.spec), out.dtype, out=out.view(n, shard.n))

    pending = Pending(works, land)
    if not async_op:
        pending.wait()
    return pending


def reduce_scatter_quantized(
    comm: Communicator,
    shard: torch.Tensor,
    full: torch.Tensor,
    spec: QuantSpec,
    kernels: ModuleType,
    *,
    stages: int,
    bucket_numel: int,
) -> Pending:
    """Mean of `full` over the world, this rank's slice into `shard` (``shard = mean[rank]``), via qgZ.

    The intra-node exchanges start now; waiting on the result runs the rest of the pipeline.
    """
    topo = comm.topology
    x, y, world = topo.ranks_per_node, topo.nodes, topo.world_size
    width = shard.numel()
    assert full.numel() == world * width, (full.numel(), world, width)
    slices = full.view(world, width)
    send_order = _send_order(x, y, full.device)
    chunks = column_chunks(width, math.ceil(width / bucket_numel) * stages)

    def exchange(q: Quantized, group: Group) -> tuple[list[Pending], Quantized]:
        received = Quantized(torch.empty_like(q.data), torch.empty_like(q.scales), q.n, q.spec)
        works = [
            comm.all_to_all(received.data, q.data, group, async_op=True),
            comm.all_to_all(received.scales, q.scales, group, async_op=True),
        ]
        return works, received

    # hop 1 for every chunk: rows in send order, chunk j of the buffer (Y rows) to local rank j
    intra = [
        exchange(kernels.quantize(slices[:, start:stop], spec, row_order=send_order), topo.intra_node)
        for start, stop in chunks
    ]

    def finish() -> None:
        inter = []
        for works, received in intra:
            for work in works:
                work.wait()
            # X sources x Y slices (one per node, for this local rank) -> Y partial sums
            partial = kernels.dequantize_reduce_quantize(received.reshape(x, y), spec)
            inter.append(exchange(partial, topo.inter_node))
        for (start, stop), (works, received) in zip(chunks, inter, strict=True):
            for work in works:
                work.wait()
            kernels.dequantize_reduce(received, shard.dtype, divisor=world, out=shard[start:stop])

    return Pending([], finish)


@functools.lru_cache(maxsize=8)
def _send_order(ranks_per_node: int, nodes: int, device: torch.device) -> torch.Tensor:
    return torch.tensor(qgz_send_order(ranks_per_node, nodes), device=device)
