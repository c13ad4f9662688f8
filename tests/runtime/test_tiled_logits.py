"""Tiled logits (runtime.tiled_logits): the loss and gradients of torch's cross-entropy on whole logits,
for the function, the embedded GPT (model.logit_tiles) and a Hugging Face Llama (app.hf.tile_logits)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from zeropp.app import hf
from zeropp.app.models.gpt import GPT, GPTConfig
from zeropp.runtime.tiled_logits import tiled_cross_entropy


def _grads(loss_fn, *tensors):
    tensors = [t.detach().clone().requires_grad_() for t in tensors]
    loss = loss_fn(*tensors)
    loss.backward()
    return loss.detach(), [t.grad for t in tensors]


@pytest.mark.parametrize("tiles", [1, 3, 4, 64])
def test_equals_cross_entropy_of_whole_logits_with_ignored_targets(tiles):
    torch.manual_seed(0)
    hidden, weight = torch.randn(2, 16, 32), torch.randn(256, 32)
    targets = torch.randint(0, 256, (2, 16))
    targets[0, :5] = -100
    whole, whole_grads = _grads(
        lambda h, w: F.cross_entropy((h @ w.t()).view(-1, 256), targets.view(-1)), hidden, weight
    )
    tiled, tiled_grads = _grads(lambda h, w: tiled_cross_entropy(h, w, targets, tiles), hidden, weight)
    torch.testing.assert_close(tiled, whole, rtol=1e-6, atol=0)
    for mine, theirs in zip(tiled_grads, whole_grads, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-7)
    # a sum over given items (a context-parallel rank's share of the sequence's tokens)
    summed = F.cross_entropy((hidden @ weight.t()).view(-1, 256), targets.view(-1), reduction="sum") / 40
    torch.testing.assert_close(tiled_cross_entropy(hidden, weight, targets, tiles, num_items=40), summed)


def test_gradcheck_in_double_and_bf16_loss_in_fp32():
    torch.manual_seed(0)
    hidden = torch.randn(1, 6, 8, dtype=torch.double, requires_grad=True)
    weight = torch.randn(20, 8, dtype=torch.double, requires_grad=True)
    targets = torch.tensor([[3, -100, 7, 19, 0, 5]])
    assert torch.autograd.gradcheck(lambda h, w: tiled_cross_entropy(h, w, targets, 4), (hidden, weight))
    loss = tiled_cross_entropy(hidden.detach().bfloat16(), weight.detach().bfloat16(), targets, 2)
    assert loss.dtype == torch.float32  # the logits of a half-precision model are taken to fp32 for the loss


def _assert_same_loss_and_gradients(losses: list[torch.Tensor], whole: torch.nn.Module, tiled: torch.nn.Module) -> None:
    """The two losses (whole logits, tiled) backpropagated: equal, and so is every parameter's gradient."""
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)
    for (name, a), b in zip(whole.named_parameters(), tiled.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_gpt_with_logit_tiles_trains_as_with_whole_logits():
    config = GPTConfig(block_size=16, n_layer=2, n_head=2, d_model=32)
    torch.manual_seed(0)
    whole = GPT(config)
    tiled = GPT(dataclasses.replace(config, logit_tiles=4))
    tiled.load_state_dict(whole.state_dict())
    x, y = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    losses = [model(x, y) for model in (whole, tiled)]
    _assert_same_loss_and_gradients(losses, whole, tiled)


def test_hf_llama_with_tiled_logits_trains_as_with_whole_logits():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16,
    )  # fmt: skip
    torch.manual_seed(0)
    whole = transformers.LlamaForCausalLM(config)
    tiled = hf.tile_logits(transformers.LlamaForCausalLM(config), 4)
    tiled.load_state_dict(whole.state_dict())
    x, y = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    losses = [hf.causal_lm_loss(whole, x, y, None), hf.causal_lm_loss(tiled, x, y, None, tiled=True)]
    _assert_same_loss_and_gradients(losses, whole, tiled)


def test_models_whose_logits_it_cannot_tile_are_refused_in_one_line():
    with pytest.raises(hf.HFError) as error:
        hf.check_tileable("gemma2", 4)
    assert str(error.value) == (
        "model.logit_tiles = 4 is not allowed with model_type 'gemma2', whose logits zeropp cannot tile as it "
        "computes them; expected 1, or a model of type llama, mistral, qwen2, qwen3, gpt2"
    )
