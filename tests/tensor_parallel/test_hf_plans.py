"""transformers' own tensor-parallel plans translated (zeropp.tensor_parallel.hf_plans): what they
become, their refusals, and six architectures (GQA, head norms, a gathered output, a split embedding,
MoE experts) built on the meta device, loaded with load_pretrained (each rank reading its piece) and
trained at dp 2 x tp 2, stages 1-3, to one process's weights, their bytes the cost model's."""

from __future__ import annotations

import pytest
from launcher import run_ranks
from zoo import train_zoo, zoo_model, zoo_reference

pytest.importorskip("transformers")

ARCHITECTURES = ["mistral", "qwen3", "phi3", "gpt-neox", "gpt-j", "mixtral"]
STEPS = 3


def test_translation_of_the_styles():
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    from zeropp.tensor_parallel.apply import plan_for
    from zeropp.tensor_parallel.hf_plans import MoeExperts, blocks_name

    plan = plan_for(zoo_model("qwen3"), 2)
    assert isinstance(plan["model.layers.*.self_attn.q_proj"], ColwiseParallel)
    assert isinstance(plan["model.layers.*.self_attn.q_norm"], SequenceParallel)  # replicated_with_grad_allreduce
    plan = plan_for(zoo_model("phi3"), 2)  # colwise_gather_output, rowwise_split_input
    assert plan["model.layers.*.self_attn.qkv_proj"].output_layouts == (Replicate(),)
    assert plan["model.layers.*.mlp.down_proj"].input_layouts == (Replicate(),)
    embedding = plan_for(zoo_model("gpt-neox"), 2)["gpt_neox.embed_in"]  # embedding_rowwise: the vocabulary
    assert isinstance(embedding, RowwiseParallel) and embedding.input_layouts == (Replicate(),)
    experts = plan_for(zoo_model("mixtral"), 2)["model.layers.*.mlp.experts"]
    assert isinstance(experts, MoeExperts) and set(experts.param_placements) == {"gate_up_proj", "down_proj"}
    assert blocks_name(zoo_model("gpt-j")) == "transformer.h"  # from base_model_pp_plan


@pytest.mark.parametrize(
    "name,change,tp,named",
    [
        ("opt", {}, 2, "plan={"),  # transformers ships no plan: refused naming plan=
        ("mistral", {"tp_plan": {"layers.*.mlp": "made_up"}}, 2, "'made_up' (for model.layers.*.mlp)"),
        ("mistral", {}, 4, "num_key_value_heads = 2"),  # grouped-query attention: tp divides the key/value heads
        ("mixtral", {"num_key_value_heads": 4, "intermediate_size": 66}, 4, "intermediate_size = 66"),
    ],
)
def test_refusals_are_one_line(name, change, tp, named):
    from zeropp import ConfigError
    from zeropp.tensor_parallel.apply import plan_for

    model = zoo_model(name)
    if "tp_plan" in change:
        model.config.base_model_tp_plan = change.pop("tp_plan")
    if change:
        model = type(model)(type(model.config).from_dict(model.config.to_dict() | change))
    with pytest.raises(ConfigError) as error:
        plan_for(model, tp)
    assert "\n" not in str(error.value) and named in str(error.value)


def test_meta_built_loaded_and_trained_exactly_at_dp2_tp2(tmp_path):
    """Each rank reads no more than its shards of its tensor-parallel pieces."""
    from safetensors.torch import save_file

    folders, references = {}, {}
    for name in ARCHITECTURES:
        state, seen = {}, set()
        for key, value in zoo_model(name, seed=7).state_dict().items():  # another initialization than the meta one
            if value.data_ptr() not in seen:  # tied weights stored once, as Hugging Face stores them
                seen.add(value.data_ptr())
                state[key] = value.contiguous()
        (tmp_path / name).mkdir()
        save_file(state, str(tmp_path / name / "model.safetensors"))
        folders[name] = str(tmp_path / name)
        references[name] = zoo_reference(name, STEPS, 2, model=zoo_model(name, seed=7))[0]
    per_rank = run_ranks(
        train_zoo, 4, nodes=2, names=ARCHITECTURES, references=references, steps=STEPS, stages=(1, 2, 3), tp=2,
        folders=folders,
    )  # fmt: skip
    for rank, results in enumerate(per_rank):
        assert len(results) == 3 * len(ARCHITECTURES)
        for key, result in results.items():
            assert result["error"] <= 1e-5, (rank, key, result["error"])
            assert 0 < result["read"] <= result["shards"], (rank, key)
            ledger = {k: v for k, v in result["ledger"].items() if v and k[1] != "step"}
            assert ledger == result["priced"], (rank, key)


def test_partitioned_activation_checkpoints_with_translated_plans():
    """Pa (each tensor-parallel rank keeps 1/tp of every block's input) under translated plans, with
    grouped-query attention and MoE experts: exact at dp 1 x tp 2."""
    names = ["mistral", "mixtral"]
    references = {name: zoo_reference(name, STEPS, 1)[0] for name in names}
    pa = dict(activation_checkpointing=True, partition_activations=True)
    for results in run_ranks(train_zoo, 2, names=names, references=references, steps=STEPS, tp=2, zero=pa):
        assert len(results) == len(names)
        for key, result in results.items():
            assert result["error"] <= 1e-5, (key, result["error"])
