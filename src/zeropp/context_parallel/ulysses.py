"""Attention over a sequence split across ranks, by two all-to-alls (DeepSpeed-Ulysses).

[Note: Ulysses attention]
Each rank of a context-parallel group of C ranks holds T/C consecutive tokens of every sequence of
its rows. Every layer but attention treats tokens one by one, so it runs on the slice as it is.
Attention needs all of them: queries, keys and values (batch, heads, T/C, head size) each go through
an all-to-all that trades the sequence split for a head split, (batch, heads/C, T, head size): rank
j receives head group j of every slice, in slice order, so it holds whole sequences for 1/C of the
heads and attends them exactly as one process would, causal over the whole sequence. A second
all-to-all trades the output back. The backward of an all-to-all is the same all-to-all of the
gradients, the other way, so backward trades twice per layer too.

Keys and values of grouped-query attention travel at their own head count when it divides by C
(query head group j then meets exactly its own key-value heads); otherwise they are repeated to one
per query head first, which costs what multi-head attention would.

Bytes per layer and micro-batch, forward: (3 + 1) tensors of (batch x T/C x hidden) elements, each
rank sending (C-1)/C of them (fewer for grouped keys and values); backward the same
(:func:`zeropp.costs.context_parallel.ulysses_bytes`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zeropp.comm.communicator import Communicator
from zeropp.topology import Group

LEDGER_OP = "cp.all_to_all"  # the ledger's name of these all-to-alls (zeropp.costs prices them under it)

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class _AllToAll(torch.autograd.Function):
    """Chunk j of dim 0 to group rank j; its backward sends the gradients' chunks back the same way."""

    @staticmethod
    def forward(ctx, comm: Communicator, group: Group, chunks: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.comm, ctx.group = comm, group
        out = torch.empty_like(chunks)
        comm.all_to_all(out, chunks, group, label=LEDGER_OP)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, None, torch.Tensor]:  # type: ignore[override]
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        ctx.comm.all_to_all(out, grad, ctx.group, label=LEDGER_OP)
        return None, None, out


def heads_from_sequence(comm: Communicator, group: Group, x: torch.Tensor) -> torch.Tensor:
    """(batch, heads, T/C, d) of this rank's slice -> (batch, heads/C, T, d) of its head group.

    The chunks travel token-major, (batch, T/C, heads/C, d) each, the layout of a projection's output
    seen as heads: one copy on the way (the send buffer), and for one row the received buffer is the
    result itself, as a (batch, heads/C, T, d) view of (batch, T, heads/C, d) memory."""
    c = group.size
    batch, heads, length, d = x.shape
    chunks = x.reshape(batch, c, heads // c, length, d).permute(1, 0, 3, 2, 4).contiguous()  # chunk j: head group j
    received = _AllToAll.apply(comm, group, chunks)  # chunk i: slice i of this rank's head group
    return received.permute(1, 3, 0, 2, 4).reshape(batch, heads // c, c * length, d)


def sequence_from_heads(comm: Communicator, group: Group, y: torch.Tensor) -> torch.Tensor:
    """(batch, heads/C, T, d) of this rank's head group -> (batch, heads, T/C, d) of its slice, as a
    view of (batch, T/C, heads, d) memory (what the output projection reads: no further copy).

    The chunks travel token-major too: where `y` is a view of (batch, T, heads/C, d) memory (attention
    implementations' output) and of one row, the send buffer is `y` itself."""
    c = group.size
    batch, group_heads, length, d = y.shape
    chunks = y.reshape(batch, group_heads, c, length // c, d).permute(2, 0, 3, 1, 4).contiguous()  # chunk j: slice j
    received = _AllToAll.apply(comm, group, chunks)  # chunk i: head group i of this rank's slice
    whole = received.permute(1, 2, 0, 3, 4).contiguous()  # (batch, T/C, C, heads/C, d)
    return whole.reshape(batch, length // c, c * group_heads, d).transpose(1, 2)


def ulysses_attention(
    comm: Communicator, group: Group, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attend: Attend
) -> torch.Tensor:
    """`attend` (whole sequences, a head group: (batch, heads/C, T, d) each, keys and values maybe
    fewer heads) applied to this rank's slice (batch, heads, T/C, d); its output for the slice.
    See [Note: Ulysses attention]."""
    c, heads, kv_heads = group.size, q.shape[1], k.shape[1]
    if kv_heads % c:
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    q, k, v = (heads_from_sequence(comm, group, t) for t in (q, k, v))
    return sequence_from_heads(comm, group, attend(q, k, v))
