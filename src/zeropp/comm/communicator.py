"""The one door to the network: every torch.distributed collective of zeropp goes through here.

Each call records what this rank sends into the :class:`~zeropp.comm.ledger.Ledger` (byte model
documented there), under the ledger's current phase. All-gathers and reduce-scatters larger than
the configured bucket are split into constant-size pieces (ZeRO-R's CB), each a separate
collective; the ledger counts one call per logical operation (a quantized collective moves each row's
scales and data in one message, and counts one).

Collectives on the tensor-parallel group are recorded as ``tp.<op>``. DTensor issues its own (tensor
parallelism): inside :meth:`Communicator.in_phase` they are observed (:mod:`zeropp.comm.observed`)
and recorded with the same byte model.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Literal

import torch
import torch.distributed as dist

from zeropp.comm.ledger import Ledger, ring_bytes
from zeropp.comm.observed import ObservedCollectives
from zeropp.comm.sequence import explain_failure
from zeropp.comm.trace import CollectiveTrace, Entry
from zeropp.errors import ZeroppError
from zeropp.topology import Group, Topology

__all__ = ["CollectiveTimeout", "Communicator", "Ledger", "Pending", "PeerLost"]

# torch >= 2.10 names them *_single; older releases only have the *_tensor names
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

ReduceKind = Literal["sum", "mean", "max"]


class CollectiveTimeout(ZeroppError, RuntimeError):
    """A collective did not complete within topology.timeout_s. One line."""


class PeerLost(CollectiveTimeout):
    """Another rank of a collective closed its connection (it died or its launcher stopped it). One line."""


# what gloo and NCCL say (lower case) when a collective outlives topology.timeout_s (gloo's "pair closure":
# a peer stopped, e.g. SIGSTOP, and its side of the connection timed out first), or when a peer is gone
_TIMEOUT_TEXTS = ("timed out", "application timeout caused pair closure")
_PEER_LOST_TEXTS = ("connection reset by peer", "connection closed by peer", "broken pipe")


def _collective_error(error: RuntimeError, explain: Callable[[str], str]) -> CollectiveTimeout | None:
    """The one-line error for a failed collective, or None where it is not one we can name;
    `explain(reason)` writes the flight record and says which rank is behind where ('' if unknown)."""
    text = str(error).lower()
    first = str(error).strip().splitlines()[0]
    if any(t in text for t in _TIMEOUT_TEXTS):
        why = explain("timeout") or f"another rank stopped or is stuck; its own error says why ({first})"
        return CollectiveTimeout(f"zeropp: a collective timed out (topology.timeout_s): {why}")
    if any(t in text for t in _PEER_LOST_TEXTS):
        why = explain("peer lost") or "its own error says why"
        return PeerLost(f"zeropp: another rank of a collective is gone (it died or was stopped); {why}")
    return None


class Pending:
    """Handles of in-flight collectives plus what to do once they have all finished, and optionally
    a way to start the later hops of a multi-hop collective early (qgZ's inter-node exchange).

    c10d's work objects keep their tensors alive until they complete; whoever issued the collective
    keeps its Pending (a unit's gather, the reduction queue) until it has waited for it."""

    def __init__(
        self,
        works: list,
        then: Callable[[], None] | None = None,
        start_hops: Callable[[bool], bool] | None = None,
        issued: tuple[CollectiveTrace, Entry] | None = None,
    ) -> None:
        self._works = [w for w in works if w is not None]
        self._then = then
        self._start_hops = start_hops
        self._issued = issued  # the trace entry of the collective behind `works`, completed at wait

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)

    def start_ready_hops(self, wait: bool = False) -> bool:
        """Start every later hop whose input is ready (with `wait`: every later hop, waiting for
        its input); return True when no hop is left to start (False: a hop waits on an earlier one
        that has not finished).

        Hops must be started in issue order across Pendings (every rank must issue a group's
        collectives in the same order): call it on the oldest first and stop at the first False.
        See [Note: qgZ issue order] (docs/design.md).
        """
        if self._start_hops is None or self._then is None:
            return True
        return self._start_hops(wait)

    def wait(self) -> None:
        for work in self._works:
            try:
                work.wait()
            except CollectiveTimeout:  # a nested Pending's, named already
                raise
            except RuntimeError as error:
                named = _collective_error(error, self._explain)
                if named is None:
                    raise
                raise named from None
        self._works = []
        if self._issued is not None:
            self._issued[1].completed = time.time()
        if self._then is not None:
            then, self._then = self._then, None
            then()

    def _explain(self, reason: str) -> str:
        if self._issued is None:
            return ""
        trace, entry = self._issued
        return explain_failure(trace, trace.world_size, entry, reason)


class Communicator:
    def __init__(self, topology: Topology, ledger: Ledger | None = None) -> None:
        self.topology = topology
        self.ledger = ledger or Ledger()
        self.trace = CollectiveTrace(topology.rank, topology.world_size)

    def _issue(
        self, op: str, group: Group, buffer_bytes: int, label: str | None = None
    ) -> tuple[CollectiveTrace, Entry]:
        """The trace's entry of a collective starting now. See [Note: collective sequences]."""
        return self.trace, self.trace.issue(
            label or self._label(op, group), self.ledger.phase, buffer_bytes, self._role(group)
        )

    def _role(self, group: Group) -> str:
        """The group's name in the topology, the same on every rank (its ranks differ)."""
        topology = self.topology
        for role in ("world", "data_parallel", "tensor_parallel", "intra_node", "inter_node", "context_parallel"):
            if getattr(topology, role).ranks == group.ranks:
                return role
        return f"{group.size}-rank"

    # -- byte accounting -------------------------------------------------------------------------

    def _successor_is_intra(self, group: Group) -> bool:
        successor = group.ranks[(group.rank + 1) % group.size]
        return self.topology.node_of(successor) == self.topology.node_of(self.topology.rank)

    def _label(self, op: str, group: Group) -> str:
        """The ledger's name of an op on `group`: ``tp.<op>`` on the tensor-parallel group."""
        tp = self.topology.tensor_parallel
        return f"tp.{op}" if tp.size > 1 and group.ranks == tp.ranks else op

    def _record_ring(self, op: str, group: Group, buffer_bytes: int, passes: int = 1, label: str | None = None) -> None:
        sent = ring_bytes(buffer_bytes, group.size, passes)
        intra = self._successor_is_intra(group)
        self.ledger.record(label or self._label(op, group), sent if intra else 0, 0 if intra else sent)

    def _record_pairwise(self, op: str, group: Group, buffer_bytes: int, label: str | None = None) -> None:
        """An all-to-all: B/n straight to each other rank of the group, intra- or inter-node by peer."""
        chunk = buffer_bytes // group.size
        here = self.topology.node_of(self.topology.rank)
        peers = [r for r in group.ranks if r != self.topology.rank]
        inter = sum(chunk for r in peers if self.topology.node_of(r) != here)
        self.ledger.record(label or self._label(op, group), chunk * len(peers) - inter, inter)

    def record_observed(self, op: str, group: Group, buffer_bytes: int, passes: int | None) -> None:
        """A collective issued outside zeropp (DTensor's), priced like ours: a ring of `passes`, a
        pairwise exchange (None), or a broadcast (0: the whole buffer forwarded once)."""
        if group.size == 1:
            return
        self._issue(op, group, buffer_bytes)[1].completed = time.time()  # DTensor waits for it, not us
        if passes is None:
            self._record_pairwise(op, group, buffer_bytes)
        elif passes == 0:
            intra = self._successor_is_intra(group)
            self.ledger.record(self._label(op, group), buffer_bytes if intra else 0, 0 if intra else buffer_bytes)
        else:
            self._record_ring(op, group, buffer_bytes, passes)

    @contextlib.contextmanager
    def in_phase(self, phase: str) -> Iterator[None]:
        """The ledger's phase for what runs inside; with tensor parallelism DTensor's own collectives
        are observed and recorded too."""
        observe = self.topology.tensor_parallel.size > 1
        with self.ledger.in_phase(phase), ObservedCollectives(self) if observe else contextlib.nullcontext():
            yield

    # -- collectives -----------------------------------------------------------------------------

    def all_gather(
        self,
        out: torch.Tensor,
        shard: torch.Tensor,
        group: Group,
        *,
        bucket_numel: int,
        async_op: bool = False,
        label: str | None = None,
    ) -> Pending:
        """Gather equal `shard`s of every group rank into `out` (rank-major, size group.size * shard);
        `label`: the ledger's name for it (default ``all_gather``, ``tp.all_gather`` on the tensor-parallel group)."""
        n, s = group.size, shard.numel()
        assert out.numel() == n * s, (out.numel(), n, s)
        if n == 1:
            out.view(-1).copy_(shard.view(-1))
            return Pending([])
        self._record_ring("all_gather", group, out.numel() * out.element_size(), label=label)
        issued = self._issue("all_gather", group, out.numel() * out.element_size(), label)
        if s <= bucket_numel:
            work = _all_gather_single(out.view(-1), shard.view(-1), group=group.pg, async_op=True)
            return self._done(Pending([work], issued=issued), async_op)
        works, pieces = [], []
        rows = out.view(n, s)
        for start in range(0, s, bucket_numel):
            stop = min(start + bucket_numel, s)
            piece = torch.empty(n * (stop - start), dtype=out.dtype, device=out.device)
            works.append(_all_gather_single(piece, shard[start:stop], group=group.pg, async_op=True))
            pieces.append((start, stop, piece))

        def scatter_pieces() -> None:
            for start, stop, piece in pieces:
                rows[:, start:stop].copy_(piece.view(n, stop - start))

        return self._done(Pending(works, scatter_pieces, issued=issued), async_op)

    def reduce_scatter(
        self,
        shard: torch.Tensor,
        full: torch.Tensor,
        group: Group,
        *,
        reduce: ReduceKind = "mean",
        bucket_numel: int,
        async_op: bool = False,
    ) -> Pending:
        """Reduce `full` (rank-major, group.size equal shards) over the group; this rank's shard lands in `shard`."""
        n, s = group.size, shard.numel()
        assert full.numel() == n * s, (full.numel(), n, s)
        if n == 1:
            shard.view(-1).copy_(full.view(-1))
            return Pending([])
        self._record_ring("reduce_scatter", group, full.numel() * full.element_size())
        issued = self._issue("reduce_scatter", group, full.numel() * full.element_size())
        rows = full.view(n, s)
        works = []
        for start in range(0, s, bucket_numel):
            stop = min(start + bucket_numel, s)
            piece = full.view(-1) if (start, stop) == (0, s) else rows[:, start:stop].reshape(-1)
            works.append(
                _reduce_scatter_single(shard[start:stop], piece, op=_op(reduce), group=group.pg, async_op=True)
            )
        return self._done(Pending(works, _mean_fixup(shard, reduce, n), issued=issued), async_op)

    def all_reduce(
        self, tensor: torch.Tensor, group: Group, *, reduce: ReduceKind = "mean", async_op: bool = False
    ) -> Pending:
        if group.size == 1:
            return Pending([])
        self._record_ring("all_reduce", group, tensor.numel() * tensor.element_size(), passes=2)
        issued = self._issue("all_reduce", group, tensor.numel() * tensor.element_size())
        work = dist.all_reduce(tensor, op=_op(reduce), group=group.pg, async_op=True)
        return self._done(Pending([work], _mean_fixup(tensor, reduce, group.size), issued=issued), async_op)

    def all_reduce_coalesced(self, tensors: list[torch.Tensor], group: Group, *, reduce: ReduceKind = "mean") -> None:
        """All-reduce `tensors` (of one dtype) in place as one message: packed, reduced, unpacked."""
        if group.size == 1 or not tensors:
            return
        packed = torch.cat([t.reshape(-1) for t in tensors])
        self.all_reduce(packed, group, reduce=reduce)
        for tensor, reduced in zip(tensors, packed.split([t.numel() for t in tensors]), strict=True):
            tensor.copy_(reduced.view_as(tensor))

    def all_to_all(
        self, out: torch.Tensor, inp: torch.Tensor, group: Group, *, async_op: bool = False, label: str | None = None
    ) -> Pending:
        """Send the j-th of group.size equal chunks of `inp` (split on dim 0) to group rank j; chunk i
        of `out` comes from group rank i. `label`: the ledger's op (default: all_to_all, tp. on the
        tensor-parallel group); groups of different roles can span the same ranks."""
        n = group.size
        assert inp.shape[0] % n == 0 and out.shape == inp.shape, (tuple(inp.shape), tuple(out.shape), n)
        if n == 1:
            out.copy_(inp)
            return Pending([])
        self._record_pairwise("all_to_all", group, inp.numel() * inp.element_size(), label)
        issued = self._issue("all_to_all", group, inp.numel() * inp.element_size(), label)
        work = dist.all_to_all_single(out, inp, group=group.pg, async_op=True)
        return self._done(Pending([work], issued=issued), async_op)

    def exchange(
        self, out: torch.Tensor, inp: torch.Tensor, group: Group, out_counts: list[int], in_counts: list[int],
        *, label: str, plan_numel: int,
    ) -> None:  # fmt: skip
        """An all-to-all of uneven pieces: the next `in_counts[j]` elements of `inp` go to group rank j,
        `out_counts[i]` elements of `out` come from group rank i. `label`: the ledger's op; `plan_numel`:
        the elements the whole group moves (the same on every rank: the collective's trace entry)."""
        if group.size == 1:
            out.copy_(inp)
            return
        here, me, size = self.topology.node_of(self.topology.rank), self.topology.rank, inp.element_size()
        sent = [(r, count * size) for r, count in zip(group.ranks, in_counts, strict=True) if r != me]
        inter = sum(b for r, b in sent if self.topology.node_of(r) != here)
        self.ledger.record(label, sum(b for _, b in sent) - inter, inter)
        issued = self._issue(label, group, plan_numel * size)
        work = dist.all_to_all_single(out, inp, out_counts, in_counts, group=group.pg, async_op=True)
        self._done(Pending([work], issued=issued), async_op=False)

    def barrier(self, group: Group) -> None:
        """Wait until every rank of the group has arrived (no payload: a call, 0 bytes)."""
        self.ledger.record("barrier", 0, 0)
        if group.size > 1:
            issued = self._issue("barrier", group, 0)
            self._done(Pending([dist.barrier(group=group.pg, async_op=True)], issued=issued), async_op=False)

    def broadcast(self, tensor: torch.Tensor, group: Group, *, src: int) -> None:
        """Copy global rank `src`'s tensor to every rank of the group (pipelined ring: every rank but
        the one whose successor is `src` forwards the whole buffer once)."""
        if group.size == 1:
            return
        if group.ranks[(group.rank + 1) % group.size] != src:
            sent = tensor.numel() * tensor.element_size()
            intra = self._successor_is_intra(group)
            self.ledger.record(self._label("broadcast", group), sent if intra else 0, 0 if intra else sent)
        issued = self._issue("broadcast", group, tensor.numel() * tensor.element_size())
        work = dist.broadcast(tensor, src=src, group=group.pg, async_op=True)
        self._done(Pending([work], issued=issued), async_op=False)

    @staticmethod
    def _done(pending: Pending, async_op: bool) -> Pending:
        if not async_op:
            pending.wait()
        return pending


def _op(reduce: ReduceKind) -> dist.ReduceOp:
    # gloo has no AVG for every op, so a mean is a SUM followed by one division, on every backend
    return dist.ReduceOp.MAX if reduce == "max" else dist.ReduceOp.SUM


def _mean_fixup(tensor: torch.Tensor, reduce: ReduceKind, n: int) -> Callable[[], None] | None:
    return (lambda: tensor.div_(n)) if reduce == "mean" else None
