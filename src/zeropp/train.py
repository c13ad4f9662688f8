"""The main job: train the embedded GPT on the embedded corpus under any stage, report a summary.

Runs inside each rank (``zeropp train`` starts the ranks through torch.distributed.run).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from zeropp.checkpoint import (
    CheckpointError,
    check_writable,
    find_latest,
    load_checkpoint,
    read_meta,
    save_checkpoint,
    verify_files,
)
from zeropp.comm.volume import STEP_PHASES, zero3_step_bytes, zero3_units
from zeropp.config import Config
from zeropp.data import Batches
from zeropp.engine import ZeroEngine
from zeropp.memory import PeakMeter, analytic_model_state_bytes, peak_memory_bytes
from zeropp.models.gpt import GPT, gpt_config
from zeropp.pretrained import load_pretrained
from zeropp.summary import CheckpointRecord, RunSummary, ZeroppSwitches
from zeropp.tensor_parallel import parallelize
from zeropp.topology import init_topology

COLLECTIVES = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce", "broadcast")
LEDGER_OPS = (*COLLECTIVES, *(f"tp.{op}" for op in COLLECTIVES))  # tp.*: on the tensor-parallel group


def learning_rate(config: Config, step: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    peak, warmup, total = config.optim.lr, config.optim.warmup_steps, config.train.steps
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def checkpoint_to_resume(config: Config) -> Path | None:
    """The checkpoint to start from: checkpoint.resume's path, the latest one for 'auto', or none.

    Refuses a missing or damaged checkpoint, or one saved with another model config (a different
    n_head, say, can hold tensors of the same shapes).
    """
    resume = config.checkpoint.resume
    if resume is None:
        return None
    path = Path(resume) if resume != "auto" else find_latest(config.checkpoint.checkpoint_dir)
    if path is None:
        return None
    saved = read_meta(path)["extra"].get("config", {}).get("model", {})
    ours = dataclasses.asdict(config.model)
    for key in sorted(ours):
        if saved.get(key) != ours[key]:
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


class TrainingStopped(RuntimeError):
    """The run cannot go on (a non-finite loss or gradient norm, too many skipped fp16 steps). One line."""


class Trainer:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.topology = init_topology(config.topology)
        self.memory = PeakMeter(self.topology.device)  # from before the model exists
        torch.manual_seed(config.train.seed)
        self.gpt = gpt_config(config.model)
        meta = config.train.init == "meta" and self.topology.tensor_parallel.size == 1  # tp: built on the host
        with torch.device("meta") if meta else contextlib.nullcontext():
            model = parallelize(GPT(self.gpt), self.topology)
        self.engine = ZeroEngine(
            model, torch.optim.AdamW, self.hyperparameters(), config.zero, self.topology, seed=config.train.seed
        )
        if config.train.init_from is not None:
            load_pretrained(self.engine, config.train.init_from)
        self.start_step = 0
        self.skipped_steps = self.skipped_in_a_row = 0
        self.checkpoints: list[CheckpointRecord] = []
        self.resumed_from = checkpoint_to_resume(config)
        if self.resumed_from is not None:
            meta = load_checkpoint(self.engine, self.resumed_from)
            self.start_step = meta["step"]
            self.keep_run_hyperparameters()
        self.engine.comm.ledger.reset()  # what follows is training; the initial broadcast and loading are not
        self.init_peak_memory = self.memory.peak()
        self.step_peak_memory = 0
        dp = self.topology.data_parallel  # the tensor-parallel ranks of one data-parallel rank read the same rows
        args = (self.gpt.block_size, config.train.micro_batch_size, dp.size, dp.rank, config.train.seed)
        self.train_batches = Batches("train", *args)
        self.val_batches = Batches("val", *args)

    def hyperparameters(self) -> dict[str, Any]:
        """AdamW's settings; where it steps on the host, its fused kernel, several times faster than
        foreach and without shard-sized temporaries (zeropp bench optimizer)."""
        optim, zero = self.config.optim, self.config.zero
        on_host = self.topology.device.type == "cpu" or zero.offload_optimizer == "cpu"
        betas = (optim.beta1, optim.beta2)
        return dict(lr=optim.lr, betas=betas, weight_decay=optim.weight_decay, fused=on_host)

    def keep_run_hyperparameters(self) -> None:
        """After a resume the run's own optim config wins over the checkpoint's (lr follows the
        schedule every step anyway); say which saved values it replaces."""
        ours = {k: v for k, v in self.hyperparameters().items() if k != "lr"}
        group = self.engine.optimizer.param_groups[0]
        changed = [f"{k} = {v!r} (the checkpoint has {group[k]!r})" for k, v in ours.items() if group[k] != v]
        for group in self.engine.optimizer.param_groups:
            group.update(ours)
        if changed:
            self.say(f"resuming with this run's {', '.join(changed)}")

    def say(self, text: str) -> None:
        """One line on rank 0."""
        if self.topology.rank == 0:
            print(text, flush=True)

    def save(self, steps_done: int) -> None:
        c = self.config.checkpoint
        extra = {"config": self.config.to_dict()}
        tick = time.perf_counter()
        with self.engine.comm.ledger.in_phase("other"):
            path = save_checkpoint(self.engine, c.checkpoint_dir, steps_done, extra=extra, keep_last=c.keep_last)
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
    def tokens_per_step(self) -> int:
        t = self.config.train
        return (
            t.micro_batch_size
            * self.gpt.block_size
            * self.config.zero.gradient_accumulation_steps
            * self.topology.data_parallel.size
        )

    def train_step(self, step: int) -> float:
        self.memory.reset_peak()
        loss = self._train_step(step)
        self.step_peak_memory = max(self.step_peak_memory, self.memory.peak())
        return loss

    def _train_step(self, step: int) -> float:
        for group in self.engine.optimizer.param_groups:
            group["lr"] = learning_rate(self.config, step)
        losses = []
        for micro in range(self.config.zero.gradient_accumulation_steps):
            x, y = (t.to(self.topology.device) for t in self.train_batches.local_batch(step, micro))
            loss = self.engine(x, y)
            self.engine.backward(loss)
            losses.append(loss.detach().float())
        self.engine.step()
        return self.mean_over_ranks(torch.stack(losses).mean())

    @torch.no_grad()
    def evaluate(self) -> float:
        self.engine.eval()
        losses = []
        for i in range(self.config.train.eval_batches):
            x, y = (t.to(self.topology.device) for t in self.val_batches.local_batch(i))
            losses.append(self.engine(x, y).float())
        self.engine.train()
        return self.mean_over_ranks(torch.stack(losses).mean())

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

    def run(self, progress: Any = None) -> RunSummary | None:
        """Train from start_step to train.steps; None (and a line on rank 0) when nothing is left."""
        steps = self.config.train.steps
        if self.start_step >= steps:
            self.say(f"checkpoint already at step {self.start_step} (>= --steps {steps}): nothing to train")
            return None
        train_loss = float("nan")
        val_loss = float("nan")
        self.step_times, self.losses = [], []
        for step in range(self.start_step, steps):
            tick = time.perf_counter()
            train_loss = self.train_step(step)
            self.step_times.append(time.perf_counter() - tick)
            self.losses.append(train_loss)
            self.check_step(step + 1, train_loss)
            if (step + 1) % self.config.train.eval_interval == 0 and step + 1 < steps:
                val_loss = self.evaluate()
            if self.saves_after(step + 1):
                self.save(step + 1)
            if progress is not None:
                tokens_per_s = self.tokens_per_step * len(self.step_times) / sum(self.step_times)
                progress(step + 1, train_loss, val_loss, tokens_per_s, skipped=self.skipped_steps)
        val_loss = self.evaluate()
        tokens_per_s = self.tokens_per_step * len(self.step_times) / max(sum(self.step_times), 1e-9)
        if progress is not None:  # the bar ends on the summary's validation loss
            progress(steps, train_loss, val_loss, tokens_per_s)
        return self.summary(train_loss, val_loss, tokens_per_s)

    def gathered_ledger(self) -> tuple[list[list[float]], dict[str, dict[str, dict[str, float]]]]:
        """Every rank's row [model-state bytes, peak memory, intra, inter bytes per step, init peak, step
        peak], and the ledger's bytes per step as the mean over ranks ({op: {phase: {link}}}, nonzero entries)."""
        engine, topo = self.engine, self.topology
        ledger = engine.comm.ledger
        steps = max(1, ledger.steps)
        step_bytes = {
            link: sum(ledger.total(phase=p, link=link) for p in STEP_PHASES) / steps for link in ("intra", "inter")
        }
        ops = LEDGER_OPS  # the same list on every rank: the all-gather below must match in size
        flat_ledger = [
            ledger.total(op=o, phase=p, link=k) / steps for o in ops for p in STEP_PHASES for k in ("intra", "inter")
        ]
        rows = self.per_rank(
            [
                engine.measured_model_state_bytes,
                peak_memory_bytes(topo.device),
                step_bytes["intra"],
                step_bytes["inter"],
                self.init_peak_memory,
                self.step_peak_memory,
                *flat_ledger,
            ]
        )
        n = len(rows)
        mean_ledger: dict[str, dict[str, dict[str, float]]] = {}
        for i, (o, p, k) in enumerate((o, p, k) for o in ops for p in STEP_PHASES for k in ("intra", "inter")):
            value = sum(r[6 + i] for r in rows) / n
            if value:
                mean_ledger.setdefault(o, {}).setdefault(p, {"intra": 0.0, "inter": 0.0})[k] = value
        return [r[:6] for r in rows], mean_ledger

    def summary(self, train_loss: float, val_loss: float, tokens_per_s: float) -> RunSummary:
        engine, topo = self.engine, self.topology
        rows, mean_ledger = self.gathered_ledger()
        n = len(rows)
        zero = self.config.zero
        dp = topo.layout.data_parallel_layout()  # ZeRO-3 shards over the data-parallel ranks
        zero3 = zero3_step_bytes(zero3_units((u.layout for u in engine.units), dp, zero), dp, zero)
        return RunSummary(
            final_train_loss=train_loss,
            final_val_loss=val_loss,
            tokens_per_s=tokens_per_s,
            median_step_time_s=statistics.median(self.step_times[1:] or self.step_times or [0.0]),
            world_size=topo.world_size,
            nodes=topo.nodes,
            stage=zero.stage,
            precision=zero.precision,
            steps=self.config.train.steps,
            start_step=self.start_step,
            resumed_from=None if self.resumed_from is None else str(self.resumed_from),
            train_losses=self.losses,
            param_count=engine.param_count,
            model_state_bytes_per_rank=[int(r[0]) for r in rows],
            analytic_model_state_bytes_per_rank=analytic_model_state_bytes(
                engine.param_count,  # this rank's tensor-parallel share, sharded over its data-parallel group
                topo.data_parallel.size,
                zero.stage,
                zero.precision,
                zero.grad_dtype,
                hpz_group_size=engine.hpz_group_size,
                offload_optimizer=zero.offload_optimizer != "none",
                offload_params=zero.offload_params != "none",
            ),
            peak_memory_bytes_per_rank=[int(r[1]) for r in rows],
            intra_node_bytes_per_step=sum(r[2] for r in rows) / n,
            inter_node_bytes_per_step=sum(r[3] for r in rows) / n,
            intra_node_bytes_per_step_by_rank=[r[2] for r in rows],
            inter_node_bytes_per_step_by_rank=[r[3] for r in rows],
            zero3_intra_node_bytes_per_step=sum(zero3[p]["intra"] for p in STEP_PHASES),
            zero3_inter_node_bytes_per_step=sum(zero3[p]["inter"] for p in STEP_PHASES),
            tensor_parallel_size=topo.tensor_parallel.size,
            tensor_parallel_bytes_per_step=sum(
                sum(links.values()) for op, phases in mean_ledger.items() if op.startswith("tp.") for links in phases.values()
            ),
            zeropp=ZeroppSwitches(zero.quantized_weights, engine.hpz_group_size, zero.quantized_gradients),
            ledger=mean_ledger,
            config=self.config.to_dict(),
            skipped_steps=self.skipped_steps,
            checkpoints=self.checkpoints,
            init_peak_memory_bytes_per_rank=[int(r[4]) for r in rows],
            step_peak_memory_bytes_per_rank=[int(r[5]) for r in rows],
        )


def write_summary(summary: RunSummary, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(summary.to_json())
