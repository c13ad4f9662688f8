"""Every bad configuration is a one-line ConfigError naming the key, the value and what is allowed."""

from __future__ import annotations

import json

import pytest
import torch

from zeropp.config.sections import Config, TopologyConfig, ZeroConfig, load_config
from zeropp.errors import ConfigError
from zeropp.index.ranks import Layout
from zeropp.topology import init_topology


def config_error(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert message and "\n" not in message, f"not a one-line message: {message!r}"
    return message


def assert_mentions(message: str, *needles: str) -> None:
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"


# (source, overrides, what the message must name: key, value, what is allowed)
BAD = [
    pytest.param(
        {"zero": {"stage": 3, "weight_quantization": "delta"}},
        None,
        ("zero.weight_quantization = 'delta'", "unless zero.quantized_weights is on"),
        id="qwd-without-qwz",
    ),  # fmt: skip
    pytest.param({"zeroo": {}}, None, ("'zeroo'", "did you mean 'zero'?"), id="unknown-top-level-key-a-typo"),
    pytest.param({"banana": {}}, None, ("'banana'", "allowed keys: zero, topology"), id="unknown-top-level-key"),
    pytest.param({"zero": {"stge": 3}}, None, ("'zero.stge'", "did you mean 'zero.stage'?"), id="unknown-nested-key"),
    pytest.param({"zero": {"wieght_bits": 4}}, None, ("did you mean 'zero.weight_bits'?",), id="unknown-flat-key"),
    pytest.param(
        {"zero": {"loss_scale": {"grow": 2}}}, None, ("loss_scale", "grow", "growth_factor"), id="unknown-deep-key"
    ),
    pytest.param({"zero": {"stage": "three"}}, None, ("zero.stage", "'three'", "str", "int"), id="wrong-type-str"),
    pytest.param({"zero": {"stage": 3.0}}, None, ("zero.stage", "3.0", "float", "int"), id="wrong-type-float"),
    pytest.param({"zero": {"stage": True}}, None, ("zero.stage", "True", "bool", "int"), id="wrong-type-bool"),
    pytest.param({"zero": 3}, None, ("zero", "3", "table"), id="section-not-a-table"),
    pytest.param({"zero": {"stage": 5}}, None, ("zero.stage", "5", "0, 1, 2, 3"), id="stage-5"),
    pytest.param({"zero": {"stage": -1}}, None, ("zero.stage", "-1", "0, 1, 2, 3"), id="stage-negative"),
    pytest.param(
        {"zero": {"reduce_bucket_numel": -1}}, None, ("zero.reduce_bucket_numel", "-1", ">= 1"), id="negative-bucket"
    ),
    pytest.param(
        {"zero": {"allgather_bucket_numel": 0}}, None, ("zero.allgather_bucket_numel", "0", ">= 1"), id="zero-bucket"
    ),
    pytest.param({"zero": {"shard_alignment": 0}}, None, ("zero.shard_alignment", "0", ">= 1"), id="zero-alignment"),
    pytest.param({"zero": {"prefetch": -2}}, None, ("zero.prefetch", "-2", ">= 0"), id="negative-prefetch"),
    pytest.param(
        {"zero": {"gradient_accumulation_steps": 0}},
        None,
        ("zero.gradient_accumulation_steps", "0", ">= 1"),
        id="zero-accumulation",
    ),
    pytest.param({"zero": {"max_grad_norm": -1.0}}, None, ("zero.max_grad_norm", "-1.0", "> 0"), id="negative-clip"),
    pytest.param(
        {"zero": {"max_grad_norm": "x"}}, None, ("zero.max_grad_norm", "'x'", "float", "unset"), id="clip-wrong-type"
    ),
    pytest.param(
        {"zero": {"precision": "fp8"}},
        None,
        ("zero.precision", "'fp8'", "'fp32'", "'bf16'", "'fp16'"),
        id="precision-fp8",
    ),
    pytest.param(
        {"zero": {"grad_dtype": "fp8"}}, None, ("zero.grad_dtype", "'fp8'", "'fp32'", "unset"), id="grad-dtype-fp8"
    ),
    pytest.param(
        {"zero": {"stage": 2, "quantized_weights": True}},
        None,
        ("zero.quantized_weights", "True", "stage = 3"),
        id="zeropp-qwz-stage2",
    ),
    pytest.param(
        {"zero": {"stage": 1, "quantized_gradients": True}},
        None,
        ("zero.quantized_gradients", "True", "stage = 3"),
        id="zeropp-qgz-stage1",
    ),
    pytest.param(
        {"zero": {"stage": 0, "hpz_partition_size": 2}},
        None,
        ("zero.hpz_partition_size", "2", "stage = 3"),
        id="zeropp-hpz-stage0",
    ),
    pytest.param(
        {"zero": {"hpz_partition_size": -1}}, None, ("zero.hpz_partition_size", "-1", ">= 0"), id="hpz-negative"
    ),
    pytest.param({"zero": {"weight_bits": 3}}, None, ("zero.weight_bits", "3", "8", "4"), id="weight-bits-3"),
    pytest.param(
        {"zero": {"gradient_block_size": 0}}, None, ("zero.gradient_block_size", "0", ">= 1"), id="grad-block-0"
    ),
    pytest.param(
        {"zero": {"weight_quantization": "row"}}, None, ("zero.weight_quantization", "'row'", "'block'"), id="wq-mode"
    ),
    pytest.param(
        {"zero": {"loss_scale": {"backoff_factor": 1.0}}},
        None,
        ("zero.loss_scale.backoff_factor", "1.0", "(0, 1)"),
        id="loss-scale-backoff",
    ),
    pytest.param(
        {"zero": {"loss_scale": {"min_scale": 0.0}}},
        None,
        ("zero.loss_scale.min_scale", "0.0", "> 0"),
        id="loss-scale-min",
    ),
    pytest.param({"topology": {"nodes": 0}}, None, ("topology.nodes", "0", ">= 1"), id="nodes-0"),
    pytest.param(
        {"topology": {"backend": "mpi"}}, None, ("topology.backend", "'mpi'", "'gloo'", "'nccl'"), id="backend-mpi"
    ),
    pytest.param({"model": {"preset": "huge"}}, None, ("model.preset", "'huge'", "'tiny'"), id="preset-huge"),
    pytest.param({"optim": {"beta2": 1.0}}, None, ("optim.beta2", "1.0", "[0, 1)"), id="beta2-1"),
    pytest.param({"optim": {"lr": float("nan")}}, None, ("optim.lr", "nan", "> 0"), id="lr-nan"),
    pytest.param({"train": {"steps": 0}}, None, ("train.steps", "0", ">= 1"), id="steps-0"),
    pytest.param(
        {"zero": {"quantized_nontrainable_weights": True, "nontrainable_weight_bits": 2}},
        None,
        ("zero.nontrainable_weight_bits", "2", "8", "4"),
        id="frozen-bits-2",
    ),
    pytest.param(
        {"zero": {"nontrainable_weight_bits": 4}},
        None,
        ("zero.nontrainable_weight_bits", "4", "zero.quantized_nontrainable_weights"),
        id="frozen-bits-without-quantization",
    ),
    pytest.param(None, {"zero.stage": 5}, ("zero.stage", "5"), id="override-stage-5"),
    pytest.param(None, {"zero.stge": 2}, ("stge",), id="override-unknown-key"),
    pytest.param(
        {"zero": {"stage": 2}}, {"zero.precision": "fp8"}, ("zero.precision", "'fp8'"), id="override-precision"
    ),
]


@pytest.mark.parametrize("source,overrides,needles", BAD)
def test_bad_config_is_one_line_error(source, overrides, needles):
    message = config_error(load_config, source, overrides)
    assert_mentions(message, *needles)


def test_defaults_validate():
    config = load_config()
    assert isinstance(config, Config)
    assert config.zero == ZeroConfig()
    assert config.to_dict()["zero"]["stage"] == 3


def test_dotted_overrides():
    config = load_config(None, {"zero.stage": 2, "zero.loss_scale.growth_interval": 7, "optim.lr": 1})
    assert config.zero.stage == 2
    assert config.zero.loss_scale.growth_interval == 7
    assert config.optim.lr == 1.0 and isinstance(config.optim.lr, float)  # int accepted for float
    # overrides win over the source, and the source mapping is not modified
    source = {"zero": {"stage": 1, "precision": "bf16"}}
    config = load_config(source, {"zero.stage": 3})
    assert (config.zero.stage, config.zero.precision) == (3, "bf16")
    assert source == {"zero": {"stage": 1, "precision": "bf16"}}


def test_toml_and_json_files_load(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text(
        '[zero]\nstage = 2\nprecision = "bf16"\nmax_grad_norm = 1.0\n'
        "[zero.loss_scale]\ninitial_scale = 1024\n"
        "[topology]\nnodes = 2\n"
        '[model]\npreset = "tiny"\n'
    )
    config = load_config(toml)
    assert (config.zero.stage, config.zero.precision, config.zero.max_grad_norm) == (2, "bf16", 1.0)
    assert config.zero.loss_scale.initial_scale == 1024.0
    assert config.topology.nodes == 2 and config.model.preset == "tiny"

    js = tmp_path / "run.json"
    js.write_text(json.dumps({"zero": {"stage": 1, "gradient_accumulation_steps": 4}, "train": {"steps": 9}}))
    config = load_config(str(js), {"train.steps": 11})
    assert (config.zero.stage, config.zero.gradient_accumulation_steps, config.train.steps) == (1, 4, 11)


def test_bad_values_in_files_name_the_key(tmp_path):
    toml = tmp_path / "bad.toml"
    toml.write_text("[zero]\nstage = 5\n")
    assert_mentions(config_error(load_config, toml), "zero.stage", "5")
    js = tmp_path / "bad.json"
    js.write_text(json.dumps({"zero": {"stge": 3}}))
    assert_mentions(config_error(load_config, js), "stge")


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.toml"
    assert_mentions(config_error(load_config, missing), str(missing), "does not exist")
    assert_mentions(config_error(load_config, tmp_path), str(tmp_path))  # a directory is not a config file


@pytest.mark.parametrize("name,text", [("broken.toml", "[zero\nstage = "), ("broken.json", '{"zero": {"stage": 3,}')])
def test_unparsable_file(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    assert_mentions(config_error(load_config, path), name, "does not parse")


def test_world_not_divisible_by_nodes():
    assert_mentions(config_error(Layout, 4, 3), "topology.nodes", "3", "4")
    Layout(4, 2)
    Layout(5, 1)


def test_init_topology_refuses_before_process_group(monkeypatch):
    for key, value in dict(WORLD_SIZE="4", RANK="0", LOCAL_WORLD_SIZE="4", LOCAL_RANK="0").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")  # never contacted: validation must fail first
    assert not torch.distributed.is_initialized()
    message = config_error(init_topology, TopologyConfig(nodes=3, backend="gloo", timeout_s=1.0))
    assert_mentions(message, "topology.nodes", "3", "4")
    assert not torch.distributed.is_initialized()


def test_zero_config_validate_directly():
    ZeroConfig(stage=0).validate()
    assert_mentions(config_error(ZeroConfig(stage=4).validate), "zero.stage", "4")
    ZeroConfig(quantized_weights=True, hpz_partition_size=0, quantized_gradients=True).validate()
    assert_mentions(
        config_error(ZeroConfig(stage=2, quantized_weights=True).validate), "zero.quantized_weights", "True"
    )
    assert_mentions(config_error(TopologyConfig(timeout_s=0).validate), "topology.timeout_s", "0")


@pytest.mark.parametrize(
    "source,overrides",
    [({"zero": {"stage": 3}}, {"zero.stage.x": 1}), ({"zero": 3}, {"zero.stage": 2})],
    ids=["through-a-value", "through-a-non-table-section"],
)
def test_override_through_a_non_table_is_a_config_error(source, overrides):
    assert_mentions(config_error(load_config, source, overrides), "not a table", next(iter(overrides)))


def test_configs_built_in_code_are_checked_too():
    assert_mentions(config_error(ZeroConfig(precision="fp8").validate), "zero.precision", "'fp8'", "'bf16'")
    assert_mentions(config_error(ZeroConfig(grad_dtype="int8").validate), "zero.grad_dtype", "'int8'")
    assert_mentions(config_error(TopologyConfig(backend="mpi").validate), "topology.backend", "'mpi'", "'gloo'")


def test_fp16_gradients_need_fp16_precision():
    message = config_error(ZeroConfig(precision="bf16", grad_dtype="fp16").validate)
    assert_mentions(message, "zero.grad_dtype", "'fp16'", "'bf16'")
    ZeroConfig(precision="fp16", grad_dtype="fp16").validate()
    ZeroConfig(precision="bf16", grad_dtype="fp32").validate()


@pytest.mark.parametrize(
    "world,ranks_per_node,setting,expected",
    [
        (4, 2, 0, 2),  # the ranks of one node
        (4, 2, 1, 1),  # off
        (4, 2, 2, 2),
        (4, 2, 4, 1),  # as large as the world: the primary partition again, so off
        (4, 4, 0, 1),  # one node: nothing to save
        (8, 2, 4, 4),  # two whole nodes
        (6, 3, 3, 3),
    ],
)
def test_hpz_group_size(world, ranks_per_node, setting, expected):
    assert Layout(world, world // ranks_per_node).hpz_group_size(setting) == expected


@pytest.mark.parametrize("world,ranks_per_node,setting", [(4, 2, 3), (6, 3, 2), (4, 2, 8)])
def test_hpz_group_that_straddles_nodes_or_does_not_divide_the_world_is_refused(world, ranks_per_node, setting):
    message = config_error(Layout(world, world // ranks_per_node).hpz_group_size, setting)
    assert_mentions(message, "zero.hpz_partition_size", str(setting), f"nodes of {ranks_per_node} data-parallel ranks")
