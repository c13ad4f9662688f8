"""ZeRO++'s quantized collectives, built on the Communicator's recorded all-gather and all-to-all.

- qwZ (:func:`all_gather_quantized`): every rank's block-quantized shard (int8 or int4 data plus
  fp32 scales) is all-gathered and dequantized on arrival, own shard included, so every rank
  computes with the same weights. qWD (:mod:`zeropp.comm.quantized_delta`) gathers the shards'
  changes the same way (:func:`gather_rows`).
- qgZ (:func:`reduce_scatter_quantized`): a reduce-scatter-mean made of two all-to-alls. The
  flat gradient (W = X ranks per node * Y nodes slices, slice z owned by rank z) is quantized
  in the send order of :func:`~zeropp.index.flat.qgz_send_order`, exchanged inside the node,
  dequantized and summed in fp32, quantized again, exchanged across nodes (one rank per node),
  dequantized, summed in fp32 and divided by W. Each rank sends (X-1)/X of its bits inside the
  node and (Y-1)/(X*Y) across nodes: with int4 against 16-bit gradients a quarter of what the
  ring reduce-scatter sends per node, or less.

Every exchanged row travels as one uint8 message, its fp32 scales then its data (:func:`joined`,
:func:`split`): one collective per gather or hop instead of one for the data and one for the scales.
On the CPU the messages sent and received are reused (:class:`MessagePool`): a buffer goes back to
the pool once its collective has completed and what it received has been dequantized.

Pipelining: the columns of the slices are cut into chunks (``chunks`` per reduce bucket). All
chunks start their intra-node exchange at once; as each finishes it is reduced, re-quantized
and its inter-node exchange starts, so the inter-node hop of chunk k runs while the intra-node
hop of chunk k+1 is still in flight (ZeRO++ section 4.1.2). Chunk k's columns of every slice form
pipeline stage k of Algorithm 2 (:func:`~zeropp.index.flat.qgz_slice_order`).

Error bound of qgZ per element, with a = the block absmax of each input and of each node's
partial sum: |result - exact mean| <= (sum over ranks of a_rank / qmax_1 + sum over nodes of
a_node / qmax_2) / (2 * W), plus the rounding of the output dtype (qmax_1, qmax_2: the hops' own).

Options (ZeroConfig's ``gradient_*`` keys): two-level qgZ quantizes hop 1 with ``intra_spec`` (int8
inside the node) and hop 2 with ``spec`` (int4 across nodes: cross-node bytes unchanged); without an
``intra_spec`` hop 1 carries the gradients unquantized (``gradient_intra_node_bits = 0``: the node's
sums are exact in fp32 and quantized once, for hop 2; on a fast intra-node link this saves the
largest quantization of the step, the whole unit's, at (X-1)/X of the unit in the gradient dtype
sent inside the node);
``hadamard`` rotates every block before hop 1 and rotates the result back
(:mod:`zeropp.quant.hadamard`; the bound above then holds in the rotated basis); ``feedback``
compensates both hops' quantizations with this rank's residuals (:mod:`zeropp.comm.feedback`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from zeropp.comm.communicator import Communicator, Pending
from zeropp.comm.feedback import ErrorFeedback
from zeropp.index.flat import qgz_column_chunks, qgz_send_order
from zeropp.quant.backends import backend_of
from zeropp.quant.spec import Quantized, QuantKernels, QuantSpec
from zeropp.topology import Group, ShardGroups


def all_gather_quantized(
    comm: Communicator,
    out: torch.Tensor,
    shard: torch.Tensor,
    spec: QuantSpec,
    group: Group,
    kernels: QuantKernels,
    *,
    bucket_numel: int,
    async_op: bool = False,
    stream: torch.cuda.Stream | None = None,
) -> Pending:
    """Quantize this rank's `shard`, gather every group rank's, dequantize all of them into `out`.

    With a CUDA `stream`, the quantization and the gathers are issued on it (ZeRO++ 4.1.1): a
    prefetch then quantizes the next unit while the current one computes. Only stream waits order
    the work; nothing waits on the host. Dequantization runs on the caller's stream when the
    result is waited for.
    """
    n, width = group.size, shard.numel()
    with on_stream(stream):
        if stream is not None:  # e.g. an offloaded shard staged on the caller's stream, which may free it
            shard.record_stream(stream)
        quantized = kernels.quantize(shard.view(1, -1), spec)

    def land(received: Quantized) -> None:
        kernels.dequantize(received, out.dtype, out=out.view(n, width))

    return gather_rows(comm, quantized, group, land, bucket_numel=bucket_numel, async_op=async_op, stream=stream)


def gather_rows(
    comm: Communicator,
    row: Quantized,
    group: Group,
    land: Callable[[Quantized], None],
    *,
    bucket_numel: int,
    async_op: bool = False,
    stream: torch.cuda.Stream | None = None,
) -> Pending:
    """Gather every group rank's quantized `row` (one ``joined`` message each; with a CUDA `stream`, issued
    on it), then hand the group's rows to `land` on the caller's stream; the messages go back to the pool."""
    n, device = group.size, row.data.device
    with on_stream(stream):
        message = joined(row, messages)
        gathered = messages.take((n, message.shape[-1]), device)
        works = [comm.all_gather(gathered, message.view(-1), group, bucket_numel=bucket_numel, async_op=True)]

    def finish() -> None:
        if stream is not None:
            consumer = torch.cuda.current_stream(device)
            consumer.wait_stream(stream)
            gathered.record_stream(consumer)  # allocated on the side stream, read on this one
        land(split(gathered, row.n, row.spec))
        messages.give_back(message, gathered)

    pending = Pending(works, finish)
    if not async_op:
        pending.wait()
    return pending


def all_gather_message(
    comm: Communicator,
    out: torch.Tensor,
    message: torch.Tensor,
    width: int,
    spec: QuantSpec,
    group: Group,
    kernels: QuantKernels,
    *,
    bucket_numel: int,
    async_op: bool = False,
) -> Pending:
    """Gather every group rank's `message` (rows of `width` values, quantized once and ``joined``: frozen
    weights stored quantized; hpZ's copy holds several rows) and dequantize all of them into `out`;
    nothing is quantized."""
    n = group.size
    rows = n * message.numel() // (4 * spec.blocks(width) + spec.row_bytes(width))
    gathered = messages.take((n, message.numel()), out.device)
    works = [comm.all_gather(gathered, message.view(-1), group, bucket_numel=bucket_numel, async_op=True)]

    def land() -> None:
        kernels.dequantize(split(gathered.view(rows, -1), width, spec), out.dtype, out=out.view(rows, width))
        messages.give_back(gathered)

    pending = Pending(works, land)
    if not async_op:
        pending.wait()
    return pending


class MessagePool:
    """Message buffers (uint8, or the gradient dtype for an unquantized hop), taken for a collective and
    given back once it has completed and its contents have been read. Only CPU buffers are kept (a fresh one above glibc's mmap threshold
    faults its pages in at every use; CUDA's caching allocator reuses memory already, and a buffer
    recycled across streams could race).

    A taken buffer is the most recently given back one of its shape and dtype. The pool holds at most
    ``KEPT_PER_PEAK`` times the most bytes ever in use at once, dropping the longest unused buffers
    first: a bound set by the messages in flight (a unit's gathers and qgZ hops, times the prefetch
    depth), not by how many unit shapes a model has. The factor leaves room for one step's distinct
    shapes of a transformer (embedding, block and head units; qwZ in forward, qwZ and qgZ in
    backward: the 6 x 256 bench GPT keeps 1.8 times its peak). After the first step a buffer is
    allocated only when more messages of a shape are in flight at once than before (or the bound
    dropped one): `allocations` counts them.
    """

    KEPT_PER_PEAK = 4

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []  # oldest given back first
        self._kept = self._in_use = self._peak = 0  # bytes
        self.allocations = 0  # CPU buffers it had to allocate

    def take(self, shape: tuple[int, ...], device: torch.device, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        if device.type != "cpu":
            return torch.empty(shape, dtype=dtype, device=device)
        free = self._free
        newest = next(
            (i for i in range(len(free) - 1, -1, -1) if (free[i].shape, free[i].dtype) == (shape, dtype)), None
        )
        if newest is None:
            buffer = torch.empty(shape, dtype=dtype)
            self.allocations += 1
        else:
            buffer = free.pop(newest)
            self._kept -= buffer.nbytes
        self._in_use += buffer.nbytes
        self._peak = max(self._peak, self._in_use)
        return buffer

    def give_back(self, *buffers: torch.Tensor) -> None:
        for buffer in buffers:
            if buffer.device.type == "cpu":
                self._in_use -= buffer.nbytes
                self._kept += buffer.nbytes
                self._free.append(buffer)
        while self._kept > self.KEPT_PER_PEAK * self._peak:
            self._kept -= self._free.pop(0).nbytes

    def kept_bytes(self) -> int:
        return self._kept

    def release(self) -> None:
        """Drop the kept buffers and forget the peak (e.g. once qgZ is switched off for good)."""
        self._free.clear()
        self._kept, self._peak = 0, self._in_use


messages = MessagePool()  # one per process: the collectives of every unit share it


def joined(q: Quantized, pool: MessagePool | None = None) -> torch.Tensor:
    """`q`'s rows as uint8 messages [rows, bytes], each a row's fp32 scales then its data: one
    collective moves both (the same bytes as two, half the calls). In a buffer of `pool` if given."""
    scales = q.scales.reshape(-1, q.scales.shape[-1]).contiguous().view(torch.uint8)
    data = q.data.reshape(-1, q.data.shape[-1]).view(torch.uint8)
    if pool is None:
        return torch.cat((scales, data), dim=1)
    shape = (scales.shape[0], scales.shape[1] + data.shape[1])
    return torch.cat((scales, data), dim=1, out=pool.take(shape, data.device))


def split(messages: torch.Tensor, n: int, spec: QuantSpec) -> Quantized:
    """The quantized rows of `n` values in ``joined`` messages [rows, bytes]; the data is a view."""
    scale_bytes = 4 * spec.blocks(n)
    scales = messages[:, :scale_bytes].contiguous().view(torch.float32)
    return Quantized(messages[:, scale_bytes:].view(spec.data_dtype), scales, n, spec)


def on_stream(stream: torch.cuda.Stream | None):
    """Issue work on `stream` after what the current stream has queued (its input is ready then)."""
    if stream is None:
        return contextlib.nullcontext()
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    return torch.cuda.stream(stream)


def reduce_scatter_quantized(
    comm: Communicator,
    shard: torch.Tensor,
    full: torch.Tensor,
    spec: QuantSpec,
    kernels: QuantKernels,
    groups: ShardGroups,
    *,
    chunks: int,
    bucket_numel: int,
    intra_spec: QuantSpec | None,
    min_chunk: int = 1,
    hadamard_rotation: bool = False,
    feedback: ErrorFeedback | None = None,
) -> Pending:
    """Mean of `full` over the shard group, this rank's slice into `shard` (``shard = mean[rank]``), via qgZ.

    The group's X ranks per node form ``groups.intra_node`` and its Y nodes ``groups.inter_node``.
    The shard's columns are reduced in chunks (:func:`~zeropp.index.flat.qgz_column_chunks`: `chunks`
    per bucket of `bucket_numel`, none under `min_chunk` columns). The intra-node exchanges start
    now, and `full` is no longer read once this returns.
    ``start_ready_hops`` on the returned Pending starts the inter-node exchange of every chunk whose
    intra-node exchange has completed (the runtime calls it as backward goes on); waiting on it
    runs the rest.
    """
    x, y = groups.intra_node.size, groups.inter_node.size
    assert x * y == groups.shard.size and full.numel() == x * y * shard.numel(), (x, y, full.numel(), shard.numel())
    columns = qgz_column_chunks(shard.numel(), bucket_numel, chunks, min_chunk)
    rotation_block = spec.block_size if hadamard_rotation else None
    reduction = _QgzReduction(comm, shard, (intra_spec, spec), kernels, groups, columns, rotation_block, feedback)
    reduction.start_intra(full.view(x * y, shard.numel()))
    if y == 1:  # one node: the intra-node sums are the result, no second quantization
        return Pending([], reduction.land_one_node)
    # Inter-node hops may start early only on a group no other collective uses (every rank must
    # issue a group's collectives in the same order); with one rank per node it is the shard group.
    may_start_early = groups.inter_node.ranks != groups.shard.ranks
    return Pending([], reduction.land, start_hops=reduction.start_inter if may_start_early else None)


@dataclass
class _Arriving:
    """A ``joined`` message in flight (one all-to-all) and the quantized rows it holds once waited for;
    without a `spec`, unquantized rows [rows, n] in the gradient dtype."""

    pending: Pending
    sent: torch.Tensor
    message: torch.Tensor
    n: int
    spec: QuantSpec | None

    def wait(self) -> Quantized | torch.Tensor:
        self.pending.wait()
        return self.message if self.spec is None else split(self.message, self.n, self.spec)

    def done(self) -> None:
        """What arrived has been read: both buffers go back to the pool."""
        messages.give_back(self.sent, self.message)


class _QgzReduction:
    """One qgZ reduction in flight: its column chunks and each chunk's hops."""

    def __init__(
        self,
        comm: Communicator,
        shard: torch.Tensor,
        specs: tuple[QuantSpec, QuantSpec],
        kernels: QuantKernels,
        groups: ShardGroups,
        columns: list[tuple[int, int]],
        rotation_block: int | None,
        feedback: ErrorFeedback | None,
    ) -> None:
        self.comm, self.shard, self.kernels, self.groups = comm, shard, kernels, groups
        self.unit = comm.trace.unit  # the later hops belong to the unit that started the reduction
        self.intra_spec, self.inter_spec = specs
        self.rotation_block, self.feedback = rotation_block, feedback
        self.rotate = backend_of(kernels).rotate
        self.columns = columns
        self.intra: list[_Arriving | None] = []
        self.inter: list[_Arriving] = []

    def _exchange(self, q: Quantized | torch.Tensor, group: Group) -> _Arriving:
        """Start the all-to-all of quantized rows (one ``joined`` message each), or of plain rows."""
        quantized = isinstance(q, Quantized)
        message = joined(q, messages) if quantized else q
        received = messages.take(tuple(message.shape), message.device, message.dtype)
        pending = self.comm.all_to_all(received, message, group, async_op=True)
        return _Arriving(pending, message, received, q.n if quantized else q.shape[-1], q.spec if quantized else None)

    def start_intra(self, slices: torch.Tensor) -> None:
        """Hop 1 for every chunk: rows in send order, chunk j of the buffer (Y rows) to local rank j."""
        x, y = self.groups.intra_node.size, self.groups.inter_node.size
        order = _send_order(x, y, slices.device)
        for start, stop in self.columns:
            chunk = slices[:, start:stop]
            if self.rotation_block is not None:
                chunk = self.rotate(chunk, self.rotation_block)
            if self.intra_spec is None:  # unquantized: the rows in send order, in a pooled buffer
                sent = torch.index_select(
                    chunk, 0, order, out=messages.take(tuple(chunk.shape), chunk.device, chunk.dtype)
                )
            elif self.feedback is None:
                sent = self.kernels.quantize(chunk, self.intra_spec, row_order=order)
            else:
                rows = chunk.index_select(0, order)
                sent = self.feedback.quantize(self.kernels, "intra", rows, self.intra_spec, start, slices.shape[1])
            self.intra.append(self._exchange(sent, self.groups.intra_node))

    def start_inter(self, block: bool) -> bool:
        """Start inter-node hops in chunk order, up to the first unfinished intra-node hop unless
        `block`; return whether all have started."""
        with self.comm.trace.labelled(self.unit):
            return self._start_inter(block)

    def _start_inter(self, block: bool) -> bool:
        x, y = self.groups.intra_node.size, self.groups.inter_node.size
        while len(self.inter) < len(self.columns):
            arriving = self.intra[len(self.inter)]
            if not block and not arriving.pending.is_completed():
                return False
            # X sources x Y slices (one per node, for this local rank) -> Y partial sums
            received = arriving.wait()
            if self.feedback is None and isinstance(received, Quantized):
                partial = self.kernels.dequantize_reduce_quantize(received.reshape(x, y), self.inter_spec)
            else:
                sums = self._sums(received, x)
                start = self.columns[len(self.inter)][0]
                partial = (
                    self.kernels.quantize(sums, self.inter_spec)
                    if self.feedback is None
                    else self.feedback.quantize(self.kernels, "inter", sums, self.inter_spec, start, self.shard.numel())
                )
            arriving.done()
            self.intra[len(self.inter)] = None  # the received chunk is no longer needed
            self.inter.append(self._exchange(partial, self.groups.inter_node))
        return True

    def land(self) -> None:
        self.start_inter(block=True)
        for (start, stop), arriving in zip(self.columns, self.inter, strict=True):
            self._reduce_into(arriving.wait(), self.shard[start:stop])
            arriving.done()

    def land_one_node(self) -> None:
        for (start, stop), arriving in zip(self.columns, self.intra, strict=True):
            self._reduce_into(arriving.wait(), self.shard[start:stop].view(1, -1))
            arriving.done()

    def _sums(self, received: Quantized | torch.Tensor, sources: int) -> torch.Tensor:
        """fp32 sums over the `sources` (dimension 0) of what a hop received: [rows / sources, columns]."""
        if isinstance(received, Quantized):
            return self.kernels.dequantize_reduce(received.reshape(sources, -1), torch.float32)
        rows = received.view(sources, -1, received.shape[-1])  # ((x0 + x1) + x2) + ..., as dequantize_reduce sums
        total = rows[0].to(torch.float32, copy=True) if sources == 1 else torch.add(rows[0].float(), rows[1])
        for source in rows[2:]:
            total += source
        return total

    def _reduce_into(self, received: Quantized | torch.Tensor, out: torch.Tensor) -> None:
        divisor = self.groups.shard.size
        if self.rotation_block is None and isinstance(received, Quantized):
            self.kernels.dequantize_reduce(received, out.dtype, divisor=divisor, out=out)
            return
        # a one-element tensor: a true division, as dequantize_reduce divides
        sources = (received.data if isinstance(received, Quantized) else received).shape[0]
        mean = self._sums(received, sources).div_(torch.full((1,), divisor, dtype=torch.float32))
        if self.rotation_block is not None:
            mean = self.rotate(mean.view(1, -1), self.rotation_block, inverse=True)
        out.copy_(mean.view(out.shape))


@functools.lru_cache(maxsize=8)
def _send_order(ranks_per_node: int, nodes: int, device: torch.device) -> torch.Tensor:
    return torch.tensor(qgz_send_order(ranks_per_node, nodes), device=device)
