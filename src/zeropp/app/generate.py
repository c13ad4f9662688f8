"""``zeropp generate CKPT --prompt TEXT``: a quick look at what a trained checkpoint writes.

One process, whatever world size saved the checkpoint: its consolidated fp32 weights (read as
``zeropp export`` reads them) in the model its run trained (the embedded GPT, or the Hugging Face
model of its ``hf_config``), the prompt tokenized as the run tokenized its data (UTF-8 bytes, or the
run's ``--tokenizer``), then greedy decoding, the context cut to the model's block size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from zeropp.app import hf
from zeropp.app.data.text import ByteTokenizer, HFTokenizer
from zeropp.checkpoint.dcp import CheckpointError, consolidated_state, read_meta
from zeropp.config.model import ModelConfig


def load_model(checkpoint: Path) -> tuple[nn.Module, ByteTokenizer | HFTokenizer, int]:
    """(model in eval mode with the checkpoint's weights, the run's tokenizer, its context length)."""
    extra = read_meta(checkpoint)["extra"]
    model_keys = extra.get("config", {}).get("model")
    if model_keys is None:
        raise CheckpointError(f"checkpoint {str(checkpoint)!r} holds no run config (imported?): its model is unknown")
    model_config = ModelConfig(**model_keys)
    if "hf_config" in extra:
        config = hf.config_from_dict(extra["hf_config"], f"checkpoint {str(checkpoint)!r}")
        model = hf.build_model(config)
        block_size = model_config.block_size or hf.max_positions(config) or 1 << 30
    else:
        from zeropp.app.models.gpt import GPT, gpt_config

        gpt = gpt_config(model_config)
        model, block_size = GPT(gpt), gpt.block_size
    _, state = consolidated_state(checkpoint)
    model.load_state_dict(state, strict=True)
    tokenizer = extra.get("tokenizer")
    return model.eval(), ByteTokenizer() if tokenizer is None else HFTokenizer(hf.load_tokenizer(tokenizer)), block_size


@torch.no_grad()
def greedy(model: nn.Module, ids: list[int], new_tokens: int, block_size: int) -> list[int]:
    """`ids` followed by `new_tokens` greedily chosen tokens."""
    tokens = torch.tensor([ids])
    for _ in range(new_tokens):
        out: Any = model(tokens[:, -block_size:])
        logits = out if isinstance(out, torch.Tensor) else out.logits
        tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokens[0].tolist()


def generate_text(checkpoint: Path, prompt: str, new_tokens: int) -> str:
    """The prompt and its greedy continuation by the checkpoint's model."""
    model, tokenizer, block_size = load_model(checkpoint)
    ids = tokenizer.encode(prompt)
    if not ids:
        raise CheckpointError("--prompt is empty; expected some text to continue")
    return tokenizer.decode(greedy(model, ids, new_tokens, block_size))
