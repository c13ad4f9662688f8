"""What zeropp does with each DeepSpeed 0.19 config key, as data: the zeropp key it sets (MAPPED),
accepted without effect (NOTED), refused and why (REFUSED), the other names DeepSpeed takes for a key
(ALIASES), and DeepSpeed's defaults inside a block.

A key is a dotted path as the file nests it (``zero_optimization.offload_param.device``); a NOTED or
REFUSED path covers everything under it. Read by zeropp.config.deepspeed; :func:`markdown` renders the
table docs/deepspeed.md carries.
"""

from __future__ import annotations

import json
from typing import Any

AUTO = "auto"

# DeepSpeed key -> the zeropp key it sets (documentation and the table test; "+" where it sets several)
MAPPED = {
    "zero_optimization.stage": "zero.stage",
    "tensor_parallel.autotp_size": "topology.tensor_parallel_size (transformers' tp plans; refused where the model has none)",
    "sequence_parallel_size": "topology.context_parallel_size (Ulysses; the batch keys count world / size ranks)",
    "expert_parallel.autoep_size": "topology.expert_parallel_size (AutoEP, with enabled: true; transformers' experts modules)",
    "expert_parallel.enabled": "topology.expert_parallel_size = expert_parallel.autoep_size when true",
    "zero_optimization.reduce_bucket_size": "zero.reduce_bucket_numel (/ world size)",
    "zero_optimization.allgather_bucket_size": "zero.allgather_bucket_numel (/ world size)",
    "zero_optimization.stage3_prefetch_bucket_size": "zero.prefetch = 0 when 0 (else noted: zeropp prefetches units)",
    "zero_optimization.stage3_param_persistence_threshold": "zero.persistence_threshold (per unit)",
    "zero_optimization.zero_quantized_weights": "zero.quantized_weights (stage 3; noted below it, as DeepSpeed ignores it)",
    "zero_optimization.zero_hpz_partition_size": "zero.hpz_partition_size (stage 3; noted below it)",
    "zero_optimization.zero_quantized_gradients": "zero.quantized_gradients (stage 3; noted below it)",
    "zero_optimization.zero_quantized_nontrainable_weights": "zero.quantized_nontrainable_weights (stage 3; noted below it)",
    "zero_optimization.offload_optimizer.device": "zero.offload_optimizer (cpu or nvme)",
    "zero_optimization.offload_optimizer.nvme_path": "zero.offload_path (device nvme; noted otherwise)",
    "zero_optimization.offload_optimizer.buffer_count": "zero.offload_buffer_count (device nvme; noted otherwise)",
    "zero_optimization.offload_param.device": "zero.offload_params (cpu or nvme; stage 3, noted below it, as DeepSpeed ignores it)",
    "zero_optimization.offload_param.nvme_path": "zero.offload_path (device nvme; refused when offload_optimizer's differs)",
    "zero_optimization.offload_param.buffer_count": "zero.offload_buffer_count (device nvme; offload_optimizer's wins, noted)",
    "zero_optimization.cpu_offload": "zero.offload_optimizer = cpu when true",
    "zero_optimization.cpu_offload_param": "zero.offload_params = cpu when true (stage 3)",
    "fp16.enabled": "zero.precision",
    "bf16.enabled": "zero.precision",
    "bf16.bf16_master_weights_and_grads": "zero.master_dtype = bf16 when true (Kahan-compensated; gradients are bf16 already)",
    "bf16.bf16_optimizer_states": "zero.optimizer_state_dtype = bf16 when true (with bf16_master_weights_and_grads)",
    "fp16.loss_scale": "zero.loss_scale.initial_scale; when > 0 also min_scale (the same), growth_factor 1: static",
    "fp16.initial_scale_power": "zero.loss_scale.initial_scale = 2**power",
    "fp16.loss_scale_window": "zero.loss_scale.growth_interval",
    "fp16.hysteresis": "zero.loss_scale.hysteresis",
    "fp16.consecutive_hysteresis": "zero.loss_scale.consecutive_hysteresis",
    "fp16.min_loss_scale": "zero.loss_scale.min_scale",
    "communication_data_type": "zero.grad_dtype",
    "data_types.grad_accum_dtype": "zero.grad_dtype",
    "gradient_clipping": "zero.max_grad_norm (0: none)",
    "gradient_accumulation_steps": "zero.gradient_accumulation_steps",
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "train_batch_size": "checked: micro-batch x accumulation x world size",
    "optimizer.type": "optim.optimizer",
    "optimizer.params.lr": "optim.lr",
    "optimizer.params.betas": "optim.beta1, optim.beta2",
    "optimizer.params.eps": "optim.eps",
    "optimizer.params.weight_decay": "optim.weight_decay",
    "optimizer.params.momentum": "optim.momentum",
    "optimizer.params.adam_w_mode": "optim.optimizer (Adam: adamw when true, its default)",
    "optimizer.params.bias_correction": "optim.bias_correction",
    "activation_checkpointing": "zero.activation_checkpointing (the block's presence)",
    "activation_checkpointing.partition_activations": "zero.partition_activations",
    "activation_checkpointing.cpu_checkpointing": "zero.cpu_checkpointing",
    "activation_checkpointing.contiguous_memory_optimization": "zero.contiguous_memory_optimization",
    "scheduler.type": "optim.schedule",
    "scheduler.params.warmup_min_lr": "optim.warmup_start_ratio (/ the peak)",
    "scheduler.params.warmup_max_lr": "optim.lr",
    "scheduler.params.warmup_num_steps": "optim.warmup_steps",
    "scheduler.params.warmup_type": "optim.warmup_type",
    "scheduler.params.total_num_steps": "optim.decay_steps",
    "scheduler.params.warmup_min_ratio": "optim.warmup_start_ratio",
    "scheduler.params.cos_min_ratio": "optim.min_lr_ratio",
    "scheduler.params.cycle_max_lr": "optim.lr (OneCycle)",
    "scheduler.params.cycle_min_lr": "optim.warmup_start_ratio (/ cycle_max_lr)",
    "scheduler.params.cycle_first_step_size": "optim.warmup_steps",
    "scheduler.params.cycle_second_step_size": "optim.cycle_down_steps",
    "scheduler.params.cycle_first_stair_count": "optim.cycle_stairs",
    "scheduler.params.cycle_second_stair_count": "optim.cycle_down_stairs",
    "scheduler.params.decay_lr_rate": "optim.decay_rate",
    "scheduler.params.decay_step_size": "optim.decay_interval",
    "scheduler.params.cycle_momentum": "optim.cycle_momentum",
    "scheduler.params.cycle_min_mom": "optim.min_momentum",
    "scheduler.params.cycle_max_mom": "optim.max_momentum",
    "scheduler.params.decay_mom_rate": "optim.momentum_decay_rate",
}

# the blocks read key by key (every other block is one row: noted or refused whole)
BLOCKS = (
    "", "zero_optimization", "zero_optimization.offload_optimizer", "zero_optimization.offload_param", "fp16",
    "bf16", "optimizer", "optimizer.params", "scheduler", "scheduler.params", "activation_checkpointing", "data_types",
    "tensor_parallel", "expert_parallel",
)  # fmt: skip

# accepted, change nothing here: block -> its keys (values that would change something are REFUSED)
NOTED = {
    "": (
        # logging, monitors, profilers, timers: zeropp reports its own (--metrics-jsonl, the summary)
        "wall_clock_breakdown", "steps_per_print", "dump_state", "memory_breakdown", "tensorboard", "wandb",
        "csv_monitor", "comet", "comms_logger", "flops_profiler", "timers", "log_level",
        # not DeepSpeed 0.19 keys (DeepSpeed ignores them too), seen in public configs
        "monitor_config", "comms_config", "cuda_visible_devices",
        # the averaging of gradients: zeropp averages once, in the reduction
        "prescale_gradients", "gradient_predivide_factor",
        # DeepSpeed's own optimizers, checkpoint writer, I/O, launcher-side tools
        "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "checkpoint", "aio", "autotuning",
        "compile", "disable_allgather", "disable_python_gc", "dataloader_drop_last", "managed_gradient_accumulation",
        "seq_parallel_communication_data_type", "use_data_before_expert_parallelism",
    ),
    "zero_optimization": (
        "overlap_comm", "contiguous_gradients", "reduce_scatter", "allgather_partitions", "sub_group_size",
        "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_gather_16bit_weights_on_model_save",
        "stage3_gather_fp16_weights_on_model_save", "stage3_model_persistence_threshold",
        "stage3_module_granularity_threshold", "stage3_use_all_reduce_for_fetch_params", "stage3_allgather_sequential",
        "round_robin_gradients", "ignore_unused_parameters", "elastic_checkpoint", "load_from_fp32_weights",
        "memory_efficient_linear", "use_multi_rank_bucket_allreduce",
        "log_trace_cache_warnings", "cpu_offload_use_pin_memory", "legacy_stage1", "compute_grad_norm",
        "parameter_alignment", "pipeline_loading_checkpoint", "override_module_apply", "enable_sanity_checks",
        "save_muon_momentum_buffer_in_memory", "leaf_module",
    ),
    "zero_optimization.offload_optimizer": (
        "pin_memory", "fast_init", "pipeline_read", "pipeline_write", "cpuadam_cores_perc",
    ),
    # buffer_size: a buffer holds one unit's shard here; max_in_cpu: the ring bounds host memory
    "zero_optimization.offload_param": ("pin_memory", "buffer_size", "max_in_cpu"),
    "fp16": ("auto_cast",),
    # DeepSpeed's bf16 has no loss scaling; fp16's keys written in a bf16 block change nothing here
    "bf16": ("immediate_grad_update", "check_grad_overflow", "loss_scale", "initial_scale_power", "loss_scale_window",
             "hysteresis", "consecutive_hysteresis", "min_loss_scale", "auto_cast"),
    "optimizer": ("legacy_fusion",),
    "optimizer.params": ("torch_adam", "fused"),
    "activation_checkpointing": ("number_checkpoints", "synchronize_checkpoint_boundary", "profile"),
    # AutoTP's module dtype (zeropp casts by zero.precision) and where DeepSpeed keeps modules while it splits
    "tensor_parallel": ("dtype", "keep_module_on_host"),
    # AutoEP's module patterns (zeropp finds transformers' experts modules itself), kernels and transport
    "expert_parallel": ("validate_folding_routing", "async_split_plan", "preset_model", "moe_layer_pattern",
                        "expert_pattern", "router_pattern", "use_grouped_mm", "disable_triton_grouped_mm",
                        "combine_impl", "row_weighting_impl", "gate_up_impl", "comm_backend", "comm_num_sm",
                        "comm_qp_margin", "comm_max_tokens_per_rank"),
}  # fmt: skip
COMMENT = "_"  # a top-level key starting with it is a comment (``"_comment"``): noted

NEVER = object()  # REFUSED whatever the value
OFF = {"enabled": False}  # a block whose "enabled" is false changes nothing

# path -> (why zeropp refuses it, the value that changes nothing and is accepted: NEVER for none)
REFUSED: dict[str, tuple[str, Any]] = {
    "amp": ("NVIDIA Apex AMP is not supported; use bf16 or fp16", OFF),
    "torch_autocast": ("zeropp casts by zero.precision, not torch.autocast; use bf16 or fp16", OFF),
    "fp8": ("zeropp trains in fp32, bf16 or fp16", OFF),
    "pipeline": ("zeropp has no pipeline parallelism", NEVER),
    "elasticity": ("elastic batch sizes are not supported", OFF),
    "sparse_attention": ("DeepSpeed's sparse attention kernels are not part of zeropp", NEVER),
    "curriculum_learning": ("curriculum learning is not implemented", OFF),
    "data_efficiency": ("DeepSpeed's data-efficiency library is not part of zeropp", OFF),
    "compression_training": ("DeepSpeed's compression library is not part of zeropp", NEVER),
    "weight_quantization": ("DeepSpeed's post-training weight quantization is not part of zeropp", NEVER),
    "hybrid_engine": ("DeepSpeed-Chat's hybrid engine is not part of zeropp", OFF),
    "nebula": ("Nebula checkpointing is not supported", OFF),
    "expert_parallel.expert_tensor_parallel_size": ("zeropp splits experts over expert-parallel ranks only", 1),
    "expert_parallel.route_norm": ("zeropp keeps the model's own routing", None),
    "expert_parallel.route_scale": ("zeropp keeps the model's own routing", 1.0),
    "expert_parallel.score_apply": ("zeropp keeps the model's own routing", "auto"),
    "expert_parallel.score_func": ("zeropp keeps the model's own routing", "auto"),
    "expert_parallel.top_k": ("zeropp keeps the model's own routing", "auto"),
    "expert_parallel.routed_scaling_factor": ("zeropp keeps the model's own routing", "auto"),
    "expert_parallel.num_expert_groups": ("zeropp keeps the model's own routing", None),
    "expert_parallel.num_limited_groups": ("zeropp keeps the model's own routing", None),
    "expert_parallel.load_balance_coeff": ("zeropp keeps the model's own auxiliary loss", None),
    "tensor_parallel.tp_overlap_comm": ("zeropp's tensor parallelism does not overlap its communication", False),
    "tensor_parallel.vocab_parallel_lm_head": ("a vocabulary-parallel head is not implemented", None),
    "tensor_parallel.vocab_parallel_ce_backend": ("a vocabulary-parallel head is not implemented", "torch"),
    "tensor_parallel.tensor_parallel": ("DeepSpeed's inference tensor parallelism is not part of zeropp; "
                                        "autotp_size sets the size", {}),
    "tensor_parallel.injection_policy_tuple": ("zeropp splits by transformers' tp plans, not injection policies", None),
    "tensor_parallel.partition_config": ("zeropp splits by transformers' tp plans, not partition configs", None),
    "tensor_parallel.preset_model": ("zeropp splits by transformers' tp plans, not DeepSpeed's presets", None),
    "tensor_parallel.replace_with_kernel_inject": ("DeepSpeed's kernel injection is not part of zeropp", False),
    "gradient_allreduce_op": ("zeropp averages gradients over the ranks", "mean"),
    "zero_optimization.mics_shard_size": ("MiCS is not implemented", -1),
    "zero_optimization.mics_hierarchical_params_gather": ("MiCS is not implemented", False),
    "zero_optimization.zenflow": ("ZenFlow is not implemented", None),
    "zero_optimization.offload_optimizer.ratio": ("partial offload is not implemented", 1),
    "zero_optimization.offload_optimizer.super_offload": ("SuperOffload is not implemented", False),
    "fp16.fp16_master_weights_and_grads": ("zeropp keeps fp32 master weights", False),
    "optimizer.params.amsgrad": ("AMSGrad is not supported", False),
    "optimizer.params.nesterov": ("Nesterov momentum is not supported", False),
    "optimizer.params.dampening": ("SGD's dampening is not supported", 0),
    "scheduler.params.last_batch_iteration": ("zeropp resumes a schedule from its checkpoint's step", -1),
}  # fmt: skip

# another name DeepSpeed accepts -> the key as the tables write it
ALIASES = {
    "bfloat16": "bf16",
    "tensor_parallel.tp": "tensor_parallel.tensor_parallel",
    "tensor_parallel.kernel_inject": "tensor_parallel.replace_with_kernel_inject",
    **{f"zero_optimization.{name}": f"zero_optimization.stage3_{name}" for name in (
        "prefetch_bucket_size", "param_persistence_threshold", "model_persistence_threshold", "max_live_parameters",
        "max_reuse_distance", "gather_16bit_weights_on_model_save", "module_granularity_threshold",
        "use_all_reduce_for_fetch_params", "allgather_sequential")},
}  # fmt: skip

DEEPSPEED_DEFAULTS = {  # inside a block the file has, a key it leaves out means this in DeepSpeed
    "zero_optimization": {
        "stage": 0, "zero_quantized_weights": False, "zero_hpz_partition_size": 1, "zero_quantized_gradients": False,
        "zero_quantized_nontrainable_weights": False, "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8,
        "stage3_param_persistence_threshold": 1e5,
    },
    "fp16": {"loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2,
             "consecutive_hysteresis": False, "min_loss_scale": 1},
    "optimizer.params": {"betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "momentum": 0.0},
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_num_steps": 1000, "warmup_type": "log"},
    "WarmupDecayLR": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000, "warmup_type": "log"},
    "WarmupCosineLR": {"warmup_min_ratio": 0.0, "warmup_num_steps": 1000, "cos_min_ratio": 0.0001,
                       "warmup_type": "log"},
    "OneCycle": {"decay_lr_rate": 0.0, "cycle_first_step_size": 2000, "cycle_second_step_size": None,
                 "cycle_first_stair_count": 0, "cycle_second_stair_count": None, "decay_step_size": 0,
                 "cycle_momentum": True, "cycle_min_mom": 0.8, "cycle_max_mom": 0.9, "decay_mom_rate": 0.0},
}  # fmt: skip
ONE_CYCLE = {  # OneCycle's parameter -> (zeropp's optim key, an integer)
    "cycle_first_step_size": ("warmup_steps", True), "cycle_second_step_size": ("cycle_down_steps", True),
    "cycle_first_stair_count": ("cycle_stairs", True), "cycle_second_stair_count": ("cycle_down_stairs", True),
    "decay_step_size": ("decay_interval", True), "decay_lr_rate": ("decay_rate", False),
    "cycle_min_mom": ("min_momentum", False), "cycle_max_mom": ("max_momentum", False),
    "decay_mom_rate": ("momentum_decay_rate", False),
}  # fmt: skip

SCHEDULES = {
    "WarmupLR": "warmup", "WarmupDecayLR": "warmup_decay", "WarmupCosineLR": "warmup_cosine", "OneCycle": "one_cycle",
}  # fmt: skip
OPTIMIZERS = {"adamw": "adamw", "adam": "adamw", "sgd": "sgd"}  # DeepSpeed's Adam is AdamW unless adam_w_mode false
DTYPES = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16", "bfp16": "bf16"}


def parent(path: str) -> str:
    return path.rpartition(".")[0]


def row(path: str) -> tuple[str, str] | None:
    """What zeropp does with DeepSpeed key `path` (tables' spelling): ("mapped", its zeropp key),
    ("noted", ""), ("refused", why), ("block", "") for a block read key by key; None: no row."""
    if path in MAPPED:
        return "mapped", MAPPED[path]
    if path in BLOCKS:
        return "block", ""
    for prefix in _ancestors(path):
        if prefix in REFUSED:
            return "refused", REFUSED[prefix][0]
        if prefix.rpartition(".")[2] in NOTED.get(parent(prefix), ()) or prefix.startswith(COMMENT):
            return "noted", ""
    return None


def keys_under(block: str) -> list[str]:
    """The keys a block may hold (the tables' spelling), for an unknown key's error."""
    paths = [*MAPPED, *BLOCKS, *REFUSED, *(f"{block}.{key}".lstrip(".") for key in NOTED.get(block, ()))]
    return sorted({path.rpartition(".")[2] for path in paths if path and parent(path) == block})


def _ancestors(path: str) -> list[str]:
    names = path.split(".")
    return [".".join(names[: i + 1]) for i in range(len(names))]


def _json(value: Any) -> str:
    return json.dumps(value, default=str)


def markdown() -> str:
    """The key table of docs/deepspeed.md: every row of these tables, in key order."""
    lines = ["| DeepSpeed key | zeropp |", "| --- | --- |"]
    rows = {**{p: f"sets {m}" for p, m in MAPPED.items()},
            **{f"{b}.{k}".lstrip("."): "accepted, no effect" for b, keys in NOTED.items() for k in keys},
            **{p: "refused: " + why + ("" if ok is NEVER else f" (accepted: `{_json(ok)}`)")
               for p, (why, ok) in REFUSED.items()},
            **{p: f"as `{name}`" for p, name in ALIASES.items()},
            f"{COMMENT}*": "a comment: accepted, no effect"}  # fmt: skip
    lines += [f"| `{path}` | {text} |" for path, text in sorted(rows.items())]
    return "\n".join(lines) + "\n"
