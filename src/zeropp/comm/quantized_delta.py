"""qWD (SDP4Bit's delta weight quantization): qwZ's all-gather of the weights' change since a reference.

Every rank holds the same reference of the whole buffer: what the last gather reconstructed. Each
rank quantizes its shard's change since its own rows of the reference (fp32 differences, block
quantized with qwZ's spec), the group gathers the quantized changes (one ``joined`` message per rank,
:func:`~zeropp.comm.quantized.gather_rows`), and every rank adds the dequantized changes to the
reference in fp32 and rounds once to the output dtype. Every rank computes the same additions on the
same bits, so the gathered buffers are identical on every rank, own shard included.

The reference is the reconstruction, not the true weights: the next change is measured from what
the ranks computed with, so each gather's error is that one quantization's (at most half a step of
its block, plus the rounding to the output dtype) and errors do not add up over steps.

Where the reference comes from is the caller's concern (:mod:`zeropp.zero.weights.reference`): here it is
gathered into `out` by `base`, a gather already in flight, and both are waited for before the
changes are added.
"""

from __future__ import annotations

import torch

from zeropp.comm.communicator import Communicator, Pending
from zeropp.comm.quantized import gather_rows, on_stream
from zeropp.quant.spec import Quantized, QuantKernels, QuantSpec
from zeropp.topology import Group


def all_gather_delta(
    comm: Communicator,
    out: torch.Tensor,
    shard: torch.Tensor,
    reference: torch.Tensor,
    base: Pending,
    spec: QuantSpec,
    group: Group,
    kernels: QuantKernels,
    *,
    bucket_numel: int,
    async_op: bool = False,
    stream: torch.cuda.Stream | None = None,
) -> Pending:
    """Gather `shard` - `reference` (this rank's rows of the reference) of every group rank quantized and add
    them to `out`, into which `base` gathers the whole reference: ``out = reference + dequantized changes``.

    With a CUDA `stream` the change is computed, quantized and gathered on it (as qwZ does); the additions run
    on the caller's stream once both gathers have landed.
    """
    n, width = group.size, shard.numel()
    with on_stream(stream):
        if stream is not None:  # an offloaded shard staged on the caller's stream, which may free it
            shard.record_stream(stream)
        change = shard.float() - reference.float()  # exact for bf16 and fp16 values
        quantized = kernels.quantize(change.view(1, -1), spec)

    def land(received: Quantized) -> None:
        base.wait()  # the reference is in `out`
        rows = out.view(n, width)
        rows.copy_(kernels.dequantize(received, torch.float32).view(n, width).add_(rows))

    deltas = gather_rows(comm, quantized, group, land, bucket_numel=bucket_numel, async_op=True, stream=stream)
    pending = Pending([base, deltas])
    if not async_op:
        pending.wait()
    return pending
