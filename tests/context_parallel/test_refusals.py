"""What Ulysses would compute differently from one process is refused in one line, before any
collective (context_parallel.check_context_parallel, which the engine and the launcher call)."""

from __future__ import annotations

import pytest
from models import make_model

from zeropp.context_parallel import check_context_parallel
from zeropp.errors import ConfigError

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)


def _refusal(model, size: int = 2, tp: int = 1) -> str:
    with pytest.raises(ConfigError) as error:
        check_context_parallel(model, size, tp)
    message = str(error.value)
    assert "\n" not in message
    return message


def test_attention_that_needs_a_mask_or_limits_the_past_is_refused():
    flex = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, attn_implementation="flex_attention"))
    assert _refusal(flex).startswith(
        "attn_implementation = 'flex_attention' is not allowed with topology.context_parallel_size = 2 (its mask is "
        "not built for whole sequences); expected one of sdpa, eager,"
    )
    eager = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, attn_implementation="eager"))
    check_context_parallel(eager, 2)  # given the whole sequence's mask (test_masks)
    windowed = transformers.MistralForCausalLM(transformers.MistralConfig(**SMALL))  # its default: 4096
    assert _refusal(windowed) == (
        "sliding_window = 4096 is not allowed with topology.context_parallel_size = 2: Ulysses attends whole "
        "sequences causally; expected a model with full attention in every layer"
    )
    full = transformers.MistralForCausalLM(transformers.MistralConfig(**SMALL, sliding_window=None))
    check_context_parallel(full, 2)  # a Mistral without its window attends like a Llama
    layered = transformers.Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=8, max_window_layers=0)
    assert "sliding" in _refusal(transformers.Qwen2ForCausalLM(layered))


def test_models_outside_the_attention_interface_and_heads_are_refused():
    neo = transformers.GPTNeoForCausalLM(
        transformers.GPTNeoConfig(
            vocab_size=256, hidden_size=32, num_layers=1, num_heads=4, attention_types=[[["global"], 1]]
        )
    )
    assert _refusal(neo).startswith("topology.context_parallel_size = 2 is not allowed with GPTNeoForCausalLM")
    # dropout is taken (each rank draws its own masks: test_ulysses), not refused
    check_context_parallel(transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4)), 2)
    check_context_parallel(transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, attention_dropout=0.1)), 2)
    assert _refusal(make_model("hf-llama"), 4, 2).startswith(
        "topology.context_parallel_size = 4 does not divide the model's 4 attention heads (num_attention_heads) "
        "(2 per tensor-parallel rank)"
    )
    check_context_parallel(make_model("hf-llama"), 2, 2)
    check_context_parallel(make_model("hf-gpt2"), 2)  # the tests' GPT-2: no dropout, sdpa
