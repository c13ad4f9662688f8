"""Every key DeepSpeed 0.19 reads has a row in zeropp.config.deepspeed_keys (walked from DeepSpeed's own
config classes and readers, so the tables cannot fall behind silently); aliases, keys DeepSpeed ignores,
messages in the file's own keys; docs/deepspeed.md's table is the tables' rendering."""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import typing
from pathlib import Path

import pytest

from zeropp.config.deepspeed import translate
from zeropp.config.deepspeed_keys import ALIASES, MAPPED, NOTED, REFUSED, markdown, row
from zeropp.errors import ConfigError
from zeropp.index.ranks import Layout

ROOT = Path(__file__).resolve().parents[2]

# where each of DeepSpeed's pydantic config classes sits in the file ("" is the top level)
DEEPSPEED_CLASSES = {
    "zero_optimization": "deepspeed.runtime.zero.config.DeepSpeedZeroConfig",
    "fp16": "deepspeed.runtime.precision_config.DeepSpeedFP16Config",
    "bf16": "deepspeed.runtime.precision_config.DeepSpeedBF16Config",
    "": "deepspeed.monitor.config.DeepSpeedMonitorConfig",
    "comms_logger": "deepspeed.comm.config.CommsLoggerConfig",
    "compile": "deepspeed.compile.config.CompileConfig",
    "hybrid_engine": "deepspeed.runtime.config.HybridEngineConfig",
    "tensor_parallel": "deepspeed.runtime.tensor_parallel.config.TPTrainingConfig",
    "timers.throughput": "deepspeed.utils.config.DeepSpeedThroughputTimerConfig",
}
# DeepSpeed's modules whose ``param_dict`` is the whole config (their top-level keys are read from the code);
# the sections whose readers reuse the name for a sub-dict, by the constant naming their key
DEEPSPEED_READERS = (
    "deepspeed.runtime.config", "deepspeed.runtime.precision_config", "deepspeed.profiling.config",
    "deepspeed.runtime.activation_checkpointing.config", "deepspeed.runtime.swap_tensor.aio_config",
)  # fmt: skip
DEEPSPEED_SECTIONS = {
    "deepspeed.runtime.data_pipeline.constants": "DATA_EFFICIENCY",
    "deepspeed.autotuning.constants": "AUTOTUNING",
}


def deepspeed_module(name: str):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    pytest.importorskip("deepspeed")
    return importlib.import_module(name)


def model_keys(prefix: str, cls: type) -> set[str]:
    """Every key a pydantic config class takes (its fields and their aliases), nested classes walked."""
    keys = set()
    for name, info in cls.model_fields.items():
        for key in {name, info.alias} - {None}:
            keys.add(f"{prefix}.{key}".lstrip("."))
        for option in (info.annotation, *typing.get_args(info.annotation)):
            if inspect.isclass(option) and hasattr(option, "model_fields"):
                keys |= model_keys(f"{prefix}.{name}".lstrip("."), option)
    return keys


def top_level_keys(module) -> set[str]:
    """The keys `module`'s code reads from ``param_dict``: param_dict[K], param_dict.get(K), K in param_dict,
    get_*(param_dict, K, ...), with K a string or a module constant."""

    def text(node: ast.AST) -> str | None:
        value = node.value if isinstance(node, ast.Constant) else getattr(module, getattr(node, "id", ""), None)
        return value if isinstance(value, str) else None

    def is_dict(node: ast.AST) -> bool:
        return isinstance(node, ast.Name) and node.id == "param_dict"

    keys = set()
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if isinstance(node, ast.Subscript) and is_dict(node.value):
            keys.add(text(node.slice))
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr == "get" and is_dict(func.value):
                keys.add(text(node.args[0]))
            elif (
                isinstance(func, ast.Name)
                and func.id.startswith("get_")
                and len(node.args) > 1
                and is_dict(node.args[0])
            ):
                keys.add(text(node.args[1]))
        elif isinstance(node, ast.Compare) and len(node.comparators) == 1:
            target = node.comparators[0]
            if isinstance(target, ast.Call) and isinstance(target.func, ast.Attribute) and target.func.attr == "keys":
                target = target.func.value
            if is_dict(target):
                keys.add(text(node.left))
    return keys - {None}


def test_every_key_of_deepspeeds_config_classes_has_a_row():
    walked = set()
    for where, dotted in DEEPSPEED_CLASSES.items():
        module, _, name = dotted.rpartition(".")
        walked |= model_keys(where, getattr(deepspeed_module(module), name))
    assert len(walked) > 150  # the walk found the classes' fields, aliases and nested blocks
    assert sorted(key for key in walked if row(ALIASES.get(key, key)) is None) == []


def test_every_top_level_key_deepspeeds_readers_take_has_a_row():
    walked = set().union(*(top_level_keys(deepspeed_module(name)) for name in DEEPSPEED_READERS))
    walked |= {getattr(deepspeed_module(module), name) for module, name in DEEPSPEED_SECTIONS.items()}
    assert {"train_batch_size", "zero_optimization", "flops_profiler", "data_efficiency", "compile"} <= walked
    assert sorted(key for key in walked if row(ALIASES.get(key, key)) is None) == []


def test_each_key_has_one_row_and_every_alias_a_key_with_a_row():
    noted = {f"{block}.{key}".lstrip(".") for block, keys in NOTED.items() for key in keys}
    assert not noted & (set(REFUSED) | set(MAPPED)) and not set(REFUSED) & set(MAPPED)
    assert all(row(target) for target in ALIASES.values()) and not set(ALIASES) & (noted | set(REFUSED) | set(MAPPED))


def test_the_docs_table_is_the_tables_rendering():
    page = (ROOT / "docs" / "deepspeed.md").read_text()
    assert markdown() in page


def test_deepspeeds_other_names_read_as_the_tables_names():
    """axolotl writes the stage-3 keys without their prefix, Megatron-DeepSpeed bf16 as bfloat16."""
    short = translate({"zero_optimization": {"stage": 3, "prefetch_bucket_size": 0, "param_persistence_threshold": 7,
                                             "max_live_parameters": 0}}).config()  # fmt: skip
    assert (short.zero.prefetch, short.zero.persistence_threshold) == (0, 7)
    translation = translate({"zero_optimization": {"max_live_parameters": 0}, "bfloat16": {"enabled": True}})
    assert translation.config().zero.precision == "bf16"
    assert "zero_optimization.max_live_parameters" in translation.note()
    with pytest.raises(ConfigError) as error:
        translate({"zero_optimization": {"max_reuse_distance": 1, "stage3_max_reuse_distance": 1}})
    assert str(error.value) == (
        "DeepSpeed zero_optimization.stage3_max_reuse_distance and zero_optimization.max_reuse_distance are one key; "
        "expected one of them"
    )
    with pytest.raises(
        ConfigError, match=r"^DeepSpeed bfloat16.enabled = \"yes\" is not allowed; expected true or false$"
    ):
        translate({"bfloat16": {"enabled": "yes"}})


@pytest.mark.parametrize(
    ("ds", "noted"),
    [
        ({"_comment": "x", "comms_config": {"verbose": False}, "monitor_config": {"enabled": True}},
         ["_comment", "comms_config", "monitor_config"]),
        ({"compile": {"deepcompile": True}, "disable_allgather": False, "cuda_visible_devices": "0,1"},
         ["compile", "disable_allgather", "cuda_visible_devices"]),
        ({"bf16": {"enabled": True, "loss_scale": 0, "hysteresis": 2}}, ["bf16.loss_scale", "bf16.hysteresis"]),
        ({"amp": {"enabled": False}, "flops_profiler": {"enabled": True}, "autotuning": {"enabled": True}},
         ["amp", "flops_profiler", "autotuning"]),
        ({"zero_optimization": {"stage": 0, "offload_param": {"device": "cpu"}}},
         ["zero_optimization.offload_param.device (stage 0: parameters are offloaded at stage 3)"]),
        ({"zero_optimization": {"stage": 2, "zero_quantized_gradients": True, "zero_hpz_partition_size": 8}},
         ["zero_optimization.zero_hpz_partition_size (stage 2: ZeRO++ works at stage 3)",
          "zero_optimization.zero_quantized_gradients (stage 2: ZeRO++ works at stage 3)"]),
    ],
)  # fmt: skip
def test_keys_deepspeed_accepts_without_effect_here_are_noted(ds, noted):
    translation = translate(ds)
    config = translation.config()
    assert sorted(translation.noted) == sorted(noted)
    assert config.zero.offload.params == "none" and not config.zero.qgz.enabled and config.zero.hpz_partition_size == 1


@pytest.mark.parametrize(
    ("ds", "layout", "message"),
    [
        ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 3}}, Layout(8, 2),
         "DeepSpeed zero_optimization.zero_hpz_partition_size = 3 (zeropp's zero.hpz_partition_size) is not allowed; "
         "zeropp sees 2 nodes of 4 data-parallel ranks (8 in all), and an hpZ group divides a node's ranks or is whole "
         "nodes dividing all 8: expected one of 1, 2, 4 (0: one node); 2 would work"),
        ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 16}}, Layout(24, 3),
         "DeepSpeed zero_optimization.zero_hpz_partition_size = 16 (zeropp's zero.hpz_partition_size) is not allowed; "
         "zeropp sees 3 nodes of 8 data-parallel ranks (24 in all), and an hpZ group divides a node's ranks or is whole "
         "nodes dividing all 24: expected one of 1, 2, 4, 8 (0: one node); 8 would work"),
        ({"bf16": {"enabled": True}, "communication_data_type": "fp16"}, Layout(1, 1),
         "DeepSpeed communication_data_type = \"fp16\" (zeropp's zero.grad_dtype) is not allowed; expected unset, "
         "'fp32' or 'bf16' (the precision)"),
    ],
)  # fmt: skip
def test_errors_name_the_files_key_and_the_zeropp_key(ds, layout, message):
    translation = translate(ds, world_size=layout.world_size)
    with pytest.raises(ConfigError) as error, translation.worded():
        layout.hpz_group_size(translation.config().zero.hpz_partition_size)
    assert str(error.value) == message


def test_hpz_on_one_node_is_a_note_and_at_the_world_size_too():
    one_node = Layout(8, 1)
    assert one_node.hpz_group_size(16) == 1 and one_node.hpz_group_size(4) == 4
    assert one_node.hpz_note(16) == (
        "zero.hpz_partition_size = 16: hpZ is off, all 8 data-parallel ranks are on one node, where it saves no "
        "inter-node traffic"
    )
    assert Layout(16, 2).hpz_note(16) == (
        "zero.hpz_partition_size = 16: hpZ is off, a group of all 16 data-parallel ranks is the primary partition; "
        "8 would work"
    )
    assert one_node.hpz_note(4) is None and one_node.hpz_note(0) is None and Layout(16, 2).hpz_note(8) is None


def test_zeropp_train_names_the_files_key_and_notes_hpz_off_on_one_node(tmp_path, capsys):
    """Before any rank starts: hpZ 3 on 2 simulated nodes of 2 is refused in the file's key; hpZ 8 on one
    node of 4 trains with hpZ off and one note."""
    from zeropp.cli import _train_config, build_parser

    config = tmp_path / "ds.json"
    argv = ["train", "--deepspeed", str(config), "--preset", "tiny", "--nproc-per-node", "4"]
    config.write_text('{"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 3}}')
    with pytest.raises(
        ConfigError,
        match=r"^DeepSpeed zero_optimization.zero_hpz_partition_size = 3 \(zeropp's "
        r"zero.hpz_partition_size\) is not allowed; zeropp sees 2 nodes of 2",
    ):
        _train_config(build_parser().parse_args(argv), list(argv))
    config.write_text('{"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8}}')
    one_node = [*argv, "--nodes", "1"]
    run, _ = _train_config(build_parser().parse_args(one_node), list(one_node))
    assert run.zero.hpz_partition_size == 8
    assert (
        "zero.hpz_partition_size = 8: hpZ is off, all 4 data-parallel ranks are on one node" in capsys.readouterr().out
    )
