"""The embedded GPT's mixture-of-experts MLP: a router sends each token to its top-k of n experts
(Mixtral's routing: softmax over the experts, the k chosen renormalized), dropless. The experts'
weights are stacked on dimension 0 so that expert parallelism splits that dimension
(:mod:`zeropp.expert_parallel`); their container is always called, with however many tokens
(none included), so ZeRO-3 may gather it as a unit of its own."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zeropp.expert_parallel.dispatch import dispatch_locally


class Experts(nn.Module):
    """n GELU MLPs of hidden 4 d, their weights stacked (experts, ...): an expert-parallel rank holds its
    own range of them."""

    def __init__(self, d_model: int, n_experts: int) -> None:
        super().__init__()
        self.n_experts = n_experts
        self.w_in = nn.Parameter(torch.empty(n_experts, d_model, 4 * d_model))
        self.b_in = nn.Parameter(torch.empty(n_experts, 4 * d_model))
        self.w_out = nn.Parameter(torch.empty(n_experts, 4 * d_model, d_model))
        self.b_out = nn.Parameter(torch.empty(n_experts, d_model))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal weights (std 0.02), zero biases. On the meta device under expert parallelism the
        engine hands this the whole stacked weights and keeps this rank's experts of them."""
        nn.init.normal_(self.w_in, std=0.02)
        nn.init.normal_(self.w_out, std=0.02)
        nn.init.zeros_(self.b_in)
        nn.init.zeros_(self.b_out)

    def forward(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """`tokens` grouped by this rank's experts, `counts[e]` rows for its e-th: their outputs, in order."""
        w_in, b_in, w_out, b_out = self.w_in, self.b_in, self.w_out, self.b_out
        outs = [
            F.gelu(rows @ w_in[e] + b_in[e]) @ w_out[e] + b_out[e]
            for e, rows in enumerate(tokens.split(counts))
        ]  # fmt: skip
        return torch.cat(outs) if outs else tokens


class MixtureOfExperts(nn.Module):
    def __init__(self, d_model: int, n_experts: int, top_k: int) -> None:
        super().__init__()
        self.n_experts, self.top_k = n_experts, top_k
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.experts = Experts(d_model, n_experts)
        self.dispatch = dispatch_locally  # expert parallelism replaces it (zeropp.expert_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        probs = F.softmax(self.router(tokens), dim=-1, dtype=torch.float32)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        return self.dispatch(tokens, chosen, weights, self.experts, self.n_experts).view(x.shape)
