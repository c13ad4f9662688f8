"""The (data-parallel x tensor-parallel) mesh as rank arithmetic, without processes (topology.Layout)."""

from __future__ import annotations

import pytest

from zeropp.app.flags import add_config_flags
from zeropp.config.sections import TopologyConfig, load_config
from zeropp.errors import ConfigError
from zeropp.index.ranks import Layout


def test_two_nodes_of_four_with_tp2():
    layout = Layout(8, 2, tensor_parallel_size=2)
    assert layout.tensor_parallel_groups() == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert layout.data_parallel_groups() == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert (layout.data_parallel_size, layout.data_parallel_per_node) == (4, 2)
    # qgZ's hops follow each data-parallel group's own node structure: 2 of its ranks per node
    assert layout.intra_node_groups() == [(0, 2), (4, 6), (1, 3), (5, 7)]
    assert layout.inter_node_groups() == [(0, 4), (2, 6), (1, 5), (3, 7)]
    # hpZ's default secondary group: one node's data-parallel ranks
    assert layout.hpz_group_size(0) == 2
    assert layout.hpz_groups(2) == [(0, 2), (4, 6), (1, 3), (5, 7)]
    assert layout.data_parallel_layout() == Layout(4, 2)


def test_every_rank_in_exactly_one_group_of_each_dimension():
    for world, nodes, tp in [(8, 2, 4), (12, 3, 2), (4, 1, 4), (6, 2, 3), (16, 4, 2)]:
        layout = Layout(world, nodes, tp)
        for partition in (layout.tensor_parallel_groups(), layout.data_parallel_groups()):
            assert sorted(r for group in partition for r in group) == list(range(world))
        for group in layout.tensor_parallel_groups():  # inside one node, consecutive
            assert len({layout.node_of(r) for r in group}) == 1 and len(group) == tp
        for dp, tp_group in [(d, t) for d in layout.data_parallel_groups() for t in layout.tensor_parallel_groups()]:
            assert len(set(dp) & set(tp_group)) == 1  # a grid: each dp group meets each tp group once
        for group in layout.inter_node_groups():
            assert [layout.node_of(r) for r in group] == list(range(nodes))


def test_without_tensor_parallelism_the_data_parallel_group_is_the_world():
    layout = Layout(4, 2)
    assert layout.data_parallel_groups() == [(0, 1, 2, 3)]
    assert layout.tensor_parallel_groups() == [(0,), (1,), (2,), (3,)]
    assert layout.intra_node_groups() == [(0, 1), (2, 3)]


@pytest.mark.parametrize("world,nodes,tp", [(8, 2, 3), (4, 2, 4), (4, 1, 8), (4, 2, 0)])
def test_tp_not_dividing_the_ranks_per_node_is_refused_in_one_line(world, nodes, tp):
    with pytest.raises(ConfigError) as error:
        Layout(world, nodes, tp)
    message = str(error.value)
    assert "\n" not in message
    assert f"topology.tensor_parallel_size = {tp}" in message
    assert f"a divisor of {world // nodes}" in message


def test_config_key_aliases_and_flag():
    assert load_config({"topology": {"tensor_parallel": 2}}).topology.tensor_parallel_size == 2
    assert load_config({"topology": {"tensor_model_parallel_size": 4}}).topology.tensor_parallel_size == 4
    with pytest.raises(ConfigError, match="topology.tensor_parallel_size = 0"):
        TopologyConfig(tensor_parallel_size=0).validate()
    import argparse

    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    for flag in ("--tensor-parallel", "--tensor-parallel-size", "--tensor-model-parallel-size"):
        assert vars(parser.parse_args([flag, "2"]))["topology.tensor_parallel_size"] == 2


def test_a_model_without_a_plan_is_refused_in_one_line_naming_its_class():
    from torch import nn

    from zeropp.tensor_parallel.apply import plan_for

    with pytest.raises(ConfigError) as error:
        plan_for(nn.Sequential(nn.Linear(2, 2)), 2)
    message = str(error.value)
    assert "\n" not in message and "model class Sequential" in message and "plan=" in message


def test_gpt_plan_needs_whole_heads_per_rank():
    from zeropp.app.models.gpt import GPT, GPTConfig
    from zeropp.tensor_parallel.apply import plan_for

    model = GPT(GPTConfig(block_size=8, n_layer=1, n_head=2, d_model=8))
    assert set(plan_for(model, 2)) == {"blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.0.mlp.0", "blocks.0.mlp.2"}
    with pytest.raises(ConfigError, match="model.n_head = 2"):
        plan_for(model, 4)


def test_tensor_parallelism_takes_checkpoints_resume_init_from_and_low_precision():
    source = {
        "topology": {"tensor_parallel_size": 2},
        "checkpoint": {"checkpoint_dir": "ckpt", "save_interval": 2, "resume": "auto"},
        "train": {"init_from": "x.safetensors"},
        "zero": {"precision": "bf16"},
    }
    config = load_config(source)
    assert (config.topology.tensor_parallel_size, config.zero.precision, config.checkpoint.resume) == (
        2,
        "bf16",
        "auto",
    )


def test_context_parallel_groups_cut_each_data_parallel_group_and_share_its_rows():
    layout = Layout(8, 2, context_parallel_size=2)
    assert layout.context_parallel_groups() == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [layout.reader(r) for r in range(8)] == [(r // 2, 4) for r in range(8)]
    assert layout.data_parallel_groups() == [tuple(range(8))]  # ZeRO still shards over every rank
    # with tensor parallelism innermost: runs of each data-parallel group, the same rows per tp index
    layout = Layout(8, 1, tensor_parallel_size=2, context_parallel_size=2)
    assert layout.context_parallel_groups() == [(0, 2), (4, 6), (1, 3), (5, 7)]
    assert [layout.reader(r) for r in range(8)] == [(0, 2), (0, 2), (0, 2), (0, 2), (1, 2), (1, 2), (1, 2), (1, 2)]
    assert Layout(4, 1).reader(3) == (3, 4)


def test_experts_hpz_groups_are_the_ranks_of_a_dense_hpz_group_holding_the_same_experts():
    layout = Layout(8, 2, expert_parallel_size=2)  # 2 nodes of 4; experts split over (0, 1), (2, 3), ...
    assert layout.expert_data_parallel_groups() == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert layout.expert_hpz_group_size(4) == 2  # hpZ over a node: 2 of its ranks hold the same experts
    assert layout.expert_hpz_groups(4) == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert layout.expert_hpz_group_size(8) == 4 and layout.expert_hpz_groups(8) == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert layout.expert_hpz_group_size(2) == 1  # one rank of each experts per secondary group: off
    assert Layout(8, 2, expert_parallel_size=4).expert_hpz_group_size(2) == 1  # E does not divide it: off
    assert Layout(8, 2).expert_hpz_group_size(4) == 4  # without expert parallelism: the dense units' own


@pytest.mark.parametrize("world,nodes,tp,cp", [(4, 2, 1, 4), (8, 1, 2, 3), (4, 1, 1, 0)])
def test_cp_not_dividing_a_nodes_data_parallel_ranks_is_refused_in_one_line(world, nodes, tp, cp):
    with pytest.raises(ConfigError) as error:
        Layout(world, nodes, tp, cp)
    message = str(error.value)
    assert message.startswith(f"topology.context_parallel_size = {cp} does not divide the ") and "\n" not in message
    assert "allowed: a divisor of" in message


def test_context_parallel_refusals_name_the_length_and_the_heads():
    from zeropp.context_parallel import check_heads, check_length

    with pytest.raises(ConfigError, match=r"^a sequence of 30 tokens is not allowed with topology.context_parallel_size = 4; expected a multiple of 4"):  # fmt: skip
        check_length(30, 4)
    with pytest.raises(ConfigError, match=r"^topology.context_parallel_size = 4 does not divide the model's 6 attention heads \(model.n_head\)"):  # fmt: skip
        check_heads(6, 4, "model.n_head")
    check_length(32, 4), check_heads(8, 4, "model.n_head")  # no error
    config = load_config(None, {"topology.context_parallel": 2})  # the short spelling, as --context-parallel
    assert config.topology.context_parallel_size == 2
    with pytest.raises(ConfigError, match="topology.context_parallel_size"):
        TopologyConfig(context_parallel_size=0).validate()
