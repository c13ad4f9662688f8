"""ZeroConfig's policies (zeropp.config.policies): the grouped form and every flat spelling give the same config,
in Python, in files and dicts, through the aliases and as flags; errors name the key as it was written."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from zeropp.app.flags import add_config_flags
from zeropp.config.keys import key_aliases, leaf_keys
from zeropp.config.policies import (
    FLAT_KEYS,
    POLICIES,
    ActivationCheckpointPolicy,
    OffloadPolicy,
    OuterLoop,
    QuantizedGradients,
    QuantizedWeights,
)
from zeropp.config.sections import ZEROPP_SWITCHES, ZeroConfig, load_config
from zeropp.errors import ConfigError

# a value other than the default for every flat key, valid together at stage 3
FLAT = {
    "quantized_weights": True,
    "weight_bits": 4,
    "weight_block_size": 128,
    "weight_quantization": "tensor",
    "quantized_gradients": True,
    "gradient_bits": 8,
    "gradient_block_size": 64,
    "qgz_pipeline_chunks": 3,
    "qgz_pipeline_min_chunk": 1024,
    "gradient_intra_node_bits": 8,
    "gradient_hadamard": True,
    "gradient_error_feedback": "loco",
    "gradient_error_beta": 0.5,
    "gradient_error_reset_steps": 7,
    "quantized_gradients_until": 0.5,
    "offload_optimizer": "cpu",
    "offload_path": "/tmp",
    "offload_buffer_count": 3,
    "offload_params": "nvme",
    "offload_delayed_update": True,
    "offload_delayed_update_warmup": 10,
    "activation_checkpointing": True,
    "partition_activations": True,
    "cpu_checkpointing": True,
    "outer_sync_every": 10,
    "outer_lr": 0.5,
    "outer_momentum": 0.8,
    "outer_nesterov": False,
    "outer_bits": 8,
    "outer_block_size": 128,
    "outer_fragments": 2,
}
GROUPED = dict(
    qwz=QuantizedWeights(enabled=True, bits=4, block_size=128, quantization="tensor"),
    qgz=QuantizedGradients(
        enabled=True,
        bits=8,
        block_size=64,
        pipeline_chunks=3,
        pipeline_min_chunk=1024,
        intra_node_bits=8,
        hadamard=True,
        error_feedback="loco",
        error_beta=0.5,
        error_reset_steps=7,
        until=0.5,
    ),
    offload=OffloadPolicy(
        optimizer="cpu", params="nvme", path="/tmp", buffer_count=3, delayed_update=True, delayed_update_warmup=10
    ),
    activations=ActivationCheckpointPolicy(enabled=True, partition_activations=True, cpu_checkpointing=True),
    outer=OuterLoop(sync_every=10, lr=0.5, momentum=0.8, nesterov=False, bits=8, block_size=128, fragments=2),
)


def error(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_flat_table_covers_every_policy_field_once():
    assert set(FLAT) == set(FLAT_KEYS)
    assert {(g, f.name) for g, cls in POLICIES.items() for f in dataclasses.fields(cls)} == set(FLAT_KEYS.values())


def test_flat_keywords_and_grouped_policies_give_equal_configs():
    flat = ZeroConfig(stage=3, hpz_partition_size=2, **FLAT)
    grouped = ZeroConfig(stage=3, hpz_partition_size=2, **GROUPED)
    assert flat == grouped and flat.as_flat() == grouped.as_flat()
    flat.validate()
    grouped.validate()
    assert {k: v for k, v in flat.as_flat().items() if k in FLAT} == FLAT


def test_the_readmes_flat_example_and_the_switches():
    config = ZeroConfig(
        stage=3, quantized_weights=True, hpz_partition_size=0, quantized_gradients=True, precision="bf16"
    )
    assert config == ZeroConfig(stage=3, **ZEROPP_SWITCHES, precision="bf16")
    assert (config.qwz.enabled, config.qgz.enabled, config.hpz_partition_size) == (True, True, 0)


def test_a_flat_key_applies_on_top_of_its_policy_without_changing_it():
    qwz = QuantizedWeights(bits=4)
    config = ZeroConfig(stage=3, qwz=qwz, quantized_weights=True)
    assert config.qwz == QuantizedWeights(enabled=True, bits=4) and not qwz.enabled
    assert dataclasses.replace(config, weight_bits=8).qwz == QuantizedWeights(enabled=True, bits=8)


@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_flat_and_grouped_files_and_dicts_load_equal(tmp_path, suffix):
    flat = {"zero": {"stage": 3, **FLAT}}
    grouped = {"zero": {"stage": 3, **{k: dataclasses.asdict(v) for k, v in GROUPED.items()}}}
    path = tmp_path / f"flat{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(flat))
    else:
        lines = [f"{k} = {json.dumps(v)}" for k, v in flat["zero"].items()]
        path.write_text("[zero]\n" + "\n".join(lines).replace("True", "true") + "\n")
    assert load_config(path) == load_config(flat) == load_config(grouped)
    assert load_config(grouped).to_dict()["zero"]["qwz"]["bits"] == 4


def test_every_alias_still_resolves():
    aliases = ZeroConfig.ALIASES
    assert set(aliases) <= set(key_aliases())
    values = {"zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True,
              "qgz_pipeline_stages": 5, "err_beta": 0.25, "reset_T": 9}  # fmt: skip
    assert set(values) == set(aliases)
    by_alias = load_config({"zero": {"stage": 3, **values}}).zero
    by_name = load_config({"zero": {"stage": 3, **{aliases[k]: v for k, v in values.items()}}}).zero
    assert by_alias == by_name
    assert (by_alias.qgz.pipeline_chunks, by_alias.qgz.error_beta, by_alias.qgz.error_reset_steps) == (5, 0.25, 9)


def test_every_flat_key_and_alias_is_still_a_flag():
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    keys = leaf_keys()
    for flat in [*FLAT, *ZeroConfig.ALIASES]:
        assert f"--{flat.replace('_', '-')}" in parser._option_string_actions, flat
    for flat in FLAT:
        assert keys[flat].dotted == f"zero.{flat}"
    args = vars(parser.parse_args(["--weight-bits", "4", "--err-beta", "0.5", "--quantized-weights"]))
    overrides = {k: v for k, v in args.items() if v is not None}
    zero = load_config({"zero": {"stage": 3, "qwz": {"bits": 8}}}, overrides).zero
    assert (zero.qwz.bits, zero.qwz.enabled, zero.qgz.error_beta) == (4, True, 0.5)  # the flags win


@pytest.mark.parametrize(
    "zero, key",
    [
        ({"weight_bits": 3}, "zero.weight_bits"),
        ({"qwz": {"bits": 3}}, "zero.qwz.bits"),
        ({"gradient_block_size": 0}, "zero.gradient_block_size"),
        ({"qgz": {"block_size": 0}}, "zero.qgz.block_size"),
        ({"err_beta": 1.5}, "zero.gradient_error_beta"),  # an alias is named by its key, as before
        ({"quantized_gradients_until": 0}, "zero.quantized_gradients_until"),
        ({"stage": 2, "quantized_weights": True}, "zero.quantized_weights"),
        ({"stage": 2, "qgz": {"enabled": True}}, "zero.qgz.enabled"),
        ({"stage": 2, "offload_params": "cpu"}, "zero.offload_params"),
        ({"stage": 2, "offload": {"params": "cpu"}}, "zero.offload.params"),
        ({"weight_block_size": "big"}, "zero.weight_block_size"),
        ({"quantized_weights": True, "weight_quantization": "delta"}, "zero.weight_quantization"),  # hpZ off
        ({"qwz": {"enabled": True, "quantization": "delta"}}, "zero.qwz.quantization"),
    ],
)
def test_an_error_names_the_key_as_written(zero, key):
    assert error(load_config, {"zero": {"stage": 3, **zero}}).startswith(f"{key} = ")


def test_a_python_error_names_the_keyword_as_written():
    assert error(ZeroConfig(gradient_error_beta=1.0).validate).startswith("zero.gradient_error_beta = 1.0")
    assert error(ZeroConfig(qgz=QuantizedGradients(error_beta=1.0)).validate).startswith("zero.qgz.error_beta = 1.0")


def test_a_default_of_zeropp_train_yields_to_the_key_in_any_spelling():
    defaults = {f"zero.{k}": v for k, v in ZEROPP_SWITCHES.items()}
    for zero in ({"qwz": {"enabled": False}}, {"zero_quantized_weights": False}, {"quantized_weights": False}):
        config = load_config({"zero": {"stage": 3, **zero}}, defaults=defaults)
        assert not config.zero.qwz.enabled and config.zero.qgz.enabled, zero
