"""The ``model`` section of a config: the embedded GPT's size, or a Hugging Face causal LM and its LoRA adapters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from zeropp.config.schema import check_choices, require, setting


@dataclass
class ModelConfig:
    """The embedded byte-level GPT (see zeropp.app.models.gpt), or a Hugging Face causal LM (zeropp.app.hf)."""

    preset: Literal["tiny", "small", "medium"] = setting("small", "model size; the keys below override its values")
    n_layer: int | None = setting(None, "transformer blocks; unset: the preset's")
    n_head: int | None = setting(None, "attention heads, a divisor of d_model; unset: the preset's")
    d_model: int | None = setting(None, "width; unset: the preset's")
    block_size: int | None = setting(
        None, "context length in tokens; unset: the preset's (a Hugging Face model's: 128, or its positions if fewer)"
    )
    n_experts: int | None = setting(
        None, "make each block's MLP a mixture of this many experts, each token routed to its top_k; unset: dense"
    )
    top_k: int | None = setting(None, "with n_experts: the experts each token goes to; unset: 2")
    hf_model: str | None = setting(
        None, "train this Hugging Face causal LM instead: a local folder with config.json (and safetensors weights)"
    )
    hf_config: str | None = setting(
        None, "train a randomly initialized Hugging Face causal LM of this local config.json"
    )
    lora_rank: int | None = setting(
        None, "train LoRA adapters of this rank (peft) on the Hugging Face model, its own weights frozen; unset: all"
    )
    lora_alpha: float | None = setting(None, "LoRA's scale numerator (alpha / rank); unset: peft's default, 8")
    lora_targets: str | None = setting(
        None, "comma-separated names of the modules LoRA adapts (q_proj,v_proj); unset: peft's for the model type"
    )
    lora_dropout: float = setting(0.0, "dropout on LoRA's input")
    logit_tiles: int = setting(
        1,
        "compute the output projection and the loss in this many tiles of the tokens, each tile's logits computed "
        "again in backward, so the (tokens x vocabulary) logits never exist whole (ALST's tiling); 1: whole",
    )

    def validate(self) -> None:
        check_choices(self, "model")
        require(self.logit_tiles >= 1, "model.logit_tiles", self.logit_tiles, "an integer >= 1")
        if self.hf_model is not None and self.hf_config is not None:
            require(False, "model.hf_config", self.hf_config, "unset when model.hf_model is set (one model)")
        if self.lora_rank is not None:
            require(self.lora_rank >= 1, "model.lora_rank", self.lora_rank, "an integer >= 1, or unset (no LoRA)")
            hf = self.hf_model or self.hf_config
            require(
                hf is not None, "model.lora_rank", self.lora_rank, "unset without model.hf_model or model.hf_config"
            )
        for key, value, off in (("lora_alpha", self.lora_alpha, None), ("lora_targets", self.lora_targets, None),
                                ("lora_dropout", self.lora_dropout, 0.0)):  # fmt: skip
            if self.lora_rank is None:
                require(value == off, f"model.{key}", value, f"{off!r} unless model.lora_rank is set")
        if self.lora_alpha is not None:
            require(self.lora_alpha > 0, "model.lora_alpha", self.lora_alpha, "a number > 0, or unset")
        require(0 <= self.lora_dropout < 1, "model.lora_dropout", self.lora_dropout, "a number in [0, 1)")
        for key in ("n_layer", "n_head", "d_model", "block_size", "n_experts", "top_k"):
            value = getattr(self, key)
            if value is not None:
                require(value >= 1, f"model.{key}", value, "an integer >= 1, or unset for the preset's value")
