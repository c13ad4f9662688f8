"""Small models and deterministic data shared by the multi-rank tests, plus the single-process reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from zeropp.app.models.gpt import GPT, GPTConfig

GPT_TEST = GPTConfig(block_size=16, n_layer=2, n_head=2, d_model=32)

# the exactness tests: fp32 runs equal one process within TOLERANCE after STEPS AdamW steps
STEPS = 5
TOLERANCE = 1e-5
# The attention key bias has an exactly zero gradient (softmax ignores a shift shared by all keys),
# so every run feeds Adam pure rounding noise there, and eps=1e-8 would turn that noise into +-lr
# steps in opposite directions. eps=1e-4 keeps noise-level gradients at noise level on both sides.
ADAM_EPS = 1e-4
# bf16 runs: within BF16_TOLERANCE of fp32 after BF16_STEPS
BF16_STEPS = 5
BF16_TOLERANCE = 2e-2
BF16_OPTIM = dict(lr=3e-3, eps=ADAM_EPS, weight_decay=0.01)


class EdgeModel(nn.Module):
    """The unmodified-model cases: frozen, unused, 1-element and twice-called parameters, an unused unit."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))  # layers[3] is never called
        self.unused = nn.Linear(8, 8)
        self.shared = nn.Linear(8, 8)
        self.scalar = nn.Parameter(torch.full((1,), 1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.frozen(x)
        for layer in self.layers[:3]:
            x = torch.tanh(layer(x))
        x = self.layers[0](x)  # a unit called twice
        x = self.shared(torch.tanh(self.shared(x)))  # a module called twice
        return x * self.scalar


class CheckpointedGPT(GPT):
    """The GPT with every block recomputed in backward (non-reentrant activation checkpointing)."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(positions)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def hf_model(kind: str) -> nn.Module:
    """A tiny Hugging Face GPT-2 (``hf-gpt2-dropout``: every dropout at 0.5) or Llama built from a
    config (no download), on the current device."""
    import transformers

    if kind.startswith("hf-gpt2"):
        p = 0.5 if kind == "hf-gpt2-dropout" else 0.0  # the exactness tests: no randomness after init
        config = transformers.GPT2Config(
            vocab_size=256,
            n_positions=GPT_TEST.block_size,
            n_embd=64,
            n_layer=2,
            n_head=4,
            bos_token_id=0,
            eos_token_id=0,
            resid_pdrop=p,
            embd_pdrop=p,
            attn_pdrop=p,
        )
        if p:  # eager attention's dropout is F.dropout, which tests can observe
            config._attn_implementation = "eager"
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=GPT_TEST.block_size,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.LlamaForCausalLM(config)


def make_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind.startswith("hf-"):
        return hf_model(kind)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(7, 13), nn.ReLU(), nn.Linear(13, 13), nn.ReLU(), nn.Linear(13, 3))
    if kind == "gpt":
        return GPT(GPT_TEST)
    if kind == "gpt-checkpointed":
        return CheckpointedGPT(GPT_TEST)
    if kind == "edge":
        return EdgeModel()
    raise ValueError(kind)


def global_batch(kind: str, step: int, micro: int, world: int, per_rank: int = 2):
    g = torch.Generator().manual_seed(1000 * step + micro)
    n = world * per_rank
    if kind.startswith(("gpt", "hf-")):
        tokens = torch.randint(0, 256, (n, GPT_TEST.block_size + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]
    width = 7 if kind == "mlp" else 8
    return torch.randn(n, width, generator=g), torch.randn(n, 3 if kind == "mlp" else 8, generator=g)


def rows(batch, rank: int, per_rank: int = 2):
    return tuple(t[rank * per_rank : (rank + 1) * per_rank] for t in batch)


def loss_of(kind: str, model, x, y) -> torch.Tensor:
    if kind.startswith("hf-"):  # Hugging Face shifts the labels itself
        return model(input_ids=x, labels=x).loss
    return model(x, y) if kind.startswith("gpt") else ((model(x) - y) ** 2).mean()


def reference_state(
    kind: str,
    steps: int,
    world: int,
    accumulation: int,
    max_norm: float | None,
    optim_kwargs: dict,
    optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
    model: nn.Module | None = None,
):
    """One process on the whole global batch (all micro-batches at once), from `model` (default: make_model)."""
    model = make_model(kind) if model is None else model
    optimizer = optimizer_class([p for p in model.parameters() if p.requires_grad], **optim_kwargs)
    for step in range(steps):
        batches = [global_batch(kind, step, m, world) for m in range(accumulation)]
        x, y = (torch.cat(parts) for parts in zip(*batches, strict=True))
        optimizer.zero_grad()
        loss_of(kind, model, x, y).backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}
