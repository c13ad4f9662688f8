"""``ZeroTrainer``: the Hugging Face ``transformers.Trainer`` with a :class:`zeropp.ZeroEngine` where
Trainer would wrap the model (DDP, DeepSpeed).

The Trainer keeps its loop, data loading (sharded by rank by accelerate), learning-rate schedule,
logging, callbacks and checkpoint folders; the engine runs forward, backward (averaged over ranks and
accumulation micro-batches), clipping, precision and the optimizer step on its fp32 shards. The
overrides, each small:

- ``create_optimizer`` builds the engine, its optimizer from the Trainer's ``optim`` settings, and
  hands the Trainer an :class:`EngineOptimizer` whose ``step`` is ``engine.step`` and whose
  ``param_groups`` are the engine optimizer's (so the Trainer's scheduler sets the engine's rate);
- ``_wrap_model`` returns :class:`EngineModule` (forward through the engine, nothing for accelerate to wrap);
- ``training_step`` calls ``engine.backward``; ``_clip_grad_norm`` leaves clipping to the engine;
- ``_build_accelerator_args``: no autocast or GradScaler from accelerate (precision is the engine's);
- checkpoints: ``_save_optimizer_and_scheduler`` writes a zeropp sharded checkpoint into
  ``checkpoint-N/zeropp/`` plus the scheduler's state; ``_load_optimizer_and_scheduler`` reads them
  back; ``_load_from_checkpoint`` has nothing to do (the weights are in the sharded checkpoint);
- ``save_model`` writes a ``save_pretrained`` folder of the consolidated weights.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn

from zeropp.checkpoint.dcp import find_latest, load_checkpoint, save_checkpoint
from zeropp.config import deepspeed
from zeropp.config.sections import ZeroConfig, load_config
from zeropp.engine import ZeroEngine
from zeropp.errors import ZeroppError
from zeropp.topology import Topology, init_topology

logger = logging.getLogger(__name__)

ZEROPP_DIR = "zeropp"  # checkpoint-N/zeropp/step-0000000N: the sharded training state
SCHEDULER_NAME = "scheduler.pt"  # the Trainer's own name for it
FROM_ARGS = ("gradient_accumulation_steps", "max_grad_norm", "precision")  # ZeroConfig keys TrainingArguments set


class TrainerError(ZeroppError, ValueError):
    """A ZeroTrainer setting zeropp cannot honour (one line)."""


class EngineModule(nn.Module):
    """What the Trainer's loop calls ``model``: forward through the engine. It has no parameters or
    submodules of its own, so accelerate finds nothing to wrap and ``zero_grad`` nothing to clear."""

    def __init__(self, engine: ZeroEngine) -> None:
        super().__init__()
        self.engine = engine  # not an nn.Module: not registered as a submodule

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)

    def train(self, mode: bool = True) -> EngineModule:
        self.training = mode
        self.engine.train(mode)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The engine clears its gradients at each optimizer step."""


class EngineOptimizer(torch.optim.Optimizer):
    """The engine's optimizer as the Trainer sees it: ``step`` is ``engine.step`` (clipping, loss
    scale, the optimizer on the fp32 shards); groups and state are the engine optimizer's, so a
    scheduler built on this sets the rates the engine steps with."""

    def __init__(self, engine: ZeroEngine) -> None:  # no Optimizer.__init__: the engine's optimizer holds everything
        self.engine = engine
        self._optimizer_step_pre_hooks: dict = {}
        self._optimizer_step_post_hooks: dict = {}

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.engine.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.engine.optimizer.param_groups = groups

    @property
    def state(self) -> Any:
        return self.engine.optimizer.state

    @state.setter
    def state(self, state: Any) -> None:
        self.engine.optimizer.state = state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.engine.optimizer.defaults

    @defaults.setter
    def defaults(self, defaults: dict[str, Any]) -> None:
        self.engine.optimizer.defaults = defaults

    def step(self, closure: Any = None) -> None:
        engine = self.engine
        if engine.micro_step % engine.config.gradient_accumulation_steps:
            raise TrainerError(
                f"the Trainer stepped after {engine.micro_step} micro-batches, not a multiple of gradient_accumulation_steps "
                f"{engine.config.gradient_accumulation_steps}: make the batches per epoch a multiple of it (dataloader_drop_last)"
            )
        engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The engine clears its gradients at each optimizer step."""

    def state_dict(self) -> dict[str, Any]:
        return self.engine.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.engine.optimizer.load_state_dict(state_dict)


def resolve_zero_config(
    source: ZeroConfig | Mapping[str, Any] | str | os.PathLike | None,
    args: transformers.TrainingArguments,
    world_size: int,
    hidden_size: int | None = None,
) -> ZeroConfig:
    """The engine's ZeroConfig: `source` (a ZeroConfig; a dict of zeropp ``zero`` keys; a DeepSpeed
    JSON path or a dict with ``zero_optimization``) with accumulation, clipping and precision from
    `args`. A value that `source` sets explicitly and `args` contradicts is refused in one line."""
    wanted = {
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "max_grad_norm": args.max_grad_norm or None,  # the Trainer's 0 is no clipping
        "precision": "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
    }
    defaults = ZeroConfig()
    if source is None:
        zero, where = defaults, "zero_config"
    elif isinstance(source, ZeroConfig):
        zero, where = source, "zero_config"
    elif isinstance(source, Mapping) and "zero_optimization" not in source:
        zero, where = load_config({"zero": dict(source)}).zero, "zero_config"
    else:  # a DeepSpeed config: "auto" and the keys it leaves out take the TrainingArguments' values
        base = load_config(
            None,
            {"train.micro_batch_size": args.per_device_train_batch_size, **{f"zero.{k}": v for k, v in wanted.items()}},
        )
        translation = deepspeed.translate(source, world_size=world_size, hidden_size=hidden_size, base=base)
        config = translation.config(base)
        if config.train.micro_batch_size != args.per_device_train_batch_size:
            raise TrainerError(
                f"the DeepSpeed config's train_micro_batch_size_per_gpu {config.train.micro_batch_size} is not "
                f'per_device_train_batch_size {args.per_device_train_batch_size}; make them agree or write "auto"'
            )
        if any(key in deepspeed.read(source) for key in ("optimizer", "scheduler")):
            logger.warning(
                "ZeroTrainer: the DeepSpeed config's optimizer and scheduler are replaced by the TrainingArguments'"
            )
        defaults, zero, where = base.zero, config.zero, "the DeepSpeed config"
    for key, value in wanted.items():
        mine = getattr(zero, key)
        if mine != value and mine != getattr(defaults, key):
            raise TrainerError(f"{where} sets {key} {mine!r} but the TrainingArguments say {value!r}; make them agree")
    return dataclasses.replace(zero, **wanted)


class ZeroTrainer(transformers.Trainer):
    """``transformers.Trainer`` training through a :class:`zeropp.ZeroEngine`.

    `zero_config`: a :class:`zeropp.ZeroConfig`, a dict of zeropp ``zero`` keys, or a DeepSpeed JSON
    path or dict (read by :func:`zeropp.config.deepspeed.translate`); None reads ``args.deepspeed``
    when set, else zeropp's defaults. `topology`: the ranks (default :func:`zeropp.init_topology`,
    which adopts a process group accelerate already started)."""

    def __init__(
        self,
        model: nn.Module | None = None,
        args: transformers.TrainingArguments | None = None,
        *rest: Any,
        zero_config: ZeroConfig | Mapping[str, Any] | str | os.PathLike | None = None,
        topology: Topology | None = None,
        **kwargs: Any,
    ) -> None:
        if (
            args is not None and args.deepspeed
        ):  # DeepSpeed's file, read by zeropp; the Trainer must not start DeepSpeed
            zero_config = args.deepspeed if zero_config is None else zero_config
            args = dataclasses.replace(args, deepspeed=None)
        self.zero_source = zero_config
        self.topology = topology or init_topology()
        self.engine: ZeroEngine | None = None
        self.engine_module: EngineModule | None = None
        super().__init__(model, args, *rest, **kwargs)
        if self.optimizer is not None or self.lr_scheduler is not None:
            raise TrainerError(
                "ZeroTrainer builds the optimizer on zeropp's shards: pass optimizer_cls_and_kwargs, not optimizers"
            )
        if self.args.n_gpu > 1:
            raise TrainerError(
                f"ZeroTrainer runs one device per process ({self.args.n_gpu} GPUs seen): launch with torchrun"
            )

    # -- the engine where Trainer would wrap the model ---------------------------------------------

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        args = super()._build_accelerator_args(**kwargs)
        args["mixed_precision"] = "no"  # bf16/fp16 are the engine's precision: no autocast, no GradScaler
        return args

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
                f"optim {args.optim!r} is not an elementwise torch.optim optimizer; zeropp steps fp32 shards with one"
            )
        decay = args.weight_decay
        if decay and not issubclass(cls, torch.optim.AdamW):
            raise TrainerError(
                f"weight_decay {decay} with {cls.__name__}: ZeroTrainer keeps the Trainer's no-decay groups for AdamW only"
            )
        decayed = set(self.get_decay_parameter_names(model))
        decayed_ids = {id(p) for name, p in model.named_parameters() if name in decayed}
        kwargs = {**kwargs, "weight_decay": 0.0} if issubclass(cls, torch.optim.AdamW) else dict(kwargs)
        config = resolve_zero_config(
            self.zero_source,
            args,
            self.topology.world_size,
            getattr(getattr(model, "config", None), "hidden_size", None),
        )
        engine = ZeroEngine(model, lambda masters: cls(masters, **kwargs), None, config, self.topology, seed=args.seed)
        if decay:
            masks = decay_masks(engine, decayed_ids)
            engine.optimizer.register_step_pre_hook(lambda optimizer, *_: decoupled_decay(optimizer, masks, decay))
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

    def _clip_grad_norm(self, model: nn.Module) -> None:
        """The engine clips (max_grad_norm) at its step; the norm is logged from ``engine.last_grad_norm``."""
        return None

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> None:
        return None

    def _maybe_log_save_evaluate(self, tr_loss: torch.Tensor, grad_norm: Any, *args: Any, **kwargs: Any) -> None:
        if self.engine is not None and self.control.should_log:
            grad_norm = self.engine.last_grad_norm  # of the step just taken
        super()._maybe_log_save_evaluate(tr_loss, grad_norm, *args, **kwargs)

    # -- checkpoints and the saved model -------------------------------------------------------------

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """A zeropp sharded checkpoint (weights, optimizer, loss scale) in ``output_dir/zeropp/``, and
        the scheduler's state (collective)."""
        save_checkpoint(self.engine, Path(output_dir) / ZEROPP_DIR, self.state.global_step)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """Nothing before the engine exists: the weights come with the sharded checkpoint."""

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        found = find_latest(Path(checkpoint) / ZEROPP_DIR)
        if found is None:
            raise TrainerError(
                f"{checkpoint!r} holds no zeropp checkpoint ({ZEROPP_DIR}/step-N): resume one ZeroTrainer saved"
            )
        load_checkpoint(self.engine, found)
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


def decay_masks(engine: ZeroEngine, decayed: set[int]) -> dict[int, torch.Tensor]:
    """Per master (by id): which of this rank's elements belong to a parameter the Trainer decays."""
    masks = {}
    for unit in engine.units:
        start = 0 if unit.shard_world == 1 else unit.layout.shard_range(unit.groups.shard.rank)[0]
        numel = unit.master.numel()
        mask = torch.zeros(numel, dtype=torch.bool, device=unit.master.device)
        for index, param in enumerate(unit.params):
            if id(param) in decayed:
                lo, hi = unit.layout.param_range(index)
                lo, hi = max(lo - start, 0), min(hi - start, numel)
                if lo < hi:
                    mask[lo:hi] = True
        masks[id(unit.master)] = mask
    return masks


@torch.no_grad()
def decoupled_decay(optimizer: torch.optim.Optimizer, masks: dict[int, torch.Tensor], decay: float) -> None:
    """AdamW's decoupled weight decay (``p *= 1 - lr * wd``, as torch's AdamW computes it) on the decayed
    elements only, before the optimizer (built with weight_decay 0) steps."""
    for group in optimizer.param_groups:
        factor = 1 - group["lr"] * decay
        for master in group["params"]:
            if master.grad is not None:
                master.copy_(torch.where(masks[id(master)], master * factor, master))
