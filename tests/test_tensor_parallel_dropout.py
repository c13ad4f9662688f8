"""Dropout under tensor parallelism (zeropp.tensor_parallel.rng), on Hugging Face GPT-2 with every
dropout at 0.5: what the ranks compute whole draws one mask on every rank, what they hold in parts
(a rank's heads; with sequence parallelism a rank's slice of the sequence) draws a mask of each
rank's own, and activation checkpointing recomputes the masks forward drew."""

from __future__ import annotations

import pytest
import torch
from launcher import run_ranks
from models import GPT_TEST, global_batch, loss_of, rows
from torch.overrides import TorchFunctionMode

pytest.importorskip("transformers")

P = 0.5


def dropout_gpt2() -> torch.nn.Module:
    """The tests' tiny GPT-2 with every dropout at P; eager attention, whose dropout is ``F.dropout``."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=256, n_positions=GPT_TEST.block_size, n_embd=64, n_layer=2, n_head=4,
        bos_token_id=0, eos_token_id=0, resid_pdrop=P, embd_pdrop=P, attn_pdrop=P,
    )  # fmt: skip
    config._attn_implementation = "eager"
    return transformers.GPT2LMHeadModel(config)


class DropoutMasks(TorchFunctionMode):
    """Every ``F.dropout`` call's mask, in call order: 1 kept, 0 dropped, -1 where the input was 0
    (attention's causal mask: no draw shows there)."""

    def __init__(self) -> None:
        super().__init__()
        self.masks: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.nn.functional.dropout:
            self.masks.append(torch.where(args[0] == 0, -1, (out != 0).to(torch.int8)))
        return out


def masks_worker(sequence_parallel: bool) -> dict:
    from zeropp.config import TopologyConfig
    from zeropp.tensor_parallel import parallelize
    from zeropp.topology import init_topology

    topology = init_topology(TopologyConfig(tensor_parallel_size=2, sequence_parallel=sequence_parallel))
    model = parallelize(dropout_gpt2(), topology).train()
    x, _ = global_batch("hf-gpt2", 0, 0, 1)
    torch.manual_seed(1)
    with DropoutMasks() as recorded, torch.no_grad():
        logits = model(input_ids=x).logits
    return dict(masks=recorded.masks, logits=logits, after=torch.rand(4))


# GPT-2's dropouts in call order: the embeddings', then per block attention's (on the heads),
# attention's residual and the MLP's residual
ORDER = ["embeddings"] + ["attention", "residual", "residual"] * 2


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["megatron", "sequence-parallel"])
def test_parts_draw_their_own_masks_and_whole_activations_one(sequence_parallel):
    ranks = run_ranks(masks_worker, world=2, sequence_parallel=sequence_parallel)
    first, second = (r["masks"] for r in ranks)
    assert len(first) == len(second) == len(ORDER)
    for where, a, b in zip(ORDER, first, second, strict=True):
        parts = where == "attention" or sequence_parallel  # heads, or the sequence's slices
        assert a.shape == b.shape
        live = (a >= 0) & (b >= 0)
        for mask in (a, b):
            assert abs(mask[live].float().mean().item() - (1 - P)) < 0.1, where  # a dropout at P was drawn
        same = (a == b)[live].float().mean().item()
        if parts:  # independent masks agree on about half the elements at P = 0.5
            assert 0.35 < same < 0.65, f"{where}: ranks drew masks agreeing on {same:.0%}"
        else:
            assert same == 1.0, f"{where}: a whole activation got different masks on the ranks"
    assert torch.equal(ranks[0]["logits"], ranks[1]["logits"])  # the LM head's output is whole
    assert torch.equal(ranks[0]["after"], ranks[1]["after"])  # the default stream moved on alike


def training_worker(sequence_parallel: bool) -> dict:
    """ZeRO-3 on dp 1 x tp 2 with every dropout at P, with and without activation checkpointing."""
    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.config import TopologyConfig
    from zeropp.tensor_parallel import parallelize
    from zeropp.topology import init_topology

    topology = init_topology(TopologyConfig(tensor_parallel_size=2, sequence_parallel=sequence_parallel))
    states = {}
    for checkpointing in (False, True):
        config = ZeroConfig(stage=3, activation_checkpointing=checkpointing)
        engine = ZeroEngine(parallelize(dropout_gpt2(), topology), torch.optim.AdamW, dict(lr=1e-2), config, topology)
        engine.train()
        torch.manual_seed(1)
        for step in range(3):
            x, y = rows(global_batch("hf-gpt2", step, 0, 1), 0)
            engine.backward(loss_of("hf-gpt2", engine, x, y))
            assert engine.step()
        states[checkpointing] = engine.full_state_dict()
    return states


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["megatron", "sequence-parallel"])
def test_checkpointing_recomputes_the_masks_forward_drew(sequence_parallel):
    """Same weights with and without recomputation (a recomputed mask unlike forward's would give
    gradients of another function), and the same on both tp ranks (whole weights got one mask)."""
    ranks = run_ranks(training_worker, world=2, sequence_parallel=sequence_parallel)
    for states in ranks:
        plain, recomputed = states[False], states[True]
        assert plain.keys() == recomputed.keys()
        assert max((plain[k] - recomputed[k]).abs().max().item() for k in plain) <= 1e-6
    assert all(torch.equal(ranks[0][True][k], ranks[1][True][k]) for k in ranks[0][True])
