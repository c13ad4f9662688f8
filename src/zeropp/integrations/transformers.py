"""``ZeroTrainer``: the Hugging Face ``transformers.Trainer`` with a :class:`zeropp.ZeroEngine` where
Trainer would wrap the model (DDP, DeepSpeed).

The Trainer keeps its loop, data loading (sharded by rank by accelerate), learning-rate schedule,
logging, callbacks and checkpoint folders; the engine runs forward, backward (averaged over ranks and
accumulation micro-batches), clipping, precision and the optimizer step on its fp32 shards. The
overrides, each small:

- ``create_optimizer`` builds the engine, its optimizer from the Trainer's ``optim`` settings (the
  Trainer's own optimizer, with its decay / no-decay groups, where it decays), and
  hands the Trainer an :class:`EngineOptimizer` whose ``step`` is ``engine.step`` and whose
  ``param_groups`` are the engine optimizer's (so the Trainer's scheduler sets the engine's rate);
- ``_wrap_model`` returns :class:`EngineModule` (forward through the engine, nothing for accelerate to wrap);
- ``training_step`` calls ``engine.backward``; ``_clip_grad_norm`` leaves clipping to the engine;
- context parallelism: ``training_step`` and ``prediction_step`` share each run's rows, each rank
  keeping its slice of all of them (See [Note: shared rows]); evaluation gives the loss only;
- ``_build_accelerator_args``: no autocast or GradScaler from accelerate (precision is the engine's);
- fp16: a step the engine skipped leaves the scheduler unstepped (:class:`SkippedSteps`); ``log``
  adds the loss scale and the skipped steps;
- checkpoints: ``_save_optimizer_and_scheduler`` writes a zeropp sharded checkpoint into
  ``checkpoint-N/zeropp/`` plus the scheduler's state; ``_load_optimizer_and_scheduler`` reads them
  back; ``_load_from_checkpoint`` has nothing to do (the weights are in the sharded checkpoint);
- ``_move_model_to_device`` leaves a meta-device model there; ``pretrained=`` loads its weights
  into the shards once the engine is built;
- ``save_model`` writes a ``save_pretrained`` folder of the consolidated weights.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
import transformers
from torch import nn

from zeropp.checkpoint.pretrained import load_pretrained
from zeropp.config.sections import TopologyConfig, ZeroConfig
from zeropp.context_parallel.batches import own_rows_loss, share_rows
from zeropp.engine import ZeroEngine
from zeropp.integrations import settings
from zeropp.integrations.loop import EngineModule, EngineOptimizer, load_engine_state, save_engine_state
from zeropp.integrations.settings import IntegrationError, ZeroSource
from zeropp.topology import Topology, init_topology
from zeropp.zero import materialize

SCHEDULER_NAME = "scheduler.pt"  # the Trainer's own name for it


TrainerError = IntegrationError  # a ZeroTrainer setting zeropp cannot honour (one line)


def resolve_zero_config(
    source: ZeroSource, args: transformers.TrainingArguments, world_size: int, hidden_size: int | None = None
) -> ZeroConfig:
    """The engine's ZeroConfig: `source` (see :func:`zeropp.integrations.settings.resolve_zero_config`)
    with accumulation, clipping and precision from `args`, and a DeepSpeed micro-batch size that must
    be `args`' per-device batch size."""
    wanted = {
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "max_grad_norm": args.max_grad_norm or None,  # the Trainer's 0 is no clipping
        "precision": "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
    }
    return settings.resolve_zero_config(
        source, wanted, owner="the TrainingArguments", world_size=world_size, hidden_size=hidden_size,
        micro_batch_size=args.per_device_train_batch_size,
    )  # fmt: skip


def context_parallel_size(config: Any) -> int:
    """The context-parallel size of accelerate's ``ParallelismConfig`` (TrainingArguments'
    ``parallelism_config``): its ``sp_size`` (Ulysses) or ``cp_size`` (ring attention; zeropp splits
    the sequences the same way and attends by Ulysses). Its data-parallel sizes need nothing (ZeRO
    shards over every data-parallel rank); tensor parallelism from the arguments is refused."""
    sp, cp = config.sp_size or 1, config.cp_size or 1
    if (config.tp_size or 1) > 1:
        raise TrainerError(
            f"parallelism_config tp_size = {config.tp_size} is not allowed with ZeroTrainer; expected 1 "
            "(tensor parallelism: zeropp.parallelize with a topology's tensor_parallel_size)"
        )
    return max(sp, cp)  # accelerate refuses both at once


class SkippedSteps(transformers.TrainerCallback):
    """After each optimizer step: a step the engine skipped (fp16 overflow) is reported to accelerate's
    optimizer wrapper as skipped, as accelerate's DeepSpeed wrapper reports DeepSpeed's, so the Trainer
    leaves the scheduler where it is (DeepSpeed's engine steps it only without overflow); counted for
    the logs."""

    def __init__(self, trainer: ZeroTrainer) -> None:
        self.trainer = trainer
        self.count = 0

    def on_optimizer_step(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        skipped = self.trainer.engine.last_step_skipped
        self.count += skipped
        optimizer._is_overflow = skipped  # what AcceleratedOptimizer.step_was_skipped reads


class ZeroTrainer(transformers.Trainer):
    """``transformers.Trainer`` training through a :class:`zeropp.ZeroEngine`.

    `zero_config`: a :class:`zeropp.ZeroConfig`, a dict of zeropp ``zero`` keys, or a DeepSpeed JSON
    path or dict (read by :func:`zeropp.config.deepspeed.translate`); None reads ``args.deepspeed``
    when set, else zeropp's defaults. `topology`: the ranks (default :func:`zeropp.init_topology`,
    which adopts a process group accelerate already started; ``args.parallelism_config``'s sequence
    size, where set, is its context-parallel size: :func:`context_parallel_size`). `pretrained`: a safetensors file or a
    Hugging Face folder whose weights are read straight into the shards
    (:func:`zeropp.load_pretrained`: each rank reads its slices), typically for a model built on the
    meta device, which the engine materializes unit by unit: no rank holds the whole model."""

    def __init__(
        self,
        model: nn.Module | None = None,
        args: transformers.TrainingArguments | None = None,
        *rest: Any,
        zero_config: ZeroSource = None,
        topology: Topology | None = None,
        pretrained: str | os.PathLike | None = None,
        **kwargs: Any,
    ) -> None:
        if (
            args is not None and args.deepspeed
        ):  # DeepSpeed's file, read by zeropp; the Trainer must not start DeepSpeed
            zero_config = args.deepspeed if zero_config is None else zero_config
            args = dataclasses.replace(args, deepspeed=None)
        if args is not None and getattr(args, "parallelism_config", None) is not None:  # zeropp's, not accelerate's
            size = context_parallel_size(args.parallelism_config)
            topology = topology or init_topology(TopologyConfig(context_parallel_size=size))
            if topology.context_parallel.size != size:
                raise TrainerError(
                    f"parallelism_config asks for {size} sequence ranks but the topology has context_parallel_size = "
                    f"{topology.context_parallel.size}; expected one of them, or the same size"
                )
            args = dataclasses.replace(args, parallelism_config=None)
        self.zero_source = zero_config
        self.pretrained = pretrained
        self.topology = topology or init_topology()
        self.engine: ZeroEngine | None = None
        self.engine_module: EngineModule | None = None
        super().__init__(model, args, *rest, **kwargs)
        self.skipped_steps = SkippedSteps(self)
        self.add_callback(self.skipped_steps)
        if self.optimizer is not None or self.lr_scheduler is not None:
            raise TrainerError(
                "ZeroTrainer builds the optimizer on zeropp's shards: pass optimizer_cls_and_kwargs, not optimizers"
            )
        if self.args.n_gpu > 1:
            raise TrainerError(
                f"ZeroTrainer runs one device per process ({self.args.n_gpu} GPUs seen): launch with torchrun"
            )
        self._check_context_parallel()

    def _check_context_parallel(self) -> None:
        """Context parallelism shares each run's rows (See [Note: shared rows]): the loss must be the sum
        of token losses over the tokens counted across ranks, which the Trainer passes to the model."""
        size = self.topology.context_parallel.size
        if size > 1 and not self.args.average_tokens_across_devices:
            raise TrainerError(
                f"average_tokens_across_devices = False is not allowed with topology.context_parallel_size = {size} "
                "(each rank holds slices of its run's rows); expected True"
            )
        if size > 1 and not self.model_accepts_loss_kwargs:
            raise TrainerError(
                f"a model whose forward takes no num_items_in_batch is not allowed with "
                f"topology.context_parallel_size = {size} (a slice's loss is its share of the tokens counted across "
                "ranks); expected a model that accepts the Trainer's loss keywords"
            )

    # -- the engine where Trainer would wrap the model ---------------------------------------------

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        args = super()._build_accelerator_args(**kwargs)
        args["mixed_precision"] = "no"  # bf16/fp16 are the engine's precision: no autocast, no GradScaler
        return args

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        """A meta-device model stays there: the engine materializes it unit by unit."""
        if not materialize.is_meta(model):
            super()._move_model_to_device(model, device)

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        if self.engine is None:
            self.engine = self._build_engine()
            self.engine_module = EngineModule(self.engine)
            self.optimizer = EngineOptimizer(self.engine)
        return self.optimizer

    def _build_engine(self) -> ZeroEngine:
        args, model = self.args, self.model
        cls, kwargs = self.optimizer_cls_and_kwargs or self.get_optimizer_cls_and_kwargs(args, model)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) or {
            "params",
            "model",
            "optimizer_dict",
        } & set(kwargs):
            raise TrainerError(
                f"optim {args.optim!r} is not a torch.optim optimizer that zeropp can build on the model's parameters"
            )
        # the Trainer's own optimizer where it decays (its decay / no-decay groups, See [Note: segments]), less
        # the group it leaves empty (no-decay under LoRA); never stepped
        optimizer = super().create_optimizer() if args.weight_decay else (lambda params: cls(params, **kwargs))
        if isinstance(optimizer, torch.optim.Optimizer):
            optimizer.param_groups = [group for group in optimizer.param_groups if group["params"]]
        config = resolve_zero_config(
            self.zero_source,
            args,
            self.topology.world_size,
            getattr(getattr(model, "config", None), "hidden_size", None),
        )
        engine = ZeroEngine(model, optimizer, None, config, self.topology, seed=args.seed)
        if self.pretrained is not None:
            load_pretrained(engine, self.pretrained)
        return engine

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        return (
            self.engine_module if self.engine_module is not None else super()._wrap_model(model, training, dataloader)
        )

    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        """The Trainer's step with ``engine.backward``: the loss the Trainer would backpropagate (already
        divided over the accumulation, multiplied by the ranks where tokens are counted over ranks, as
        DDP averages) times the accumulation steps, which the engine divides by again."""
        model.train()
        inputs = self._prepare_inputs(inputs)
        if self.topology.context_parallel.size > 1:
            inputs = share_rows(self.engine.comm, self.topology, inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        del inputs
        scaled = self.loss_is_scaled_for_ga
        if scaled is None:
            scaled = (
                self.model_accepts_loss_kwargs and num_items_in_batch is not None
            ) or self.compute_loss_func is not None
        if not scaled:
            loss = loss / self.current_gradient_accumulation_steps
        self.engine.backward(loss * self.args.gradient_accumulation_steps)
        return loss.detach()

    def prediction_step(
        self, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool, ignore_keys: list[str] | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """Under context parallelism: the loss of this rank's own rows, from the slices of its run's shared
        rows (logits are sequence slices, so only the loss is evaluated)."""
        size = self.topology.context_parallel.size
        if size == 1:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        if not prediction_loss_only or "labels" not in inputs:
            raise TrainerError(
                f"evaluating predictions or without labels is not allowed with topology.context_parallel_size = "
                f"{size} (each rank holds slices of the sequences); expected prediction_loss_only with labels"
            )
        with torch.no_grad():
            loss = own_rows_loss(
                self.engine.comm, self.topology, lambda given: model(**given).logits, self._prepare_inputs(inputs)
            )
        return loss.detach(), None, None

    def _clip_grad_norm(self, model: nn.Module) -> None:
        """The engine clips (max_grad_norm) at its step; the norm is logged from ``engine.last_grad_norm``."""
        return None

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> None:
        return None

    def _maybe_log_save_evaluate(self, tr_loss: torch.Tensor, grad_norm: Any, *args: Any, **kwargs: Any) -> None:
        if self.engine is not None and self.control.should_log:
            grad_norm = self.engine.last_grad_norm  # of the step just taken
        super()._maybe_log_save_evaluate(tr_loss, grad_norm, *args, **kwargs)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """fp16: each training log also gives the loss scale and the steps skipped so far (overflows)."""
        if self.engine is not None and self.engine.scaler.enabled and "loss" in logs:
            logs = {**logs, "loss_scale": self.engine.scaler.scale, "skipped_steps": self.skipped_steps.count}
        super().log(logs, *args, **kwargs)

    # -- checkpoints and the saved model -------------------------------------------------------------

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """A zeropp sharded checkpoint (weights, optimizer, loss scale) in ``output_dir/zeropp/``, and
        the scheduler's state (collective)."""
        save_engine_state(self.engine, output_dir, self.state.global_step)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """Nothing before the engine exists: the weights come with the sharded checkpoint."""

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        load_engine_state(self.engine, checkpoint)
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """A ``save_pretrained`` folder of the consolidated fp32 weights (collective: every rank calls it).
        Inside a training checkpoint only the config is written: the weights are in ``zeropp/``."""
        if self.engine is None:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir or self.args.output_dir
        if _internal_call:
            if self.args.should_save and hasattr(self.model, "config"):
                self.model.config.save_pretrained(output_dir)
            return None
        self._save(output_dir, state_dict=self.engine.full_state_dict())
        return None
