"""The shipped tensor-parallel plans themselves: what each rank holds of GPT-2's fused attention,
the sequence-parallel layouts, the refusals of shapes tp ranks cannot share."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from launcher import run_ranks
from models import global_batch, make_model


def gpt2_attention_pieces() -> dict:
    """GPT-2's first attention split over tp 2 (dp 1): what this rank holds and computes, and the whole."""
    from zeropp.config.sections import TopologyConfig
    from zeropp.tensor_parallel.apply import parallelize
    from zeropp.topology import init_topology
    from zeropp.zero.weights.dtensor_params import block_of, blocks

    topology = init_topology(TopologyConfig(tensor_parallel_size=2))
    whole, model = make_model("hf-gpt2"), parallelize(make_model("hf-gpt2"), topology)
    attn, c_attn = model.transformer.h[0].attn, model.transformer.h[0].attn.c_attn
    x, _ = global_batch("hf-gpt2", 0, 0, 1)
    with torch.no_grad():
        logits = (model(input_ids=x).logits, whole(input_ids=x).logits)
    return dict(
        rank=topology.tensor_parallel.rank,
        local={key: getattr(c_attn, key).to_local() for key in ("weight", "bias")},
        whole={key: getattr(whole.transformer.h[0].attn.c_attn, key).detach() for key in ("weight", "bias")},
        full={key: getattr(c_attn, key).full_tensor() for key in ("weight", "bias")},
        cut=block_of(whole.transformer.h[0].attn.c_attn.weight.detach(), c_attn.weight),
        blocks=blocks(c_attn.weight),
        heads=(attn.split_size, attn.num_heads),
        logits_error=(logits[0] - logits[1]).abs().max().item(),
    )


def test_gpt2_c_attn_pieces_are_each_ranks_heads_of_q_k_and_v():
    """tp rank r holds columns [r h/2, (r+1) h/2) of each of q, k and v (its 2 of the 4 heads of each),
    not a plain column split; full_tensor() is Hugging Face's layout, forward is the whole model's."""
    pytest.importorskip("transformers")
    config = make_model("hf-gpt2").config
    hidden, head_dim = config.n_embd, config.n_embd // config.n_head
    for result in run_ranks(gpt2_attention_pieces, world=2):
        r, half = result["rank"], hidden // 2
        columns = [c for part in range(3) for c in range(part * hidden + r * half, part * hidden + (r + 1) * half)]
        assert torch.equal(result["local"]["weight"], result["whole"]["weight"][:, columns])
        assert torch.equal(result["local"]["bias"], result["whole"]["bias"][columns])
        assert all(torch.equal(result["full"][k], result["whole"][k]) for k in ("weight", "bias"))
        assert torch.equal(result["cut"], result["local"]["weight"])  # how meta-device init cuts it
        assert [where[1] for _, where in result["blocks"]] == [
            slice(part * hidden + r * half, part * hidden + (r + 1) * half) for part in range(3)
        ]
        assert [piece[1] for piece, _ in result["blocks"]] == [
            slice(part * half, (part + 1) * half) for part in range(3)
        ]
        assert result["heads"] == (half, half // head_dim)  # 32 columns each of q, k, v: 2 heads
        assert result["logits_error"] <= 1e-5


@pytest.mark.parametrize(
    "kind,change,tp,named",
    [
        ("hf-gpt2", {}, 3, "n_head = 4"),  # 4 heads
        ("hf-gpt2", {"n_inner": 66}, 4, "n_inner = 66"),  # whole heads, an MLP width 4 does not divide
        ("hf-llama", {"num_key_value_heads": 1}, 2, "num_key_value_heads = 1"),
        ("hf-llama", {"intermediate_size": 65}, 2, "intermediate_size = 65"),
    ],
)
def test_plans_need_equal_shares_per_rank(kind, change, tp, named):
    """Refused in one line before any split: otherwise the row-wise layers rebuild their input's width
    as local width x tp, different on each rank, and the ranks fail inside torch."""
    pytest.importorskip("transformers")
    from zeropp import ConfigError
    from zeropp.tensor_parallel.apply import plan_for

    model = make_model(kind)
    assert plan_for(model, 2)  # the unchanged tiny model splits over 2
    config = model.config.to_dict() | change
    changed = type(model)(type(model.config).from_dict(config)) if change else model
    with pytest.raises(ConfigError) as error:
        plan_for(changed, tp)
    message = str(error.value)
    assert "\n" not in message and f"tensor_parallel_size = {tp}" in message and named in message


def test_sequence_parallel_plans():
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    from zeropp.tensor_parallel.apply import plan_for
    from zeropp.tensor_parallel.plans import SEQUENCE

    plan = plan_for(make_model("gpt"), 2, sequence_parallel=True)
    assert {name for name, style in plan.items() if isinstance(style, SequenceParallel)} == {
        "blocks.*.ln_1", "blocks.*.ln_2", "ln_f"
    }  # fmt: skip
    assert {name for name, style in plan.items() if isinstance(style, PrepareModuleInput)} == {
        "blocks.0", "blocks.*.attn", "blocks.*.mlp", "head"
    }  # fmt: skip
    assert all(style.output_layouts == (SEQUENCE,) for style in plan.values() if isinstance(style, RowwiseParallel))
    assert not any(
        isinstance(s, (SequenceParallel, PrepareModuleInput)) for s in plan_for(make_model("gpt"), 2).values()
    )
    if importlib.util.find_spec("transformers") is None:
        return
    # GPT-2's attention and MLP each start with one column-wise Conv1D, which gathers the sequence itself
    plan = plan_for(make_model("hf-gpt2"), 2, sequence_parallel=True)
    assert {name for name, style in plan.items() if isinstance(style, SequenceParallel)} == {
        "transformer.h.*.ln_1", "transformer.h.*.ln_2"
    }  # fmt: skip
    # the region runs from the embeddings' dropout to the final norm, which takes the whole sequence
    assert {name for name, style in plan.items() if isinstance(style, PrepareModuleInput)} == {
        "transformer.drop", "transformer.ln_f"
    }  # fmt: skip
    assert all(style.input_layouts == (SEQUENCE,) for style in plan.values() if isinstance(style, ColwiseParallel))
    assert all(style.output_layouts == (SEQUENCE,) for style in plan.values() if isinstance(style, RowwiseParallel))


def test_the_sequence_length_check_reads_the_tokens_not_the_masks():
    from zeropp import ConfigError
    from zeropp.tensor_parallel.apply import _check_inputs

    tokens, mask = torch.zeros(2, 16, dtype=torch.long), torch.ones(2, 1, 16, 16)  # a 4-D mask: (b, 1, s, s)
    _check_inputs(2, None, (), {"input_ids": tokens, "attention_mask": mask})
    _check_inputs(2, None, (tokens,), {"attention_mask": mask})
    for args, kwargs in [((tokens[:, :15],), {}), ((), {"input_ids": tokens[:, :15], "attention_mask": mask})]:
        with pytest.raises(ConfigError, match="a sequence of 15 tokens is not allowed"):
            _check_inputs(2, None, args, kwargs)
