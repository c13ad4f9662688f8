"""The engine as a host training loop sees it: a module to call, an optimizer to step, a checkpoint
folder to save and load.

Shared by the Hugging Face Trainer (``integrations.transformers``) and Lightning
(``integrations.lightning``); imports neither."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zeropp.checkpoint.dcp import find_latest, load_checkpoint, save_checkpoint
from zeropp.engine import ZeroEngine
from zeropp.integrations.settings import IntegrationError

ZEROPP_DIR = "zeropp"  # <checkpoint>/zeropp/step-0000000N: the sharded training state


class EngineModule(nn.Module):
    """What the host loop calls ``model``: forward through the engine. It has no parameters or
    submodules of its own, so nothing wraps or moves it and ``zero_grad`` has nothing to clear."""

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
    """The engine's optimizer as the host loop sees it: ``step`` runs the closure if given, then
    ``engine.step`` (clipping, loss scale, the optimizer on the fp32 shards); groups and state are the
    engine optimizer's, so a scheduler driving this sets the rates the engine steps with."""

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

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = closure() if closure is not None else None
        engine = self.engine
        if engine.micro_step % engine.config.gradient_accumulation_steps:
            raise IntegrationError(
                f"the optimizer stepped after {engine.micro_step} micro-batches, not a multiple of gradient_accumulation_steps "
                f"{engine.config.gradient_accumulation_steps}: make the batches per epoch a multiple of it (drop the last one)"
            )
        engine.step()
        self._opt_called = True  # what torch's LR schedulers check, here without their wrapper (see below)
        return loss

    # A scheduler wraps its optimizer's step to see it called first; one rebound to this optimizer
    # (Lightning's, built on the user's optimizer) finds this step already saying so.
    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The engine clears its gradients at each optimizer step."""

    def state_dict(self) -> dict[str, Any]:
        return self.engine.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.engine.optimizer.load_state_dict(state_dict)


# -- checkpoints -----------------------------------------------------------------------------------


def save_engine_state(engine: ZeroEngine, folder: str | Path, step: int) -> Path:
    """The engine's sharded state (weights, optimizer, loss scale, RNG) in ``folder/zeropp/`` (collective)."""
    return save_checkpoint(engine, Path(folder) / ZEROPP_DIR, step)


def load_engine_state(engine: ZeroEngine, folder: str | Path) -> None:
    """Load what :func:`save_engine_state` wrote into `folder` (collective); one line when there is none.
    The optimizer's settings are the checkpoint's (the learning rate its scheduler had set): the
    trainer resumes its own scheduler from the same folder, as it would with DeepSpeed's state."""
    found = find_latest(Path(folder) / ZEROPP_DIR)
    if found is None:
        raise IntegrationError(
            f"{str(folder)!r} holds no zeropp checkpoint ({ZEROPP_DIR}/step-N): resume one that zeropp saved"
        )
    load_checkpoint(engine, found, optimizer_settings="checkpoint")
