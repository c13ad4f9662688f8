"""DeepSpeed configs in, unchanged: every key mapped, DeepSpeed's tutorials' configs, "auto", refusals,
the batch-size check, and zeropp train --deepspeed end to end (DeepSpeed's schedules and loss scaling:
test_deepspeed_schedules.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_runner import run_cli
from launcher import free_port

from examples import docs_include
from zeropp.app.schedule import adam_betas, learning_rate
from zeropp.config.deepspeed import translate
from zeropp.config.deepspeed import zero_config as zero_config_from_deepspeed
from zeropp.config.deepspeed_keys import MAPPED
from zeropp.config.sections import Config, OptimConfig, ZeroConfig
from zeropp.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
ZERO3 = {"zero_optimization": {"stage": 3}}
OFFLOAD = {"stage": 3, "offload_optimizer": {"device": "cpu"}}

CYCLE = {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}  # OneCycle's required bounds
# DeepSpeed key -> (a config holding it, {zeropp key: the value it must give}), world size 4
TABLE = {
    "zero_optimization.stage": ({"zero_optimization": {"stage": 2}}, {"zero.stage": 2}),
    "tensor_parallel.autotp_size": ({"tensor_parallel": {"autotp_size": 2}}, {"topology.tensor_parallel_size": 2}),
    "expert_parallel.autoep_size": (
        {"expert_parallel": {"enabled": True, "autoep_size": 2}}, {"topology.expert_parallel_size": 2}
    ),
    "expert_parallel.enabled": (
        {"expert_parallel": {"enabled": False, "autoep_size": 2}}, {"topology.expert_parallel_size": 1}
    ),
    "sequence_parallel_size": (
        {"sequence_parallel_size": 2, "train_batch_size": 4, "train_micro_batch_size_per_gpu": 2},
        {"topology.context_parallel_size": 2, "zero.gradient_accumulation_steps": 1},  # 4 ranks: 2 read rows
    ),
    "zero_optimization.reduce_bucket_size": (
        {"zero_optimization": {"reduce_bucket_size": 4e6}}, {"zero.reduce_bucket_numel": 1_000_000}),
    "zero_optimization.allgather_bucket_size": (
        {"zero_optimization": {"allgather_bucket_size": 8e6}}, {"zero.allgather_bucket_numel": 2_000_000}),
    "zero_optimization.stage3_prefetch_bucket_size": (
        {"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 0}}, {"zero.prefetch": 0}),
    "zero_optimization.stage3_param_persistence_threshold": (
        {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1e4}},
        {"zero.persistence_threshold": 10_000}),
    "zero_optimization.zero_quantized_weights": (
        {"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}, {"zero.quantized_weights": True}),
    "zero_optimization.zero_hpz_partition_size": (
        {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8}}, {"zero.hpz_partition_size": 8}),
    "zero_optimization.zero_quantized_gradients": (
        {"zero_optimization": {"stage": 3, "zero_quantized_gradients": True}}, {"zero.quantized_gradients": True}),
    "zero_optimization.zero_quantized_nontrainable_weights": (
        {"zero_optimization": {"stage": 3, "zero_quantized_nontrainable_weights": True}},
        {"zero.quantized_nontrainable_weights": True}),
    "zero_optimization.offload_optimizer.device": (
        {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}},
        {"zero.offload_optimizer": "cpu"}),
    "zero_optimization.offload_optimizer.nvme_path": (
        {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}},
        {"zero.offload_optimizer": "nvme", "zero.offload_path": "/tmp"}),
    "zero_optimization.offload_optimizer.buffer_count": (
        {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp", "buffer_count": 3}}},
        {"zero.offload_buffer_count": 3}),
    "zero_optimization.offload_param.device": (
        {"zero_optimization": {**OFFLOAD, "offload_param": {"device": "cpu"}}}, {"zero.offload_params": "cpu"}),
    "zero_optimization.offload_param.nvme_path": (
        {"zero_optimization": {**OFFLOAD, "offload_param": {"device": "nvme", "nvme_path": "/tmp"}}},
        {"zero.offload_params": "nvme", "zero.offload_path": "/tmp"}),
    "zero_optimization.offload_param.buffer_count": (
        {"zero_optimization": {**OFFLOAD, "offload_param": {"device": "nvme", "nvme_path": "/tmp", "buffer_count": 5}}},
        {"zero.offload_buffer_count": 5}),
    "zero_optimization.cpu_offload": ({"zero_optimization": {"cpu_offload": True}}, {"zero.offload_optimizer": "cpu"}),
    "zero_optimization.cpu_offload_param": (
        {"zero_optimization": {"stage": 3, "cpu_offload": True, "cpu_offload_param": True}}, {"zero.offload_params": "cpu"}),
    "fp16.enabled": ({"fp16": {"enabled": True}}, {"zero.precision": "fp16"}),
    "bf16.enabled": ({"bf16": {"enabled": True}}, {"zero.precision": "bf16"}),
    "bf16.bf16_master_weights_and_grads": (
        {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}, {"zero.master_dtype": "bf16"}),
    "bf16.bf16_optimizer_states": (
        {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}},
        {"zero.master_dtype": "bf16", "zero.optimizer_state_dtype": "bf16"}),
    "fp16.loss_scale": (
        {"fp16": {"enabled": True, "loss_scale": 128}},
        {"zero.loss_scale.initial_scale": 128.0, "zero.loss_scale.growth_factor": 1.0,
         "zero.loss_scale.min_scale": 128.0}),
    "fp16.initial_scale_power": ({"fp16": {"initial_scale_power": 8}}, {"zero.loss_scale.initial_scale": 256.0}),
    "fp16.loss_scale_window": ({"fp16": {"loss_scale_window": 500}}, {"zero.loss_scale.growth_interval": 500}),
    "fp16.hysteresis": ({"fp16": {"hysteresis": 4}}, {"zero.loss_scale.hysteresis": 4}),
    "fp16.consecutive_hysteresis": (
        {"fp16": {"consecutive_hysteresis": True}}, {"zero.loss_scale.consecutive_hysteresis": True}),
    "fp16.min_loss_scale": ({"fp16": {"min_loss_scale": 0.5}}, {"zero.loss_scale.min_scale": 0.5}),
    "communication_data_type": ({"communication_data_type": "fp32"}, {"zero.grad_dtype": "fp32"}),
    "data_types.grad_accum_dtype": ({"data_types": {"grad_accum_dtype": "fp32"}}, {"zero.grad_dtype": "fp32"}),
    "gradient_clipping": ({"gradient_clipping": 0.5}, {"zero.max_grad_norm": 0.5}),
    "gradient_accumulation_steps": ({"gradient_accumulation_steps": 3}, {"zero.gradient_accumulation_steps": 3}),
    "train_micro_batch_size_per_gpu": ({"train_micro_batch_size_per_gpu": 6}, {"train.micro_batch_size": 6}),
    "train_batch_size": (
        {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2}, {"zero.gradient_accumulation_steps": 4}),
    "optimizer.type": ({"optimizer": {"type": "sgd"}}, {"optim.optimizer": "sgd"}),
    "optimizer.params.lr": ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}, {"optim.lr": 1e-4}),
    "optimizer.params.betas": (
        {"optimizer": {"type": "Adam", "params": {"betas": [0.8, 0.9]}}}, {"optim.beta1": 0.8, "optim.beta2": 0.9}),
    "optimizer.params.eps": ({"optimizer": {"type": "Adam", "params": {"eps": 1e-6}}}, {"optim.eps": 1e-6}),
    "optimizer.params.weight_decay": (
        {"optimizer": {"type": "AdamW", "params": {"weight_decay": 0.01}}}, {"optim.weight_decay": 0.01}),
    "optimizer.params.momentum": ({"optimizer": {"type": "SGD", "params": {"momentum": 0.9}}}, {"optim.momentum": 0.9}),
    "optimizer.params.adam_w_mode": (
        {"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}}, {"optim.optimizer": "adam"}),
    "activation_checkpointing": (
        {"activation_checkpointing": {"number_checkpoints": 4}}, {"zero.activation_checkpointing": True}),
    "activation_checkpointing.partition_activations": (
        {"activation_checkpointing": {"partition_activations": True}}, {"zero.partition_activations": True}),
    "activation_checkpointing.cpu_checkpointing": (
        {"activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True}},
        {"zero.cpu_checkpointing": True}),
    "activation_checkpointing.contiguous_memory_optimization": (
        {"activation_checkpointing": {"partition_activations": True, "contiguous_memory_optimization": True}},
        {"zero.contiguous_memory_optimization": True}),
    "scheduler.type": ({"scheduler": {"type": "WarmupLR"}}, {"optim.schedule": "warmup"}),
    "scheduler.params.warmup_min_lr": (
        {"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-3}}},
        {"optim.warmup_start_ratio": 0.1}),
    "scheduler.params.warmup_max_lr": (
        {"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 2e-3}}}, {"optim.lr": 2e-3}),
    "scheduler.params.warmup_num_steps": (
        {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 50}}}, {"optim.warmup_steps": 50}),
    "scheduler.params.warmup_type": (
        {"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "linear"}}}, {"optim.warmup_type": "linear"}),
    "scheduler.params.total_num_steps": (
        {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 500}}}, {"optim.decay_steps": 500}),
    "scheduler.params.warmup_min_ratio": (
        {"scheduler": {"type": "WarmupCosineLR", "params": {"warmup_min_ratio": 0.2}}},
        {"optim.warmup_start_ratio": 0.2}),
    "scheduler.params.cos_min_ratio": (
        {"scheduler": {"type": "WarmupCosineLR", "params": {"cos_min_ratio": 0.05}}}, {"optim.min_lr_ratio": 0.05}),
    "optimizer.params.bias_correction": (
        {"optimizer": {"type": "Adam", "params": {"bias_correction": False}}}, {"optim.bias_correction": False}),
    **{f"scheduler.params.{ds}": (
        {"scheduler": {"type": "OneCycle", "params": {**CYCLE, ds: value}}}, {f"optim.{ours}": expected})
       for ds, value, ours, expected in (
           ("cycle_max_lr", 2e-3, "lr", 2e-3), ("cycle_min_lr", 5e-4, "warmup_start_ratio", 0.5),
           ("cycle_first_step_size", 30, "warmup_steps", 30), ("cycle_second_step_size", 40, "cycle_down_steps", 40),
           ("cycle_first_stair_count", 3, "cycle_stairs", 3), ("cycle_second_stair_count", 2, "cycle_down_stairs", 2),
           ("decay_lr_rate", 0.5, "decay_rate", 0.5), ("decay_step_size", 7, "decay_interval", 7),
           ("cycle_momentum", False, "cycle_momentum", False), ("cycle_min_mom", 0.85, "min_momentum", 0.85),
           ("cycle_max_mom", 0.95, "max_momentum", 0.95), ("decay_mom_rate", 0.01, "momentum_decay_rate", 0.01))},
}  # fmt: skip


def value_at(config: Config, dotted: str):
    """A key's value; zero's policy fields by their flat keys too (zero.weight_bits: zero.qwz.bits)."""
    node = config
    for name in dotted.split("."):
        node = (
            node.as_flat()[name]
            if isinstance(node, ZeroConfig) and name in ZeroConfig.FLAT_KEYS
            else getattr(node, name)
        )
    return node


def test_the_table_covers_every_mapped_key():
    assert set(TABLE) == set(MAPPED)


@pytest.mark.parametrize("ds_key", sorted(TABLE))
def test_each_deepspeed_key_sets_its_zeropp_key(ds_key):
    ds, expected = TABLE[ds_key]
    config = translate(ds, world_size=4, hidden_size=64).config()
    for dotted, value in expected.items():
        assert value_at(config, dotted) == (pytest.approx(value) if isinstance(value, float) else value), dotted


def test_a_block_means_what_it_means_in_deepspeed_and_an_absent_one_keeps_zeropp():
    config = translate({"zero_optimization": {}, "fp16": {"enabled": True}}, world_size=2).config()
    assert config.zero.stage == 0 and not config.zero.qwz.enabled  # DeepSpeed's defaults
    assert (config.zero.loss_scale.initial_scale, config.zero.loss_scale.hysteresis) == (2.0**16, 2)
    assert config.zero.persistence_threshold == 100_000 and config.zero.reduce_bucket_numel == 250_000_000
    assert config.optim == OptimConfig()  # no optimizer or scheduler block: zeropp's
    adam = translate({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}).config().optim
    assert (adam.beta1, adam.beta2, adam.eps, adam.weight_decay) == (0.9, 0.999, 1e-8, 0.0)
    assert translate({"gradient_clipping": 0}).config().zero.max_grad_norm is None
    assert translate({"fp16": {"enabled": False}}).config().zero.precision == "fp32"


def test_zero3_tutorial_config():
    """DeepSpeed's ZeRO tutorial, ZeRO-Infinity with offload to CPU (written from its documentation)."""
    tutorial = {
        "zero_optimization": {
            "stage": 3, "contiguous_gradients": True, "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9, "stage3_prefetch_bucket_size": 1e7,
            "stage3_param_persistence_threshold": 1e5, "reduce_bucket_size": 1e7, "sub_group_size": 1e9,
            "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"},
        }
    }  # fmt: skip
    expected = ZeroConfig(
        stage=3, reduce_bucket_numel=1_250_000, allgather_bucket_numel=62_500_000, persistence_threshold=100_000,
        offload_optimizer="cpu", offload_params="cpu",
    )  # fmt: skip
    assert zero_config_from_deepspeed(tutorial, world_size=8) == expected
    note = translate(tutorial, world_size=8).note()
    for key in ("contiguous_gradients", "stage3_max_live_parameters", "sub_group_size", "stage3_prefetch_bucket_size"):
        assert f"zero_optimization.{key}" in note
    assert "\n" not in note


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_tutorial_stage_1_and_2_configs(stage, tmp_path):
    block = {"stage": stage, "reduce_bucket_size": 5e8}
    if stage == 2:
        block.update(contiguous_gradients=True, overlap_comm=True, reduce_scatter=True, allgather_bucket_size=5e8)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": block}))
    zero = zero_config_from_deepspeed(path, world_size=8)
    assert (zero.stage, zero.reduce_bucket_numel, zero.allgather_bucket_numel) == (stage, 62_500_000, 62_500_000)


def test_zeropp_tutorial_config():
    """DeepSpeed's ZeRO++ tutorial: all three switches, hpZ over the 16 GPUs of a node."""
    tutorial = {
        "zero_optimization": {
            "stage": 3, "reduce_bucket_size": 10000000, "reduce_scatter": False,
            "zero_quantized_weights": True, "zero_hpz_partition_size": 16, "zero_quantized_gradients": True,
            "contiguous_gradients": True, "overlap_comm": True,
        }
    }  # fmt: skip
    zero = zero_config_from_deepspeed(tutorial, world_size=64)
    assert zero == ZeroConfig(
        stage=3, reduce_bucket_numel=156_250, allgather_bucket_numel=7_812_500, persistence_threshold=100_000,
        quantized_weights=True, hpz_partition_size=16, quantized_gradients=True,
    )  # fmt: skip
    assert "zero_optimization.reduce_scatter" in translate(tutorial, world_size=64).note()


HF_STYLE = {  # the Hugging Face integration's ZeRO-3 template: "auto" wherever the trainer knows the value
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 3, "overlap_comm": True, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto", "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
}  # fmt: skip


def test_auto_resolves_from_the_hidden_size_and_zeropp_settings():
    base = Config()
    base.optim.lr, base.optim.warmup_steps, base.train.micro_batch_size = 5e-4, 7, 3
    base.zero.gradient_accumulation_steps, base.zero.max_grad_norm, base.zero.precision = 2, 1.0, "bf16"
    translation = translate(HF_STYLE, world_size=4, hidden_size=64, base=base)
    config = translation.config(base)
    h = 64
    assert config.zero.reduce_bucket_numel == h * h // 4  # h², one rank's quarter
    assert config.zero.persistence_threshold == 10 * h
    assert translation.resolved["zero_optimization.stage3_prefetch_bucket_size"] == int(0.9 * h * h)
    assert config.zero.prefetch == 1  # prefetch counts units here: the resolved size is noted
    assert (config.optim.lr, config.optim.warmup_steps, config.optim.schedule) == (5e-4, 7, "warmup_decay")
    assert (config.optim.beta1, config.optim.beta2, config.optim.weight_decay) == (0.9, 0.95, 0.1)  # zeropp's
    assert (config.optim.warmup_start_ratio, config.optim.min_lr_ratio, config.optim.decay_steps) == (0, 0, None)
    assert (config.train.micro_batch_size, config.zero.gradient_accumulation_steps) == (3, 2)
    assert (config.zero.max_grad_norm, config.zero.precision) == (1.0, "bf16")
    note = translation.note()
    assert note.count("\n") == 0 and f"zero_optimization.reduce_bucket_size = {h * h}" in note
    with pytest.raises(ConfigError, match=r"reduce_bucket_size = \"auto\" needs the model's hidden size"):
        translate(HF_STYLE, world_size=4)


def test_train_batch_size_checked_and_derived():
    ok = translate({"train_batch_size": 48, "gradient_accumulation_steps": 3}, world_size=4).config()
    assert (ok.train.micro_batch_size, ok.zero.gradient_accumulation_steps) == (4, 3)
    only_total = translate({"train_batch_size": 8}, world_size=4).config()
    assert (only_total.train.micro_batch_size, only_total.zero.gradient_accumulation_steps) == (2, 1)
    with pytest.raises(ConfigError) as error:
        translate({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2},
                  world_size=4)  # fmt: skip
    assert str(error.value) == (
        "DeepSpeed train_batch_size = 32 is not allowed; expected micro-batch 2 x gradient accumulation 2 x 4 ranks = 16"
    )
    with pytest.raises(
        ConfigError, match=r"train_batch_size = 30 is not allowed; expected a multiple of micro-batch 4 x 4"
    ):
        translate({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, world_size=4)
    base = Config()
    base.train.micro_batch_size = 8  # "auto" takes zeropp's value, then the total is checked
    with pytest.raises(ConfigError, match="expected micro-batch 8 x gradient accumulation 1 x 2 ranks = 16"):
        translate({"train_batch_size": 32, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"},
                  world_size=2, base=base)  # fmt: skip
    derived = translate({"train_batch_size": 32, "train_micro_batch_size_per_gpu": "auto"}, world_size=2, base=base)
    assert derived.config(base).zero.gradient_accumulation_steps == 2  # 32 / (8 x 2)


@pytest.mark.parametrize(
    ("ds", "message"),
    [
        ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/a"},
                                "offload_param": {"device": "nvme", "nvme_path": "/b"}}},
         'DeepSpeed zero_optimization.offload_param.nvme_path = "/b" is not allowed; expected "/a", offload_optimizer\'s: '
         'one offload_path'),
        ({"zero_optimization": {"stage": 3, "mics_shard_size": 8}},
         "DeepSpeed zero_optimization.mics_shard_size = 8 is not allowed: MiCS is not implemented"),
        ({"amp": {"enabled": True}}, 'DeepSpeed amp = {"enabled": true} is not allowed: NVIDIA Apex AMP is not supported; use bf16 or fp16'),
        ({"optimizer": {"type": "Lamb"}},
         'DeepSpeed optimizer.type = "Lamb" is not allowed; expected "Adam", "AdamW" or "SGD" (in any case)'),
        ({"scheduler": {"type": "LRRangeTest"}},
         'DeepSpeed scheduler.type = "LRRangeTest" is not allowed; expected "WarmupLR", "WarmupDecayLR", '
         '"WarmupCosineLR", "OneCycle"'),
        ({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-4}}},
         "DeepSpeed scheduler.params.cycle_max_lr = 0.0001 is not allowed; expected a number > 0 and >= cycle_min_lr "
         "(0.001)"),
        ({"activation_checkpointing": {"partition_activations": "yes"}},
         'DeepSpeed activation_checkpointing.partition_activations = "yes" is not allowed; expected true or false'),
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}},
         "DeepSpeed fp16.enabled and bf16.enabled are both true; expected at most one"),
        ({"bf16": {"enabled": True, "bf16_optimizer_states": True}},
         "DeepSpeed bf16.bf16_optimizer_states = true is not allowed; expected false unless "
         "bf16.bf16_master_weights_and_grads is true"),
        ({"zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": 0.3}}},
         "DeepSpeed zero_optimization.offload_optimizer.ratio = 0.3 is not allowed: partial offload is not implemented"),
        ({"zero_optimization": {"stage": 4}}, "DeepSpeed zero_optimization.stage = 4 is not allowed; expected one of 0, 1, 2, 3"),
        ({"pipeline": {"stages": 2}}, 'DeepSpeed pipeline = {"stages": 2} is not allowed: zeropp has no pipeline parallelism'),
    ],
)  # fmt: skip
def test_refused_keys_say_why_in_one_line(ds, message):
    with pytest.raises(ConfigError) as error:
        translate(ds, world_size=4)
    assert str(error.value) == message


def test_unknown_key_is_refused_with_the_keys_allowed_there():
    with pytest.raises(ConfigError) as error:
        translate({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket": 5}})
    text = str(error.value)
    assert text.startswith(
        "DeepSpeed key 'zero_optimization.stage3_prefetch_bucket' is not known to zeropp; allowed here:"
    )
    assert "stage3_prefetch_bucket_size" in text and "overlap_comm" in text and "\n" not in text


def test_unreadable_files_are_one_line_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"DeepSpeed config '.*missing.json' does not exist; expected a JSON file"):
        translate(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ConfigError, match=r"does not parse as JSON"):
        translate(bad)


# -- zeropp train --deepspeed, and the docs' example (examples/ds_config.json) --------------------


def test_the_from_deepspeed_page_includes_the_example_file():
    assert docs_include("from-deepspeed.md", "ds_config.json")
    assert "zeropp train --deepspeed examples/ds_config.json" in (ROOT / "docs" / "from-deepspeed.md").read_text()


def test_train_with_the_example_deepspeed_config(tmp_path):
    """The docs' example on 2 simulated nodes x 2 ranks: its stage, ZeRO++ switches, precision,
    optimizer, schedule and batch reach the run (summary and the checkpoint's optimizer)."""
    config = tmp_path / "ds.json"
    ds = json.loads((ROOT / "examples" / "ds_config.json").read_text())
    ds["optimizer"] = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}  # another optimizer than zeropp's
    config.write_text(json.dumps(ds))
    out, ckpt = tmp_path / "summary.json", tmp_path / "ckpt"
    result = run_cli(
        "train", "--deepspeed", str(config), "--preset", "tiny", "--steps", "4", "--eval-batches", "1",
        "--master-port", str(free_port()), "--summary-json", str(out), "--checkpoint-dir", str(ckpt),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    notes = [line for line in result.stdout.splitlines() if line.startswith("DeepSpeed config:")]
    assert len(notes) == 1 and "zero_optimization.overlap_comm" in notes[0] and "steps_per_print" in notes[0]
    summary = json.loads(out.read_text())
    assert (summary["stage"], summary["precision"], summary["world_size"], summary["nodes"]) == (3, "bf16", 4, 2)
    assert summary["zeropp"] == {"quantized_weights": True, "hpz_group_size": 2, "quantized_gradients": True}
    run = summary["config"]
    assert (run["train"]["micro_batch_size"], run["zero"]["gradient_accumulation_steps"]) == (4, 2)
    assert run["zero"]["max_grad_norm"] == 1.0 and run["zero"]["persistence_threshold"] == 640  # "auto": 10 h
    meta = json.loads((ckpt / "step-00000004" / "zeropp.json").read_text())
    assert meta["optimizer"] == "torch.optim.sgd.SGD" and meta["param_groups"][0]["momentum"] == 0.9
    # the last step's lr is WarmupCosineLR's after 3 scheduler steps of 4 (decay_steps "auto": --steps)
    optim = OptimConfig(**run["optim"])
    assert meta["param_groups"][0]["lr"] == pytest.approx(learning_rate(optim, 4, 3))
    assert optim.schedule == "warmup_cosine" and optim.lr == 0.05


def test_one_cycle_and_adam_without_bias_correction_reach_the_run(tmp_path):
    """DeepSpeedExamples' kind of file: Adam with bias_correction false under OneCycle; the checkpoint's
    optimizer is the uncorrected Adam, at OneCycle's lr and betas after 3 scheduler steps."""
    config, ckpt = tmp_path / "ds.json", tmp_path / "ckpt"
    cycle = {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 2, "cycle_second_step_size": 3}
    config.write_text(json.dumps({
        **ZERO3, "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "bias_correction": False, "weight_decay": 0.01}},
        "scheduler": {"type": "OneCycle", "params": cycle},
    }))  # fmt: skip
    result = run_cli(
        "train", "--deepspeed", str(config), "--preset", "tiny", "--steps", "4", "--eval-batches", "1",
        "--nproc-per-node", "2", "--master-port", str(free_port()), "--checkpoint-dir", str(ckpt),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    meta = json.loads((ckpt / "step-00000004" / "zeropp.json").read_text())
    group = meta["param_groups"][0]
    assert meta["optimizer"] == "zeropp.zero.optim.uncorrected_adam.UncorrectedAdam" and group["decoupled"]
    optim = translate(json.loads(config.read_text())).config().optim
    assert group["lr"] == pytest.approx(learning_rate(optim, 4, 3)) and group["weight_decay"] == 0.01
    assert tuple(group["betas"]) == pytest.approx(adam_betas(optim, 3)) and adam_betas(optim, 3)[1] == 0.99


def test_flags_override_the_deepspeed_file_and_the_batch_is_checked_after_them(tmp_path):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({**ZERO3, "train_batch_size": 16, "train_micro_batch_size_per_gpu": 4}))
    command = ["train", "--deepspeed", str(config), "--preset", "tiny"]
    result = run_cli(*command, "--micro-batch-size", "2", timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "zeropp: error: DeepSpeed train_batch_size = 16 is not allowed; "
        "expected micro-batch 2 x gradient accumulation 1 x 4 ranks = 8"
    )
    from zeropp.cli import _train_config, build_parser

    argv = ["train", "--deepspeed", str(config), "--stage", "2", "--gradient-accumulation-steps", "1"]
    config_, _ = _train_config(build_parser().parse_args(argv), argv)
    assert config_.zero.stage == 2 and not config_.zero.qwz.enabled  # the flag won; ZeRO++ off as the file says


def test_deepspeed_batch_sizes_count_data_parallel_ranks_under_tensor_parallelism(tmp_path):
    """4 ranks with tensor parallelism 2 are 2 data-parallel ranks: DeepSpeed's train_batch_size is
    micro-batch x accumulation x 2, and the full world's count is refused (before any rank starts)."""
    from zeropp.cli import _train_config, build_parser

    config = tmp_path / "ds.json"
    config.write_text(
        json.dumps(
            {**ZERO3, "train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}
        )
    )
    argv = ["train", "--deepspeed", str(config), "--preset", "tiny", "--tensor-parallel", "2", "--stage", "2"]
    run, _ = _train_config(build_parser().parse_args(argv), argv)
    assert (run.train.micro_batch_size, run.zero.gradient_accumulation_steps) == (4, 1)
    config.write_text(
        json.dumps(
            {**ZERO3, "train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}
        )
    )
    with pytest.raises(ConfigError, match=r"expected micro-batch 4 x gradient accumulation 1 x 2 ranks = 8"):
        _train_config(build_parser().parse_args(argv), argv)


def test_nvme_offload_of_the_optimizer_maps_to_the_disk_tier(tmp_path):
    ds = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path),
          "buffer_count": 4, "pipeline_read": True}}}  # fmt: skip
    translation = translate(ds, world_size=1)
    zero = translation.config(Config()).zero
    assert (zero.offload.optimizer, zero.offload.path, zero.offload.buffer_count) == ("nvme", str(tmp_path), 4)
    assert "zero_optimization.offload_optimizer.pipeline_read" in translation.note()
    cpu = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "nvme_path": "/local_nvme"}}}
    translation = translate(cpu, world_size=1)
    assert translation.config(Config()).zero.offload.path is None
    assert 'zero_optimization.offload_optimizer.nvme_path (device "cpu")' in translation.note()


def test_zero_infinity_with_both_on_disk_keeps_one_folder_and_count(tmp_path):
    """DeepSpeed's ZeRO-Infinity example: parameters and optimizer states on NVMe, each block its buffers."""
    nvme = {"device": "nvme", "nvme_path": str(tmp_path), "pin_memory": True}
    ds = {"zero_optimization": {"stage": 3, "offload_optimizer": {**nvme, "buffer_count": 4},
          "offload_param": {**nvme, "buffer_count": 5, "buffer_size": 1e8, "max_in_cpu": 1e9}}}  # fmt: skip
    translation = translate(ds, world_size=1)
    offload = translation.config(Config()).zero.offload
    assert (offload.optimizer, offload.params, offload.path, offload.buffer_count) == ("nvme", "nvme", str(tmp_path), 4)
    note = translation.note()
    assert "zero_optimization.offload_param.buffer_count (zero.offload_buffer_count = 4, offload_optimizer's)" in note
    assert "zero_optimization.offload_param.buffer_size" in note


def test_the_autotp_block_sets_the_tensor_parallel_size_and_the_host_loops_refuse_it():
    """DeepSpeed's AutoTP size is zeropp's tensor-parallel size (zeropp train splits the model by
    transformers' plans); the Trainer and Lightning doors wrap one replica per rank: refused in one line."""
    from zeropp.integrations.settings import IntegrationError, resolve_zero_config

    autotp = {"zero_optimization": {"stage": 2}, "tensor_parallel": {"autotp_size": 2}}
    translation = translate(autotp, world_size=4, hidden_size=64)
    with translation.worded():
        assert translation.config().topology.tensor_parallel_size == 2
    with pytest.raises(IntegrationError) as refused:
        resolve_zero_config(autotp, {}, owner="the TrainingArguments", world_size=4, hidden_size=64)
    assert "tensor_parallel.autotp_size = 2" in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(ConfigError, match="^DeepSpeed tensor_parallel.tp_overlap_comm = true is not allowed: "):
        translate({"tensor_parallel": {"autotp_size": 2, "tp_overlap_comm": True}}, world_size=4, hidden_size=64)
