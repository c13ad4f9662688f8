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
from zeropp.context_parallel.masks import SequenceInputs
from zeropp.context_parallel.ulysses import ulysses_attention
from zeropp.errors import ConfigError
from zeropp.tensor_parallel.rng import RankStream
from zeropp.topology import Group, Topology

_names = itertools.count()  # one attention implementation registered per engine
ROUTED = "_zeropp_ulysses"  # set on a model whose attention apply_context_parallel routed
# attention implementations Ulysses wraps: given the whole sequence's mask (See [Note: masks of split
# sequences]), or causal by themselves (flash)
WRAPPED = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "kernels-community/flash-attn")


def apply_context_parallel(model: nn.Module, comm: Communicator) -> None:
    """Route every attention of `model` through Ulysses over the topology's context-parallel group (a
    no-op without one), after :func:`check_context_parallel`. Every tensor of a forward is this
    rank's own (its slice of the sequence, its head group inside attention), so the whole forward
    draws from a random stream of the rank's own: a dropout mask is one rank's part of the mask one
    process would draw over the whole sequence, not the same mask repeated on every slice."""
    group, tp = comm.topology.context_parallel, comm.topology.tensor_parallel.size
    if group.size == 1:
        return
    check_context_parallel(model, group.size, tp)
    stream = RankStream(group.rank, comm.topology.device, model)  # See tensor_parallel.rng
    model.register_forward_pre_hook(stream.enter)
    model.register_forward_hook(stream.exit, always_call=True)
    own = _own_attention(model)
    inputs = SequenceInputs(comm, group, None if own else model.config._attn_implementation)
    for module in own:
        module.attend = functools.partial(ulysses_attention, comm, group, attend=module.attend)
    if not own:
        _install_hf(model, comm, group, inputs)
    setattr(model, ROUTED, True)
    model.register_forward_pre_hook(inputs.take, with_kwargs=True)


def check_context_parallel(model: nn.Module, size: int, tp: int = 1) -> None:
    """Refuse in one line, before any collective (the launcher checks a meta-device copy), what Ulysses
    over `size` ranks would compute differently from one process: a model whose attention it cannot
    reach (the embedded GPT's ``attend``, or transformers' attention interface), a head count the
    group does not divide, an attention implementation it does not wrap (flex, others), sliding-window
    or chunked attention, a model already routed."""
    if getattr(model, ROUTED, False):
        raise ConfigError(
            f"topology.context_parallel_size = {size}: this model's attention is routed through Ulysses already "
            "(a second ZeroEngine on one model); expected a model of its own for each engine"
        )
    own = _own_attention(model)
    if own:
        check_heads(own[0].n_head, size, "model.n_head", tp)
    elif getattr(type(model), "_supports_attention_backend", False):  # transformers' attention interface
        _check_hf(model, size, tp)
    else:
        raise ConfigError(
            f"topology.context_parallel_size = {size} is not allowed with {type(model).__name__}: zeropp reaches "
            "the attention of the embedded GPT and of Hugging Face models that use transformers' attention "
            "interface only; expected 1"
        )


def refuse_whole_prompts(topology: Topology, what: str) -> None:
    """Generation feeds every rank the whole prompt, which Ulysses' attention would join into one
    sequence of C copies: refused in one line."""
    size = topology.context_parallel.size
    if size > 1:
        raise ConfigError(
            f"{what} is not allowed with topology.context_parallel_size = {size} (attention is routed through "
            "Ulysses, which needs every rank's slice of one sequence); expected an engine with 1"
        )


def check_heads(heads: int, size: int, key: str, tensor_parallel: int = 1) -> None:
    """Each rank attends whole heads: refuse a head count (per tensor-parallel rank) the group does not divide."""
    local = heads // tensor_parallel
    if local % size:
        per_rank = f" ({local} per tensor-parallel rank)" if tensor_parallel > 1 else ""
        raise ConfigError(
            f"topology.context_parallel_size = {size} does not divide the model's {heads} attention heads "
            f"({key}){per_rank}; allowed: a divisor of {local} (each rank attends whole heads)"
        )


def _own_attention(model: nn.Module) -> list[nn.Module]:
    """The modules exposing ``attend(q, k, v)`` and ``n_head`` (the embedded GPT's attention)."""
    return [m for m in model.modules() if callable(getattr(m, "attend", None)) and hasattr(m, "n_head")]


def _check_hf(model: nn.Module, size: int, tp: int) -> None:
    """The wrapped attention gets the whole sequence's causal mask (with padding and packed documents)
    or is causal by itself; a sliding window or chunks are not in that mask."""
    config = model.config
    check_heads(config.num_attention_heads, size, "num_attention_heads", tp)
    wrapped = config._attn_implementation or "eager"
    if wrapped not in WRAPPED:
        raise ConfigError(
            f"attn_implementation = {wrapped!r} is not allowed with topology.context_parallel_size = {size} (its "
            f"mask is not built for whole sequences); expected one of {', '.join(WRAPPED)}"
        )
    if wrapped == "eager" and _eager(model) is None:
        raise ConfigError(
            f"attn_implementation = 'eager' of {type(model).__name__} is not allowed with topology.context_parallel_size "
            f"= {size} (its modeling file has no eager_attention_forward to wrap); expected sdpa"
        )
    windowed = _windowed(config)
    if windowed:
        raise ConfigError(
            f"{windowed} is not allowed with topology.context_parallel_size = {size}: Ulysses attends whole "
            "sequences causally; expected a model with full attention in every layer"
        )


def _install_hf(model: nn.Module, comm: Communicator, group: Group, inputs: SequenceInputs) -> None:
    """A fresh implementation name for this engine in transformers' AttentionInterface, wrapping the one
    the model was built with (checked by :func:`_check_hf`), given the whole sequences' mask (transformers
    builds none for a name it has no mask function for)."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config = model.config
    wrapped = config._attn_implementation

    def attention(module: nn.Module, query, key, value, attention_mask, **kwargs: Any):
        inner = (_eager(module) or _eager(model)) if wrapped == "eager" else ALL_ATTENTION_FUNCTIONS[wrapped]

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            mask = inputs.mask(config, wrapped, q)
            out, _ = inner(_Grouped(module, q.shape[1] // k.shape[1]), q, k, v, mask, **kwargs)
            return out.transpose(1, 2)  # transformers' (batch, T, heads, d) back to (batch, heads, T, d)

        out = ulysses_attention(comm, group, query, key, value, attend)
        return out.transpose(1, 2).contiguous(), None

    name = f"zeropp_ulysses_{next(_names)}"
    AttentionInterface.register(name, attention)
    config._attn_implementation = name


def _eager(module: nn.Module) -> Any:
    """The eager attention of `module`'s modeling file: transformers keeps one per model family, outside
    its attention interface."""
    return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)


def _windowed(config: Any) -> str | None:
    """How `config` limits attention to less than the whole causal past, as its key says it (None: it does not)."""
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True):
        return f"sliding_window = {window}"
    partial = [kind for kind in getattr(config, "layer_types", None) or () if kind != "full_attention"]
    if partial:
        return f"layer_types with {partial[0]!r}"
    chunk = getattr(config, "attention_chunk_size", None)
    return f"attention_chunk_size = {chunk}" if chunk else None


class _Grouped:
    """The attention module as the wrapped attention sees it, with keys and values grouped `groups` to
    one (1 where Ulysses repeated them to one per query head)."""

    def __init__(self, module: nn.Module, groups: int) -> None:
        self._module, self.num_key_value_groups = module, groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)
