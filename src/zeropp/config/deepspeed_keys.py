"""What zeropp does with each DeepSpeed config key: the zeropp key it sets (MAPPED), accepted
without effect (NOTED), refused and why (REFUSED), and DeepSpeed's defaults inside a block.

Read by zeropp.config.deepspeed; README "Coming from DeepSpeed" summarizes these tables.
"""

from __future__ import annotations

AUTO = "auto"

# DeepSpeed key -> the zeropp key it sets (documentation and the table test; "+" where it sets several)
MAPPED = {
    "zero_optimization.stage": "zero.stage",
    "zero_optimization.reduce_bucket_size": "zero.reduce_bucket_numel (/ world size)",
    "zero_optimization.allgather_bucket_size": "zero.allgather_bucket_numel (/ world size)",
    "zero_optimization.stage3_prefetch_bucket_size": "zero.prefetch = 0 when 0 (else noted: zeropp prefetches units)",
    "zero_optimization.stage3_param_persistence_threshold": "zero.persistence_threshold (per unit)",
    "zero_optimization.zero_quantized_weights": "zero.quantized_weights",
    "zero_optimization.zero_hpz_partition_size": "zero.hpz_partition_size",
    "zero_optimization.zero_quantized_gradients": "zero.quantized_gradients",
    "zero_optimization.offload_optimizer.device": "zero.offload_optimizer",
    "zero_optimization.offload_param.device": "zero.offload_params",
    "zero_optimization.cpu_offload": "zero.offload_optimizer",
    "fp16.enabled": "zero.precision",
    "bf16.enabled": "zero.precision",
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
}

# accepted, change nothing here: block -> keys (values that would change something are REFUSED)
NOTED = {
    "": (
        "wall_clock_breakdown", "steps_per_print", "dump_state", "memory_breakdown", "prescale_gradients",
        "gradient_predivide_factor", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "tensorboard",
        "wandb", "csv_monitor", "comet", "comms_logger", "flops_profiler", "checkpoint", "aio",
    ),
    "zero_optimization": (
        "overlap_comm", "contiguous_gradients", "reduce_scatter", "allgather_partitions", "sub_group_size",
        "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_gather_16bit_weights_on_model_save",
        "stage3_gather_fp16_weights_on_model_save", "gather_16bit_weights_on_model_save", "round_robin_gradients",
        "ignore_unused_parameters", "elastic_checkpoint", "load_from_fp32_weights", "memory_efficient_linear",
        "use_multi_rank_bucket_allreduce", "zero_quantized_nontrainable_weights", "log_trace_cache_warnings",
        "cpu_offload_use_pin_memory", "legacy_stage1",
    ),
    "offload": ("pin_memory", "buffer_count", "buffer_size", "max_in_cpu", "fast_init", "nvme_path"),
    "fp16": ("auto_cast",),
    "bf16": ("immediate_grad_update", "check_grad_overflow"),
    "optimizer.params": ("torch_adam", "fused"),
    "activation_checkpointing": ("number_checkpoints", "synchronize_checkpoint_boundary", "profile"),
}

# refused whatever their value (keys refused only for some values: _Reader.refuse_unless)
REFUSED = {
    "amp": "NVIDIA Apex AMP is not supported; use bf16 or fp16",
    "pipeline": "zeropp has no pipeline parallelism",
    "elasticity": "elastic batch sizes are not supported",
    "sparse_attention": "DeepSpeed's sparse attention kernels are not part of zeropp",
    "curriculum_learning": "curriculum learning is not implemented",
    "data_efficiency": "DeepSpeed's data-efficiency library is not part of zeropp",
    "compression_training": "DeepSpeed's compression library is not part of zeropp",
    "autotuning": "the DeepSpeed autotuner is not part of zeropp",
    "tensor_parallel": "DeepSpeed's AutoTP block is not read; use --tensor-parallel (topology.tensor_parallel_size)",
    "zero_optimization.mics_shard_size": "MiCS is not implemented",
    "zero_optimization.mics_hierarchical_params_gather": "MiCS is not implemented",
    "zero_optimization.zenflow": "ZenFlow is not implemented",
    "zero_optimization.offload_param.ratio": "partial parameter offload is not implemented",
}

DEEPSPEED_DEFAULTS = {  # inside a block the file has, a key it leaves out means this in DeepSpeed
    "zero_optimization": {
        "stage": 0, "zero_quantized_weights": False, "zero_hpz_partition_size": 1, "zero_quantized_gradients": False,
        "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8, "stage3_param_persistence_threshold": 1e5,
    },
    "fp16": {"loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2,
             "consecutive_hysteresis": False, "min_loss_scale": 1},
    "optimizer.params": {"betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "momentum": 0.0},
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_num_steps": 1000, "warmup_type": "log"},
    "WarmupDecayLR": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000, "warmup_type": "log"},
    "WarmupCosineLR": {"warmup_min_ratio": 0.0, "warmup_num_steps": 1000, "cos_min_ratio": 0.0001,
                       "warmup_type": "log"},
}  # fmt: skip

SCHEDULES = {"WarmupLR": "warmup", "WarmupDecayLR": "warmup_decay", "WarmupCosineLR": "warmup_cosine"}
OPTIMIZERS = {"adamw": "adamw", "adam": "adamw", "sgd": "sgd"}  # DeepSpeed's Adam is AdamW unless adam_w_mode false
DTYPES = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16", "bfp16": "bf16"}
