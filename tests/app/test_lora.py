"""LoRA on a model built on the meta device: the engine's initializer gives the adapters peft's own
initialization (B zero, A Kaiming-uniform), where the model's initializer alone would not."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


def test_meta_adapters_start_as_peft_initializes_them():
    from zeropp.app import lora
    from zeropp.config.sections import ModelConfig
    from zeropp.zero.grouping import repeated_blocks
    from zeropp.zero.materialize import default_init, initialize_model

    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, vocab_size=256,
    )  # fmt: skip
    adapters = {}
    for name, init in (("peft", lora.initializer), ("default", default_init)):
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
            model = lora.add_adapters(model, ModelConfig(hf_config="llama.json", lora_rank=4))
        initialize_model(model, repeated_blocks(model), 0, init(model))
        adapters[name] = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert len(adapters["peft"]) == 8  # q_proj and v_proj (peft's Llama targets) of 2 layers, A and B
    for name, value in adapters["peft"].items():
        if "lora_B" in name:
            assert not value.any(), name
        else:  # kaiming_uniform_(a=sqrt(5)) over 32 inputs: U(-1/sqrt(32), 1/sqrt(32))
            assert 0.5 / math.sqrt(32) < value.abs().max() <= 1 / math.sqrt(32), name
    assert all(value.any() for name, value in adapters["default"].items() if "lora_B" in name)
