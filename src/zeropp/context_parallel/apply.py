"""Ulysses installed into a model's attention: the embedded GPT's (any module exposing ``attend``) or a
Hugging Face model's, through transformers' attention interface. See [Note: Ulysses attention]."""

from __future__ import annotations

import functools
import itertools
import sys
from typing import Any

import torch
from torch import nn

from zeropp.comm.communicator import Communicator
from zeropp.context_parallel.ulysses import ulysses_attention
from zeropp.errors import ConfigError
from zeropp.topology import Group

_names = itertools.count()  # one attention implementation registered per engine


def apply_context_parallel(model: nn.Module, comm: Communicator) -> None:
    """Route every attention of `model` through Ulysses over the topology's context-parallel group (a
    no-op without one); refuses in one line a model whose attention it cannot reach, or whose head
    count the group does not divide."""
    group, tp = comm.topology.context_parallel, comm.topology.tensor_parallel.size
    if group.size == 1:
        return
    own = [m for m in model.modules() if callable(getattr(m, "attend", None)) and hasattr(m, "n_head")]
    if own:
        check_heads(own[0].n_head, group.size, "model.n_head", tp)
        for module in own:
            module.attend = functools.partial(ulysses_attention, comm, group, attend=module.attend)
    elif hasattr(getattr(model, "config", None), "_attn_implementation"):
        _install_hf(model, comm, group, tp)
    else:
        raise ConfigError(
            f"topology.context_parallel_size = {group.size} is not allowed with {type(model).__name__}: zeropp reaches "
            "the attention of the embedded GPT and of Hugging Face models only; expected 1"
        )
    model.register_forward_pre_hook(functools.partial(_refuse_padding, group.size), with_kwargs=True)


def check_heads(heads: int, size: int, key: str, tensor_parallel: int = 1) -> None:
    """Each rank attends whole heads: refuse a head count (per tensor-parallel rank) the group does not divide."""
    local = heads // tensor_parallel
    if local % size:
        per_rank = f" ({local} per tensor-parallel rank)" if tensor_parallel > 1 else ""
        raise ConfigError(
            f"topology.context_parallel_size = {size} does not divide the model's {heads} attention heads "
            f"({key}){per_rank}; allowed: a divisor of {local} (each rank attends whole heads)"
        )


def _install_hf(model: nn.Module, comm: Communicator, group: Group, tp: int) -> None:
    """A fresh implementation name for this engine in transformers' AttentionInterface, wrapping the one
    the model was built with (sdpa, eager, flash, ...). Transformers builds no mask for a name it has
    no mask function for, so the wrapped attention runs causal over the whole sequence."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config = model.config
    check_heads(config.num_attention_heads, group.size, "num_attention_heads", tp)
    wrapped = config._attn_implementation or "eager"
    if wrapped != "eager" and wrapped not in ALL_ATTENTION_FUNCTIONS:
        raise ConfigError(f"attn_implementation = {wrapped!r} is not known to transformers; expected 'sdpa' or 'eager'")

    def attention(module: nn.Module, query, key, value, attention_mask, **kwargs: Any):
        inner = (
            sys.modules[type(module).__module__].eager_attention_forward
            if wrapped == "eager"
            else ALL_ATTENTION_FUNCTIONS[wrapped]
        )

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            out, _ = inner(_Grouped(module, q.shape[1] // k.shape[1]), q, k, v, None, **kwargs)
            return out.transpose(1, 2)  # transformers' (batch, T, heads, d) back to (batch, heads, T, d)

        out = ulysses_attention(comm, group, query, key, value, attend)
        return out.transpose(1, 2).contiguous(), None

    name = f"zeropp_ulysses_{next(_names)}"
    AttentionInterface.register(name, attention)
    config._attn_implementation = name


class _Grouped:
    """The attention module as the wrapped attention sees it, with keys and values grouped `groups` to
    one (1 where Ulysses repeated them to one per query head)."""

    def __init__(self, module: nn.Module, groups: int) -> None:
        self._module, self.num_key_value_groups = module, groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _refuse_padding(size: int, module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Ulysses attends causally over whole sequences: a padding mask would be ignored, so it is refused."""
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and not bool(mask.all()):
        raise ConfigError(
            f"an attention_mask with padding is not allowed with topology.context_parallel_size = {size}; "
            "expected unpadded (packed or equal-length) sequences"
        )
