"""``ZeroStrategy``: Lightning 2.x (the ``lightning`` package) training through a :class:`zeropp.ZeroEngine`.

``lightning.Trainer(strategy=ZeroStrategy(zero_config))``, or ``strategy="zeropp"`` (and
``"zeropp_stage_1"`` .. ``"zeropp_stage_3"``) once this module is imported. Lightning keeps its loop,
launcher and process group (DDP's), samplers, logging, callbacks and checkpoint files; the engine runs
forward, backward, clipping, precision and the optimizer step on its fp32 shards:

- models built in ``configure_model`` (under ``model_sharded_context``: the meta device), or under
  ``trainer.init_module(empty_init=True)``, are materialized by the engine unit by unit under the
  seed of ``seed_everything``; models built for real start from rank 0's weights;
- ``configure_optimizers``: one torch optimizer, with any param groups, and its schedulers, which
  then drive the engine's optimizer;
- the flags ``accumulate_grad_batches``, ``gradient_clip_val`` (by norm) and ``precision``
  (``"32-true"``; ``"bf16-mixed"`` and ``"bf16-true"`` both compute in bf16 over fp32 master shards)
  become the engine's; the ``zero_config`` may set them too, but not to other values;
- ``trainer.save_checkpoint(path)`` writes a folder: zeropp's sharded state in ``path/zeropp/`` and
  Lightning's own state (loops, callbacks, schedulers) in ``path/lightning.ckpt``; ``ckpt_path=``
  loads both. Lightning's ``LightningModule.load_from_checkpoint`` reads one file: write it with
  :func:`to_lightning_checkpoint` (the consolidated weights, in one process).
"""

from __future__ import annotations

import os
from collections.abc import Generator, Mapping
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from zeropp.checkpoint.dcp import consolidated_state, find_latest
from zeropp.engine import ZeroEngine
from zeropp.index.ranks import Layout
from zeropp.integrations.loop import (
    ZEROPP_DIR,
    EngineModule,
    EngineOptimizer,
    load_engine_state,
    save_engine_state,
)
from zeropp.integrations.settings import IntegrationError, ZeroSource, resolve_zero_config
from zeropp.topology import build_topology

PRECISIONS = {"32-true": "fp32", "bf16-mixed": "bf16", "bf16-true": "bf16"}  # Lightning's flag: the engine's precision
LIGHTNING_FILE = "lightning.ckpt"  # Lightning's own checkpoint dict, without weights and optimizer states


class ZeroPrecision(Precision):
    """Lightning's precision flag, carried out by the engine: no autocast, no module conversion, no
    clipping here (the engine clips at its step); backward is ``engine.backward``."""

    def __init__(self, precision: str = "32-true") -> None:
        if precision not in PRECISIONS:
            raise IntegrationError(f"precision {precision!r}: ZeroStrategy takes {', '.join(map(repr, PRECISIONS))}")
        self.precision = precision  # type: ignore[assignment]

    def backward(
        self, tensor: torch.Tensor, model: pl.LightningModule, optimizer: Any, *args: Any, **kwargs: Any
    ) -> None:
        """Lightning divided the loss over ``accumulate_grad_batches``; the engine divides it again."""
        engine = model.trainer.strategy.engine
        engine.backward(tensor * engine.config.gradient_accumulation_steps)

    def clip_gradients(self, optimizer: Any, clip_val: float = 0.0, gradient_clip_algorithm: Any = None) -> None:
        """The engine clips to ``gradient_clip_val`` at its step."""


class LightningRoot(nn.Module):
    """The engine's model: the LightningModule as its one child. The engine's root unit (every
    parameter outside the repeated blocks) is gathered around this module's call, that is around a
    whole ``training_step`` however it reaches its layers."""

    def __init__(self, module: pl.LightningModule) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


class ZeroStrategy(DDPStrategy):
    """Lightning's strategy for zeropp. `zero_config`: a :class:`zeropp.ZeroConfig`, a dict of zeropp
    ``zero`` keys, or a DeepSpeed JSON path or dict (read by :func:`zeropp.config.deepspeed.translate`);
    None: zeropp's defaults (stage 3). The other arguments are DDPStrategy's (launcher, process group)."""

    strategy_name = "zeropp"

    def __init__(
        self,
        zero_config: ZeroSource = None,
        *,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: str = "popen",
    ) -> None:
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io, precision_plugin=precision_plugin, process_group_backend=process_group_backend,
            timeout=timeout, start_method=start_method,
        )  # fmt: skip
        self.zero_source = zero_config
        self.engine: ZeroEngine | None = None
        self._engine_optimizer: EngineOptimizer | None = None
        self._scheduler_configs: list = []

    @property
    def precision_plugin(self) -> ZeroPrecision:
        return self._precision_plugin if self._precision_plugin is not None else ZeroPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        """The plugin Lightning built from its ``precision`` flag, as the engine's precision."""
        if plugin is not None and not isinstance(plugin, ZeroPrecision):
            plugin = ZeroPrecision(getattr(plugin, "precision", type(plugin).__name__))
        self._precision_plugin = plugin

    # -- models: meta device, then the engine ---------------------------------------------------------

    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``trainer.init_module(empty_init=True)``: the meta device (the engine materializes it)."""
        with torch.device("meta") if empty_init else nullcontext():
            yield

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model`` builds on the meta device; the engine materializes it unit by unit."""
        with torch.device("meta"):
            yield

    def setup(self, trainer: pl.Trainer) -> None:
        self.accelerator.setup(trainer)
        if trainer.gradient_clip_algorithm == "value":
            raise IntegrationError("gradient_clip_algorithm 'value': ZeroStrategy clips by norm (gradient_clip_val)")
        if self.engine is None:
            self._build_engine(trainer)
        self.model = EngineModule(self.engine)
        fitting = trainer.state.fn == TrainerFn.FITTING
        self.optimizers = [self._engine_optimizer] if fitting else []
        self.lr_scheduler_configs = self._scheduler_configs if fitting else []

    def _build_engine(self, trainer: pl.Trainer) -> None:
        """The engine, its optimizer from ``configure_optimizers``, and the schedulers rebound to it."""
        super().setup_optimizers(trainer)  # the user's optimizer (on meta parameters, perhaps): read, never stepped
        if len(self.optimizers) != 1:
            raise IntegrationError(
                f"configure_optimizers gave {len(self.optimizers)} optimizers; ZeroStrategy takes one"
            )
        module = self.lightning_module
        wanted = {
            "gradient_accumulation_steps": trainer.accumulate_grad_batches,
            "max_grad_norm": trainer.gradient_clip_val or None,
            "precision": PRECISIONS[self.precision_plugin.precision],
        }
        config = resolve_zero_config(
            self.zero_source, wanted, owner="the Lightning Trainer's flags", world_size=self.world_size,
            hidden_size=getattr(getattr(module, "config", None), "hidden_size", None),
        )  # fmt: skip
        topology = build_topology(
            Layout(self.world_size, self.num_nodes), self.global_rank, self.root_device, self._timeout
        )
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        # the user's optimizer, its groups as they are (See [Note: segments])
        self.engine = ZeroEngine(LightningRoot(module), self.optimizers[0], None, config, topology, seed=seed)
        self._engine_optimizer = EngineOptimizer(self.engine)
        for scheduler_config in self.lr_scheduler_configs:
            scheduler_config.scheduler.optimizer = self._engine_optimizer
        self._scheduler_configs = self.lr_scheduler_configs

    def model_to_device(self) -> None:
        """The engine placed every unit on this rank's device."""

    def teardown(self) -> None:
        """Lightning's teardown without moving the model or optimizer to the host: the engine (and the
        weights, which live in it) stays for a later ``validate``, ``test`` or ``predict``."""
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    # -- checkpoints: zeropp's sharded state + Lightning's own ------------------------------------------

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine must exist to load into

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # in the sharded state

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Nothing: the weights are saved sharded (``full_state_dict()`` consolidates them)."""
        return {}

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {}

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Loaded with the sharded state by :meth:`load_checkpoint`."""

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Loaded with the sharded state by :meth:`load_checkpoint`."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | os.PathLike, storage_options: Any = None
    ) -> None:
        """A folder at `filepath` (collective): ``zeropp/`` and ``lightning.ckpt``."""
        if storage_options is not None:
            raise IntegrationError(
                "ZeroStrategy.save_checkpoint takes no storage_options: zeropp writes its shards itself"
            )
        path = Path(self.broadcast(str(filepath)))
        save_engine_state(self.engine, path, self.engine.global_step)
        if self.is_global_zero:
            rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
            self.checkpoint_io.save_checkpoint(rest, path / LIGHTNING_FILE)
        self.barrier()

    def load_checkpoint(self, checkpoint_path: str | os.PathLike, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        load_engine_state(self.engine, path)
        return self.checkpoint_io.load_checkpoint(path / LIGHTNING_FILE, weights_only=weights_only)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The consolidated fp32 weights under the LightningModule's own keys, on every rank (collective)."""
        prefix = "module."
        return {key.removeprefix(prefix): value for key, value in self.engine.full_state_dict().items()}

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("zeropp", cls, description="zeropp ZeRO (stage 3 unless zero_config says)")
        for stage in (1, 2, 3):
            strategy_registry.register(
                f"zeropp_stage_{stage}", cls, description=f"zeropp ZeRO stage {stage}", zero_config={"stage": stage}
            )


def to_lightning_checkpoint(folder: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write `out`, one file ``LightningModule.load_from_checkpoint`` reads, from a checkpoint folder
    that ZeroStrategy saved: its Lightning state with the consolidated fp32 weights as ``state_dict``
    under the module's own keys (no optimizer states). Runs in one process, whatever world size saved
    it. The folder itself is no file Lightning can open: this is the one step between them."""
    folder, out = Path(folder), Path(out)
    found = find_latest(folder / ZEROPP_DIR)
    if found is None or not (folder / LIGHTNING_FILE).is_file():
        raise IntegrationError(
            f"{str(folder)!r} is not a folder ZeroStrategy saved (it holds {LIGHTNING_FILE} and {ZEROPP_DIR}/step-N)"
        )
    if out.is_dir() or not out.parent.is_dir():
        raise IntegrationError(f"cannot write {str(out)!r}: expected a file name in an existing folder")
    checkpoint = torch.load(folder / LIGHTNING_FILE, map_location="cpu", weights_only=False)  # Lightning's own
    _, tensors = consolidated_state(found)
    checkpoint["state_dict"] = {key.removeprefix("module."): value for key, value in tensors.items()}
    torch.save(checkpoint, out)
    return out


if "zeropp" not in StrategyRegistry:  # importing twice (a reload) must not register twice
    ZeroStrategy.register_strategies(StrategyRegistry)
