"""What ``zeropp train`` trains, as data: the embedded GPT, or a Hugging Face causal LM
(``model.hf_model`` / ``model.hf_config``, :mod:`zeropp.app.hf`), with its tokenizer and its text.

A :class:`ModelSource` builds the model (on the meta device for ``train.init = meta``), computes the
loss of a batch, and says what a checkpoint must record to export the model (its config, and the
tokenizer folder as an absolute path).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zeropp.app import hf, lora
from zeropp.app.data.text import ByteTokenizer, HFTokenizer, text_splits
from zeropp.config.sections import Config
from zeropp.errors import ConfigError

DEFAULT_HF_BLOCK_SIZE = 128
GPT_ONLY_KEYS = ("n_layer", "n_head", "d_model")


@dataclass
class ModelSource:
    name: str  # for messages: "the embedded GPT", "gpt2 (--hf-config ...)"
    build: Callable[[], nn.Module]
    # (engine, inputs, targets, positions): positions None for 0, 1, ... (a context-parallel slice starts later)
    loss: Callable[[Any, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    block_size: int
    vocab_size: int
    n_layer: int
    d_model: int
    checkpoint_extra: dict[str, Any] = field(default_factory=dict)  # what `zeropp export` needs
    weights: Path | None = None  # a folder to load into the shards after construction


def model_source(config: Config) -> ModelSource:
    """The model `config` describes; ConfigError (one line) where it cannot be built."""
    model = config.model
    if model.hf_model is None and model.hf_config is None:
        from zeropp.app.models.gpt import GPT, gpt_config

        gpt = gpt_config(model)
        return ModelSource(
            "the embedded GPT", lambda: GPT(gpt), lambda engine, x, y, positions: engine(x, y, positions=positions),
            gpt.block_size, gpt.vocab_size, gpt.n_layer, gpt.d_model,
        )  # fmt: skip
    for key in GPT_ONLY_KEYS:
        if getattr(model, key) is not None:
            raise ConfigError(f"model.{key} is set with a Hugging Face model; its config.json sets the architecture")
    hf_config = hf.causal_lm_config(model.hf_model, model.hf_config)
    longest = hf.max_positions(hf_config)
    block_size = model.block_size or min(DEFAULT_HF_BLOCK_SIZE, longest or DEFAULT_HF_BLOCK_SIZE)
    if longest is not None and block_size > longest:
        raise ConfigError(f"model.block_size = {block_size} is longer than the model's {longest} positions")
    folder = Path(model.hf_model).expanduser() if model.hf_model is not None else None
    tokenizer = config.train.tokenizer
    extra = {"hf_config": hf_config.to_dict(), "tokenizer": tokenizer and str(Path(tokenizer).expanduser().resolve())}

    tiled = model.logit_tiles > 1
    if tiled and model.lora_rank is not None:
        raise ConfigError(f"model.logit_tiles = {model.logit_tiles} is not allowed with model.lora_rank; expected 1")
    if tiled:
        hf.check_tileable(hf_config.model_type, model.logit_tiles)

    def build() -> nn.Module:
        built = hf.build_model(hf_config)
        if tiled:
            return hf.tile_logits(built, model.logit_tiles)
        return built if model.lora_rank is None else lora.add_adapters(built, model)

    adapted = "" if model.lora_rank is None else f", LoRA rank {model.lora_rank}"
    return ModelSource(
        f"{hf_config.model_type} ({'--hf-model' if folder else '--hf-config'} {model.hf_model or model.hf_config}{adapted})",
        build, functools.partial(hf.causal_lm_loss, tiled=tiled), block_size, hf_config.vocab_size,
        hf_config.num_hidden_layers, hf_config.hidden_size, extra,
        folder if folder is not None and hf.has_weights(folder) else None,
    )  # fmt: skip


def tokenizer_of(config: Config) -> ByteTokenizer | HFTokenizer:
    path = config.train.tokenizer
    return ByteTokenizer() if path is None else HFTokenizer(hf.load_tokenizer(path))


def training_text(config: Config, source: ModelSource) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(train, validation) token ids of train.data with train.tokenizer; None for the embedded corpus.
    Refuses a tokenizer whose ids exceed the model's vocabulary."""
    tokenizer = tokenizer_of(config)
    if tokenizer.vocab_size > source.vocab_size:
        what = "UTF-8 bytes" if config.train.tokenizer is None else f"--tokenizer {config.train.tokenizer!r}"
        raise ConfigError(
            f"{what} has {tokenizer.vocab_size} token ids, more than the vocab_size {source.vocab_size} of "
            f"{source.name}; use a tokenizer of at most {source.vocab_size} tokens or a model with a larger vocabulary"
        )
    if config.train.data is None:
        if config.train.tokenizer is not None:
            raise ConfigError("train.tokenizer is set without train.data; the embedded corpus is byte-level")
        return None
    return text_splits(config.train.data, tokenizer, source.block_size)
