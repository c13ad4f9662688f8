"""A small byte-level GPT in the nanoGPT mould: pre-norm blocks, causal attention, tied embedding/head."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from zeropp.app.models.moe import MixtureOfExperts
from zeropp.config.model import ModelConfig
from zeropp.errors import ConfigError
from zeropp.runtime.tiled_logits import tiled_cross_entropy


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 192
    logit_tiles: int = 1  # the loss's output projection in this many tiles of the tokens (runtime.tiled_logits)
    n_experts: int = 0  # > 0: each block's MLP a mixture of this many experts (zeropp.app.models.moe)
    top_k: int = 2  # the experts each token goes to

    @property
    def param_count(self) -> int:
        d, L = self.d_model, self.n_layer
        mlp = 8 * d * d + 5 * d  # 4d hidden: weights 8d^2, biases 5d
        mlps = self.n_experts * (mlp + d) if self.n_experts else mlp  # + each expert's router row
        per_block = 4 * d * d + 4 * d + mlps + 4 * d  # attention 4d^2+4d, the MLP(s), two layer norms 4d
        return self.vocab_size * d + self.block_size * d + L * per_block + 2 * d


PRESETS = {
    "tiny": GPTConfig(block_size=64, n_layer=2, n_head=2, d_model=64),
    "small": GPTConfig(block_size=128, n_layer=4, n_head=4, d_model=192),
    "medium": GPTConfig(block_size=256, n_layer=8, n_head=8, d_model=384),
}


def gpt_config(model: ModelConfig) -> GPTConfig:
    """The GPT a config's model keys describe: the preset, with every key that is set overriding it."""
    keys = {f.name for f in dataclasses.fields(GPTConfig)}
    overrides = {k: v for k, v in dataclasses.asdict(model).items() if k in keys and v is not None}
    config = dataclasses.replace(PRESETS[model.preset], **overrides)
    if config.n_experts and not 1 <= config.top_k <= config.n_experts:
        raise ConfigError(
            f"model.top_k = {config.top_k} is not allowed with model.n_experts = {config.n_experts}; expected 1 to "
            f"{config.n_experts}"
        )
    if config.d_model % config.n_head:
        raise ConfigError(
            f"model.n_head = {config.n_head} is not allowed with model.d_model = {config.d_model}; "
            f"expected a divisor of d_model (preset {model.preset!r})"
        )
    return config


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.attend = causal_attention  # (batch, heads, T, head size) each; context parallelism wraps it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """qkv's output features are laid out head by head (q, k, v of head 0, then of head 1, ...), so
        a column-wise split over tensor-parallel ranks gives each rank whole heads: the head count is
        read from the output (-1), the head size from the input, which every rank holds whole."""
        B, T, C = x.shape
        head_size = C // self.n_head
        q, k, v = self.qkv(x).view(B, T, -1, 3 * head_size).transpose(1, 2).split(head_size, dim=-1)
        y = self.attend(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.mlp = (
            MixtureOfExperts(config.d_model, config.n_experts, config.top_k)
            if config.n_experts
            else nn.Sequential(
                nn.Linear(config.d_model, 4 * config.d_model), nn.GELU(), nn.Linear(4 * config.d_model, config.d_model)
            )
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.wpe = nn.Embedding(config.block_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.head.weight = self.wte.weight  # tied, GPT-2 style
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits, or the mean cross-entropy (computed in fp32) when targets are given; `positions`: the
        tokens' places in their sequence (default 0, 1, ...; a context-parallel rank's slice starts later)."""
        if positions is None:
            positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        if targets is not None and self.config.logit_tiles > 1:  # See [Note: tiled logits]
            return tiled_cross_entropy(x, self.head.weight, targets, self.config.logit_tiles)
        logits = self.head(x)
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
