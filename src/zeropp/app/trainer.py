"""The main job: train a model (the embedded GPT, or a Hugging Face causal LM: zeropp.app.models.source) on
text (the embedded corpus, or your own: zeropp.app.data.text) under any stage, report metrics and a summary.

Runs inside each rank (``zeropp train`` starts the ranks through torchrun's agent, forked from one server: zeropp.app.launch).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zeropp.app import schedule
from zeropp.app.data.batches import Batches
from zeropp.app.metrics import MetricsLog, StepMetrics, flops_per_token, peak_flops
from zeropp.app.models.source import model_source, training_text
from zeropp.app.summary import CheckpointRecord, RunSummary, ZeroppSwitches
from zeropp.checkpoint.dcp import (
    CheckpointError,
    check_writable,
    find_latest,
    load_checkpoint,
    read_meta,
    save_checkpoint,
    verify_files,
)
from zeropp.checkpoint.pretrained import load_pretrained
from zeropp.comm.ledger import PA_GATHER, bytes_under
from zeropp.config.sections import Config
from zeropp.context_parallel import split_sequence
from zeropp.context_parallel.ulysses import LEDGER_OP as ULYSSES_OP
from zeropp.costs.memory import PeakMeter, analytic_model_state_bytes, flat_numels, peak_memory_bytes
from zeropp.costs.volume import STEP_PHASES, zero3_step_bytes, zero3_units
from zeropp.engine import ZeroEngine
from zeropp.errors import ConfigError, ZeroppError
from zeropp.expert_parallel.dispatch import EXPERT_OPS
from zeropp.tensor_parallel.apply import parallelize
from zeropp.topology import init_topology
from zeropp.zero.grouping import repeated_blocks
from zeropp.zero.offload.disk_params import io_bytes
from zeropp.zero.optim.owners import OWNER_OPS
from zeropp.zero.optim.uncorrected_adam import UncorrectedAdam
from zeropp.zero.options import frozen_quant

COLLECTIVES = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce", "broadcast")
# tp.*: on the tensor-parallel group; pa.all_gather: ZeRO-R's partitioned activation checkpoints (on it too)
LEDGER_OPS = (*COLLECTIVES, *(f"tp.{op}" for op in COLLECTIVES), ULYSSES_OP, PA_GATHER, *OWNER_OPS, *EXPERT_OPS)

OPTIMIZERS = {
    "adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD, "adafactor": torch.optim.Adafactor
}  # fmt: skip


LOW_BIT = {"adamw8bit": "AdamW8bit", "adamw4bit": "AdamW4bit"}  # torchao.optim's classes


def low_bit_adamw(name: str) -> type[torch.optim.Optimizer]:
    """torchao's AdamW with low-bit states for optim.optimizer `name`; one line where torchao is missing."""
    try:
        import torchao.optim
    except ImportError:
        raise ConfigError(
            f"optim.optimizer = {name!r} needs torchao, which is not installed: pip install 'zeropp[lowbit]'"
        ) from None
    return getattr(torchao.optim, LOW_BIT[name])


def checkpoint_to_resume(config: Config) -> Path | None:
    """The checkpoint to start from: checkpoint.resume's path, the latest one for 'auto', or none.

    Refuses a missing or damaged checkpoint, or one saved with another model config (a different
    n_head, say, can hold tensors of the same shapes). An imported checkpoint (zeropp import-deepspeed)
    holds no run config: its parameter names and shapes are checked when it is loaded.
    """
    resume = config.checkpoint.resume
    if resume is None:
        return None
    path = Path(resume) if resume != "auto" else find_latest(config.checkpoint.checkpoint_dir)
    if path is None:
        return None
    run_config = read_meta(path)["extra"].get("config")
    if run_config is None:
        return path
    saved = run_config.get("model", {})
    ours = dataclasses.asdict(config.model)
    defaults = {f.name: f.default for f in dataclasses.fields(config.model)}  # keys newer than the checkpoint
    for key in sorted(ours):
        if saved.get(key, defaults[key]) != ours[key]:
            raise CheckpointError(
                f"checkpoint {str(path)!r} was saved with model.{key} = {saved.get(key)!r}, "
                f"this run has model.{key} = {ours[key]!r}"
            )
    return path


def preflight(config: Config) -> None:
    """Checks that need no process group: the checkpoint folder is writable, the resume point readable
    and undamaged."""
    if config.checkpoint.checkpoint_dir is not None:
        check_writable(config.checkpoint.checkpoint_dir)
    path = checkpoint_to_resume(config)
    if path is not None:
        verify_files(path, read_meta(path))


@dataclasses.dataclass
class RankRecord:
    """What one rank measured, gathered to every rank for the summary (floats: they travel as one tensor)."""

    model_state_bytes: float
    peak_memory_bytes: float
    intra_node_bytes_per_step: float
    inter_node_bytes_per_step: float
    init_peak_memory_bytes: float
    step_peak_memory_bytes: float
    disk_read_bytes_per_step: float  # the disk tier (offload_optimizer = "nvme"); 0 without it
    disk_written_bytes_per_step: float


class TrainingStopped(ZeroppError, RuntimeError):
    """The run cannot go on (a non-finite loss or gradient norm, too many skipped fp16 steps). One line."""


class Trainer:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.topology = init_topology(config.topology)
        self.memory = PeakMeter(self.topology.device)  # from before the model exists
        torch.manual_seed(config.train.seed)
        self.source = model_source(config)
        text = training_text(config, self.source)  # before any collective: a bad file fails here on every rank
        with torch.device("meta") if config.train.init == "meta" else contextlib.nullcontext():
            model = parallelize(self.source.build(), self.topology)
        adapters = config.model.lora_rank is not None
        optimizer, kwargs = self.optimizer(model)
        self.engine = ZeroEngine(model, optimizer, kwargs, config.zero, self.topology, seed=config.train.seed)
        folder = config.zero.flight_record_dir or config.checkpoint.checkpoint_dir
        self.engine.comm.trace.folder = None if folder is None else Path(folder)  # See [Note: collective sequences]
        weights = config.train.init_from or self.source.weights
        if weights is not None:  # a LoRA run's adapters keep their initial values
            load_pretrained(self.engine, weights, base_only=adapters)
        # a LoRA run's checkpoints reference the base folder it read instead of copying the base
        self.frozen_base = weights if adapters and config.train.init_from is None else None
        self.start_step = 0
        self.skipped_steps = self.skipped_in_a_row = 0
        self.checkpoints: list[CheckpointRecord] = []
        self.resumed_from = checkpoint_to_resume(config)
        if self.resumed_from is not None:
            saved_at = read_meta(self.resumed_from)["step"]
            # the schedule's rate there: named only if it changed
            schedule.apply(self.param_groups(), config.optim, config.train.steps, max(saved_at - 1, 0))
            self.start_step = load_checkpoint(self.engine, self.resumed_from)["step"]  # this run's settings win
        self.engine.comm.ledger.reset()  # what follows is training; the initial broadcast and loading are not
        self.init_peak_memory = self.memory.peak()
        self.step_peak_memory = self.last_step_peak_memory = 0
        self.qgz_residual_bytes = 0  # the most qgZ's error-feedback residuals held on this rank
        # the tensor- and context-parallel ranks of one reader read the same rows (Layout.reader)
        reader, readers = self.topology.layout.reader(self.topology.rank)
        args = (self.source.block_size, config.train.micro_batch_size, readers, reader, config.train.seed)
        self.train_batches = Batches("train", *args, tokens=None if text is None else text[0])
        self.val_batches = Batches("val", *args, tokens=None if text is None else text[1])
        self.flops_per_token = flops_per_token(
            self.engine.param_count, self.source.n_layer, self.source.d_model, self.source.block_size
        )
        self.peak_flops = peak_flops(self.topology.device)

    def optimizer(self, model: nn.Module) -> tuple[Any, dict[str, Any] | None]:
        """optim.optimizer for ZeroEngine: a class and its settings, or for muon Muon over the blocks'
        matrices (its lr matched to AdamW's RMS, so one schedule drives both) and AdamW over the rest."""
        name = self.config.optim.optimizer
        if name in LOW_BIT:
            return low_bit_adamw(name), {k: v for k, v in self.hyperparameters("adamw").items() if k != "fused"}
        if name in ("adamw", "adam") and not self.config.optim.bias_correction:  # DeepSpeed's bias_correction false
            hyper = {k: v for k, v in self.hyperparameters().items() if k != "fused"}
            return UncorrectedAdam, {**hyper, "decoupled": name == "adamw"}
        if name != "muon":
            return OPTIMIZERS[name], self.hyperparameters()
        blocks = {id(p) for block in repeated_blocks(model) for p in block.parameters() if p.dim() == 2}
        named = [p for p in model.parameters() if p.requires_grad]
        hidden, rest = [p for p in named if id(p) in blocks], [p for p in named if id(p) not in blocks]
        optim = self.config.optim
        muon = torch.optim.Muon(hidden, lr=optim.lr, weight_decay=optim.weight_decay, adjust_lr_fn="match_rms_adamw")
        return [muon, torch.optim.AdamW(rest, **self.hyperparameters("adamw"))], None

    def param_groups(self) -> list[dict[str, Any]]:
        return [group for optimizer in self.engine.optimizers for group in optimizer.param_groups]

    def hyperparameters(self, name: str | None = None) -> dict[str, Any]:
        """The optimizer's settings; where it steps on the host, its fused kernel, several times faster
        than foreach and without shard-sized temporaries (zeropp bench optimizer)."""
        optim, zero = self.config.optim, self.config.zero
        name = name or optim.optimizer
        if name == "adafactor":  # torch's defaults beside the rate and decay (its betas and eps are its own)
            return dict(lr=optim.lr, weight_decay=optim.weight_decay)
        on_host = self.topology.device.type == "cpu" or zero.offload.optimizer == "cpu"
        own = dict(momentum=optim.momentum) if name == "sgd" else dict(betas=(optim.beta1, optim.beta2), eps=optim.eps)
        return dict(lr=optim.lr, **own, weight_decay=optim.weight_decay, fused=on_host)

    def say(self, text: str) -> None:
        """One line on rank 0."""
        if self.topology.rank == 0:
            print(text, flush=True)

    def save(self, steps_done: int) -> None:
        c = self.config.checkpoint
        extra = {"config": self.config.to_dict(), **self.source.checkpoint_extra}
        tick = time.perf_counter()
        with self.engine.comm.ledger.in_phase("other"):
            path = save_checkpoint(
                self.engine,
                c.checkpoint_dir,
                steps_done,
                extra=extra,
                keep_last=c.keep_last,
                frozen_base=self.frozen_base,
            )
        seconds = time.perf_counter() - tick
        size = sum(f.stat().st_size for f in path.iterdir())
        self.checkpoints.append(CheckpointRecord(steps_done, str(path), size, seconds))
        self.say(f"checkpoint of step {steps_done} published: {path} ({size / 2**20:,.1f} MiB, {seconds:.1f} s)")

    def saves_after(self, steps_done: int) -> bool:
        """With a checkpoint folder: save every save_interval steps and after the last step."""
        c = self.config.checkpoint
        if c.checkpoint_dir is None:
            return False
        return steps_done == self.config.train.steps or bool(c.save_interval and steps_done % c.save_interval == 0)

    def check_step(self, steps_done: int, loss: float) -> None:
        """Stop on a non-finite loss or gradient norm (before the step can be saved); count fp16's
        skipped steps and stop after train.max_consecutive_skipped_steps in a row."""
        engine = self.engine
        if engine.last_step_skipped:
            self.skipped_steps += 1
            self.skipped_in_a_row += 1
            limit = self.config.train.max_consecutive_skipped_steps
            if self.skipped_in_a_row >= limit:
                raise TrainingStopped(
                    f"step {steps_done}: {limit} optimizer steps in a row skipped for overflowing fp16 gradients "
                    f"(loss scale now {engine.scaler.scale:g}; train.max_consecutive_skipped_steps = {limit})"
                )
            return
        self.skipped_in_a_row = 0
        hint = "lower --lr" + (" or set --max-grad-norm" if self.config.zero.max_grad_norm is None else "")
        saved = "; no checkpoint of this step was written" if self.config.checkpoint.checkpoint_dir else ""
        for what, value in (("loss", loss), ("gradient norm", engine.last_grad_norm)):
            if value is not None and not math.isfinite(value):
                raise TrainingStopped(f"step {steps_done}: the {what} is {value}, training diverged ({hint}){saved}")

    @property
    def quantized_gradient_steps(self) -> int:
        """Steps that reduce gradients with qgZ (zero.qgz.until of the run, flat: quantized_gradients_until), from step 0."""
        return math.ceil(self.config.zero.qgz.until * self.config.train.steps)

    @property
    def error_feedback(self) -> bool:
        return self.config.zero.stage == 3 and self.config.zero.qgz.feedback

    @property
    def residuals_freed_at_step(self) -> int | None:
        """The step (1-based) from which qgZ is off and its error-feedback residuals are freed; None
        when error feedback is off or qgZ stays on to the end."""
        until = self.quantized_gradient_steps
        return until + 1 if self.error_feedback and until < self.config.train.steps else None

    @property
    def tokens_per_step(self) -> int:
        t = self.config.train
        return (
            t.micro_batch_size
            * self.source.block_size
            * self.config.zero.gradient_accumulation_steps
            * self.topology.layout.reader(self.topology.rank)[1]
        )

    def train_step(self, step: int) -> float:
        self.memory.reset_peak()
        loss = self._train_step(step)
        self.last_step_peak_memory = self.memory.peak()
        self.step_peak_memory = max(self.step_peak_memory, self.last_step_peak_memory)
        self.qgz_residual_bytes = max(self.qgz_residual_bytes, self.engine.qgz_residual_bytes())
        return loss

    def _train_step(self, step: int) -> float:
        schedule.apply(self.param_groups(), self.config.optim, self.config.train.steps, step)
        self.engine.set_quantized_gradients(step < self.quantized_gradient_steps)
        losses = []
        for micro in range(self.config.zero.gradient_accumulation_steps):
            loss = self.loss(self.train_batches.local_batch(step, micro))
            self.engine.backward(loss)
            losses.append(loss.detach().float())
        self.engine.step()
        return self.mean_over_ranks(torch.stack(losses).mean())

    @torch.no_grad()
    def evaluate(self) -> float:
        self.engine.eval()
        losses = [self.loss(self.val_batches.local_batch(i)).float() for i in range(self.config.train.eval_batches)]
        self.engine.train()
        return self.mean_over_ranks(torch.stack(losses).mean())

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The loss on this rank's rows, or its slice of them (equal slices: their mean is the sequences';
        the model's context-parallel hook gives the slice its positions)."""
        x, y = (t.to(self.topology.device) for t in batch)
        return self.source.loss(self.engine, *split_sequence(self.topology, x, y), None)

    def mean_over_ranks(self, value: torch.Tensor) -> float:
        with self.engine.comm.ledger.in_phase("other"):
            self.engine.comm.all_reduce(value, self.topology.world)
        return float(value.item())

    def per_rank(self, values: list[float]) -> list[list[float]]:
        """Every rank's `values`, gathered to every rank (rows by rank)."""
        local = torch.tensor(values, dtype=torch.float64, device=self.topology.device)
        out = torch.empty(self.topology.world_size * len(values), dtype=torch.float64, device=self.topology.device)
        with self.engine.comm.ledger.in_phase("other"):
            self.engine.comm.all_gather(out, local, self.topology.world, bucket_numel=out.numel())
        return out.view(self.topology.world_size, len(values)).tolist()

    def run(
        self, progress: Callable[[StepMetrics, int], None] | None = None, log: MetricsLog | None = None
    ) -> RunSummary | None:
        """Train from start_step to train.steps, handing every step's metrics to `log` and to
        progress(metrics, skipped steps so far); None (and a line on rank 0) when nothing is left."""
        steps = self.config.train.steps
        if self.start_step >= steps:
            self.say(f"checkpoint already at step {self.start_step} (>= --steps {steps}): nothing to train")
            return None
        log = log or MetricsLog()
        train_loss = val_loss = float("nan")
        self.step_times, self.losses = [], []
        for step in range(self.start_step, steps):
            tick = time.perf_counter()
            train_loss = self.train_step(step)
            self.step_times.append(time.perf_counter() - tick)
            self.losses.append(train_loss)
            self.check_step(step + 1, train_loss)
            measured = None
            if (step + 1) % self.config.train.eval_interval == 0 or step + 1 == steps:
                measured = val_loss = self.evaluate()
            if self.saves_after(step + 1):
                self.save(step + 1)
            metrics = self.step_metrics(step, train_loss, measured)
            log.add(metrics)
            if progress is not None:
                progress(metrics, self.skipped_steps)
        return self.summary(train_loss, val_loss, log)

    def step_metrics(self, step: int, loss: float, val_loss: float | None) -> StepMetrics:
        """What step `step` (0-based) measured; tokens/s from its own wall time."""
        seconds = max(self.step_times[-1], 1e-9)
        tokens_per_s = self.tokens_per_step / seconds
        per_rank = tokens_per_s / self.topology.world_size
        return StepMetrics(
            step=step + 1,
            loss=loss,
            val_loss=val_loss,
            grad_norm=None if self.engine.last_step_skipped else self.engine.last_grad_norm,
            lr=schedule.learning_rate(self.config.optim, self.config.train.steps, step),
            step_time_s=seconds,
            tokens_per_s=tokens_per_s,
            tokens_per_s_per_rank=per_rank,
            mfu=self.mfu(per_rank),
            peak_memory_bytes=self.last_step_peak_memory,
        )

    def mfu(self, tokens_per_s_per_rank: float) -> float | None:
        """Model FLOPs utilization (zeropp.app.metrics); None where the device's peak is unknown."""
        if self.peak_flops is None:
            return None
        return self.flops_per_token * tokens_per_s_per_rank / self.peak_flops

    def gathered_ledger(self) -> tuple[list[RankRecord], dict[str, dict[str, dict[str, float]]]]:
        """Every rank's :class:`RankRecord`, and the ledger's bytes per step as the mean over ranks
        ({op: {phase: {link}}}, nonzero entries)."""
        engine, topo = self.engine, self.topology
        ledger = engine.comm.ledger
        steps = max(1, ledger.steps)
        step_bytes = {
            link: sum(ledger.total(phase=p, link=link) for p in STEP_PHASES) / steps for link in ("intra", "inter")
        }
        entries = [(o, p, k) for o in LEDGER_OPS for p in STEP_PHASES for k in ("intra", "inter")]  # same on every rank
        record = RankRecord(
            engine.measured_model_state_bytes,
            peak_memory_bytes(topo.device),
            step_bytes["intra"],
            step_bytes["inter"],
            self.init_peak_memory,
            self.step_peak_memory,
            *(nbytes / steps for nbytes in io_bytes(engine.disk, engine.param_disk)),
        )
        fields = len(dataclasses.fields(RankRecord))
        rows = self.per_rank(
            [*dataclasses.astuple(record), *(ledger.total(op=o, phase=p, link=k) / steps for o, p, k in entries)]
        )
        mean_ledger: dict[str, dict[str, dict[str, float]]] = {}
        for i, (o, p, k) in enumerate(entries):
            value = sum(r[fields + i] for r in rows) / len(rows)
            if value:
                mean_ledger.setdefault(o, {}).setdefault(p, {"intra": 0.0, "inter": 0.0})[k] = value
        return [RankRecord(*r[:fields]) for r in rows], mean_ledger

    def summary(self, train_loss: float, val_loss: float, log: MetricsLog) -> RunSummary:
        engine, topo = self.engine, self.topology
        tokens_per_s = self.tokens_per_step * len(self.step_times) / max(sum(self.step_times), 1e-9)
        rows, mean_ledger = self.gathered_ledger()
        n = len(rows)
        zero = self.config.zero
        trained, frozen_numel = flat_numels(engine.units, engine.module)
        split = engine.expert_groups is not engine.groups  # experts sharded over the ranks holding them
        experts = sum(u.layout.padded_numel for u in engine.units if split and u.module in engine.expert_units)
        states = functools.partial(  # the model-state formula's settings, the same for dense units and experts
            analytic_model_state_bytes, stage=zero.stage, precision=zero.precision, grad_dtype=zero.grad_dtype,
            optimizer_bytes=4 if zero.optimizer_state_dtype == "bf16" else 8, master_dtype=zero.master_dtype,
            offload_optimizer=zero.offload.optimizer != "none", offload_params=zero.offload.params != "none",
            optimizer_on_disk=zero.offload.optimizer == "nvme", params_on_disk=zero.offload.params == "nvme",
            where="memory",  # what the measurement sees: a disk tier's files are not memory
        )  # fmt: skip
        dp = topo.layout.data_parallel_layout()  # ZeRO-3 shards over the data-parallel ranks
        stored = engine.last_activation_checkpoints
        frozen = [u.frozen.layout.padded_numel for u in engine.units if u.frozen is not None and not u.resident]
        zero3 = zero3_step_bytes(zero3_units((u.layout for u in engine.units), dp, zero), dp, zero, frozen)
        return RunSummary(
            final_train_loss=train_loss,
            final_val_loss=val_loss,
            tokens_per_s=tokens_per_s,
            median_step_time_s=statistics.median(self.step_times[1:] or self.step_times or [0.0]),
            mean_step_time_s=statistics.fmean(self.step_times[1:] or self.step_times or [0.0]),
            world_size=topo.world_size,
            nodes=topo.nodes,
            stage=zero.stage,
            precision=zero.precision,
            steps=self.config.train.steps,
            start_step=self.start_step,
            resumed_from=None if self.resumed_from is None else str(self.resumed_from),
            train_losses=self.losses,
            param_count=engine.param_count,
            model_state_bytes_per_rank=[int(r.model_state_bytes) for r in rows],
            analytic_model_state_bytes_per_rank=states(
                trained - experts,  # this rank's tensor-parallel share as laid out, over its data-parallel group
                engine.groups.shard.size,  # one node's data-parallel ranks under DiLoCo
                hpz_group_size=engine.hpz_group_size,
                qwd_reference=zero.qwz.delta,
                # at the last step, whose model-state bytes were measured: none once the schedule freed them
                qgz_residuals=(topo.ranks_per_node, topo.nodes, zero.qgz.intra_node_quantized)
                if self.error_feedback and self.residuals_freed_at_step is None
                else None,
                frozen=frozen_numel,
                frozen_quant=frozen_quant(zero),
                outer=(zero.outer, topo.nodes, [u.master.numel() for u in engine.units])
                if engine.outer is not None
                else None,
            )
            + states(experts, engine.expert_groups.shard.size, hpz_group_size=engine.expert_groups.hpz_group_size),
            qgz_residual_bytes_per_rank=self.qgz_residual_bytes,
            qgz_residuals_freed_at_step=self.residuals_freed_at_step,
            peak_memory_bytes_per_rank=[int(r.peak_memory_bytes) for r in rows],
            intra_node_bytes_per_step=sum(r.intra_node_bytes_per_step for r in rows) / n,
            inter_node_bytes_per_step=sum(r.inter_node_bytes_per_step for r in rows) / n,
            intra_node_bytes_per_step_by_rank=[r.intra_node_bytes_per_step for r in rows],
            inter_node_bytes_per_step_by_rank=[r.inter_node_bytes_per_step for r in rows],
            zero3_intra_node_bytes_per_step=sum(zero3[p]["intra"] for p in STEP_PHASES),
            zero3_inter_node_bytes_per_step=sum(zero3[p]["inter"] for p in STEP_PHASES),
            tensor_parallel_size=topo.tensor_parallel.size,
            sequence_parallel=topo.sequence_parallel,
            tensor_parallel_bytes_per_step=bytes_under(mean_ledger, "tp"),
            context_parallel_size=topo.context_parallel.size,
            context_parallel_bytes_per_step=bytes_under(mean_ledger, "cp"),
            activation_checkpoint_bytes_per_rank=stored.device_peak_bytes if stored else 0,
            activation_checkpoint_host_bytes_per_rank=stored.host_peak_bytes if stored else 0,
            zeropp=ZeroppSwitches(zero.qwz.enabled, engine.hpz_group_size, zero.qgz.enabled),
            ledger=mean_ledger,
            config=self.config.to_dict(),
            skipped_steps=self.skipped_steps,
            checkpoints=self.checkpoints,
            init_peak_memory_bytes_per_rank=[int(r.init_peak_memory_bytes) for r in rows],
            step_peak_memory_bytes_per_rank=[int(r.step_peak_memory_bytes) for r in rows],
            disk_bytes_per_step_per_rank=[(r.disk_read_bytes_per_step, r.disk_written_bytes_per_step) for r in rows],
            tokens_per_s_per_rank=tokens_per_s / topo.world_size,
            flops_per_token=self.flops_per_token,
            mfu=self.mfu(tokens_per_s / topo.world_size),
            val_losses=log.val,
            model=self.source.name,
        )


def write_summary(summary: RunSummary, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(summary.to_json())
