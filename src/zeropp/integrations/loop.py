"""The engine as a host training loop sees it: a module to call, an optimizer to step, a checkpoint
folder to save and load, and the user's torch optimizer mapped onto the engine's fp32 shards.

Shared by the Hugging Face Trainer (``integrations.transformers``) and Lightning
(``integrations.lightning``); imports neither."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zeropp.checkpoint.dcp import find_latest, load_checkpoint, save_checkpoint
from zeropp.config.sections import ZeroConfig
from zeropp.engine import ZeroEngine
from zeropp.integrations.settings import IntegrationError
from zeropp.topology import Topology
from zeropp.zero.optim.stepping import is_elementwise

ZEROPP_DIR = "zeropp"  # <checkpoint>/zeropp/step-0000000N: the sharded training state
GROUP_ONLY = ("params", "weight_decay", "initial_lr")  # group keys that are not constructor hyperparameters


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


# -- the user's optimizer on the engine's shards -----------------------------------------------------


def build_engine(
    model: nn.Module,
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | torch.optim.Optimizer,
    config: ZeroConfig,
    topology: Topology,
    *,
    seed: int,
    decay: float = 0.0,
    decayed: Iterable[nn.Parameter] = (),
) -> ZeroEngine:
    """A ZeroEngine on `model` whose optimizer (built by `optimizer` on the masters, without weight
    decay) decays `decayed` parameters' elements only, by `decay`, as torch's AdamW does; or, where
    `optimizer` is the user's own, that optimizer as ZeroEngine takes it."""
    engine = ZeroEngine(model, optimizer, None, config, topology, seed=seed)
    if decay:
        masks = decay_masks(engine, {id(p) for p in decayed})
        engine.optimizer.register_step_pre_hook(lambda optimizer, *_: decoupled_decay(optimizer, masks, decay))
    return engine


def from_torch_optimizer(
    optimizer: torch.optim.Optimizer,
) -> tuple[Callable[[list[nn.Parameter]], torch.optim.Optimizer] | torch.optim.Optimizer, float, list[nn.Parameter]]:
    """(a factory building `optimizer`'s class and groups on the masters, the weight decay, the decayed
    parameters) for :func:`build_engine`, where the groups differ in weight decay only, one nonzero value
    and 0 (AdamW's decay / no-decay groups on the flat shards). The engine's optimizer keeps the groups,
    in order, so that schedulers built on `optimizer` can drive it: the first holds every master, the
    others hold none and only carry their hyperparameters. Any other optimizer is returned itself: the
    engine steps its groups on whole parameters (See [Note: the whole-parameter step])."""
    cls, groups = type(optimizer), optimizer.param_groups
    hyper = [{k: v for k, v in g.items() if k not in GROUP_ONLY} for g in groups]
    decays = {g.get("weight_decay", 0.0) for g in groups}
    one_decay = len(decays) == 1 or (issubclass(cls, torch.optim.AdamW) and len(decays - {0.0}) == 1)
    if not (is_elementwise(cls) and all(h == hyper[0] for h in hyper) and one_decay):
        return optimizer, 0.0, []
    decay = max(decays) if len(decays) > 1 else 0.0  # the masters' group then decays by masks (build_engine)
    decayed = [p for g in groups if g["weight_decay"] for p in g["params"]] if decay else []
    first = {**groups[0], **({"weight_decay": 0.0} if decay else {})}
    rest = [{**g, "params": []} for g in groups[1:]]
    return lambda masters: cls([{**first, "params": masters}, *rest]), decay, decayed


def decay_masks(engine: ZeroEngine, decayed: set[int]) -> dict[int, torch.Tensor]:
    """Per master (by id): which of this rank's elements belong to a parameter that is decayed."""
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
