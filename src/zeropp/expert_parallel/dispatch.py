"""Tokens to their experts and back: on one rank, or by all-to-all over an expert-parallel group.

[Note: expert dispatch]
A mixture-of-experts layer hands the dispatch its tokens (N, d), each token's k chosen experts and
their weights. Both ways start alike: the N k (token, expert) pairs sorted by expert (stably, so a
token's pairs keep their order), the tokens copied into that order. On one rank the experts run on
them as they are. Over an expert-parallel group of E ranks, each holding n / E consecutive experts,
the sorted rows are already grouped by the rank that holds their expert: one all-gather of every
rank's count per expert (so every rank knows what every rank sends), one uneven all-to-all sends
the rows, the experts run on what arrived (regrouped by local expert), and the reverse all-to-all
brings the outputs back into the sorted order. Either way each output row is weighted by its pair's
weight and added into its token (index_add in sorted order): the same sums in the same order, so
expert parallelism computes what one rank computes. The backward of each all-to-all is the
reverse all-to-all of the gradients. No rank waits on a count it does not know: a rank whose
tokens all go elsewhere, or an expert no token chose, sends or runs zero rows.

Gradients: ZeRO averages an expert's gradient over the ranks holding it (world / E of them), but
each of those already summed the contributions of the E ranks whose tokens it ran: the experts' own
gradients are scaled by 1 / E inside the layer (the experts' input gradient is not), so the mean
over the world comes out as for dense parameters.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zeropp.comm.communicator import Communicator
from zeropp.topology import Group

LEDGER_OP = "ep.all_to_all"  # the dispatch's and combine's rows (zeropp.costs prices them under it)
COUNTS_OP = "ep.all_gather"  # every rank's count per expert
EXPERT_OPS = (LEDGER_OP, COUNTS_OP)

Experts = Callable[[torch.Tensor, list[int]], torch.Tensor]


def _sorted_pairs(chosen: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the pairs' order sorted by expert, each sorted pair's token, tokens per expert)."""
    flat = chosen.reshape(-1)
    order = flat.argsort(stable=True)
    return order, order // chosen.shape[1], torch.bincount(flat, minlength=n_experts)


def _combine(tokens: torch.Tensor, token_of: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, y: torch.Tensor):
    weighted = (y * weights.reshape(-1)[order].unsqueeze(1)).to(tokens.dtype)  # weights may be fp32 (routers')
    return torch.zeros_like(tokens).index_add(0, token_of, weighted)


def dispatch_locally(
    tokens: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, experts: Experts, n_experts: int
) -> torch.Tensor:
    """Every expert on this rank. See [Note: expert dispatch]."""
    order, token_of, counts = _sorted_pairs(chosen, n_experts)
    return _combine(tokens, token_of, order, weights, experts(tokens[token_of], counts.tolist()))


def dispatch_over(
    comm: Communicator,
    group: Group,
    tokens: torch.Tensor,
    chosen: torch.Tensor,
    weights: torch.Tensor,
    experts: Experts,
    n_experts: int,
) -> torch.Tensor:
    """Each rank of `group` holding n_experts / group.size consecutive experts. See [Note: expert dispatch]."""
    size, local = group.size, n_experts // group.size
    order, token_of, counts = _sorted_pairs(chosen, n_experts)
    every = torch.empty((size, n_experts), dtype=counts.dtype, device=counts.device)
    comm.all_gather(every, counts, group, bucket_numel=n_experts, label=COUNTS_OP)
    every = every.view(size, size, local).tolist()  # [source][holder][its expert]: rows
    me = group.rank
    sent = [sum(every[me][holder]) for holder in range(size)]
    received = [sum(every[source][me]) for source in range(size)]
    moved = sum(sum(sum(per) for per in row) for row in every)  # rows the whole group sends
    rows = _Exchange.apply(comm, group, tokens[token_of], received, sent, moved)
    # arrived: by source, then by this rank's expert; the experts want them by expert
    expert_of = torch.repeat_interleave(
        torch.arange(local, device=tokens.device).repeat(size),
        torch.tensor([every[source][me][e] for source in range(size) for e in range(local)], device=tokens.device),
    )
    regroup = expert_of.argsort(stable=True)
    per_expert = [sum(every[source][me][e] for source in range(size)) for e in range(local)]
    out = experts(_ScaleGrad.apply(rows[regroup], float(size)), per_expert)
    if torch.is_grad_enabled() and rows.requires_grad and not out.requires_grad:  # no rows, unconnected zeros
        out = out + rows.sum() * 0  # (transformers' eager experts): backward must still trade back
    out = _ScaleGrad.apply(out, 1.0 / size)
    back = torch.empty_like(out).index_copy(0, regroup, out)  # the same graph on every rank, rows or none
    return _combine(tokens, token_of, order, weights, _Exchange.apply(comm, group, back, sent, received, moved))


class _Exchange(torch.autograd.Function):
    """Rows to the group's ranks, `sent[j]` to rank j, `received[i]` from rank i; backward the reverse."""

    @staticmethod
    def forward(ctx, comm, group, rows, received, sent, moved):  # type: ignore[override]
        ctx.comm, ctx.group, ctx.received, ctx.sent, ctx.moved = comm, group, received, sent, moved
        return _exchange(comm, group, rows, received, sent, moved)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return None, None, _exchange(ctx.comm, ctx.group, grad, ctx.sent, ctx.received, ctx.moved), None, None, None


def _exchange(comm: Communicator, group: Group, rows: torch.Tensor, received: list[int], sent: list[int], moved: int):
    width = rows.shape[1]
    out = rows.new_empty((sum(received), width))
    comm.exchange(
        out.view(-1), rows.contiguous().view(-1), group, [n * width for n in received], [n * width for n in sent],
        label=LEDGER_OP, plan_numel=moved * width,
    )  # fmt: skip
    return out


class _ScaleGrad(torch.autograd.Function):
    """The identity forward; backward multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx, x, scale):  # type: ignore[override]
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad * ctx.scale, None
