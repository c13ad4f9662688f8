"""What the main job shows: a progress bar while training and a summary table at the end."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from zeropp.app.metrics import StepMetrics
from zeropp.app.summary import RunSummary
from zeropp.config.rates import si

console = Console()


@contextlib.contextmanager
def progress_bar(total: int, enabled: bool) -> Iterator[Callable[[StepMetrics, int], None] | None]:
    """Yield update(metrics, skipped), or None where disabled (ranks > 0).

    Shows the loss, the validation loss once one was measured (the latest), tokens/s of all ranks
    together and per rank, MFU where known, and `skipped` (fp16 steps skipped so far) once there is
    one. Where the output is not a terminal, a line is printed every tenth of the run (and for the
    last step)."""
    if not enabled:
        yield None
        return
    line = _ProgressText()
    if not console.is_terminal:
        every = max(1, total // 10)

        def print_line(metrics: StepMetrics, skipped: int = 0) -> None:
            text = line(metrics, skipped)
            if metrics.step % every == 0 or metrics.step >= total:
                console.print(f"step {metrics.step}/{total}  {text}", highlight=False)

        yield print_line
        return
    columns = [
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[text]}"),
        TimeRemainingColumn(),
    ]
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("train", total=total, text="")

        def update(metrics: StepMetrics, skipped: int = 0) -> None:
            progress.update(task, completed=metrics.step, text=line(metrics, skipped))

        yield update


class _ProgressText:
    """The progress text of a step; remembers the latest validation loss."""

    def __init__(self) -> None:
        self.val: float | None = None

    def __call__(self, m: StepMetrics, skipped: int = 0) -> str:
        self.val = m.val_loss if m.val_loss is not None else self.val
        parts = [f"loss {m.loss:.4f}"]
        if self.val is not None:
            parts.append(f"val {self.val:.4f}")
        parts.append(f"{m.tokens_per_s:,.0f} tok/s all ranks ({m.tokens_per_s_per_rank:,.0f} per rank)")
        if m.mfu is not None:
            parts.append(f"MFU {m.mfu:.1%}")
        if skipped:
            parts.append(f"{skipped} skipped")
        return "  ".join(parts)


def print_summary(summary: RunSummary) -> None:
    head = Table(title="zeropp train: summary", show_header=False)
    head.add_row("model", summary.model)
    head.add_row("stage / precision", f"{summary.stage} / {summary.precision}")
    switches = summary.zeropp
    on = [name for name, flag in (("qwZ", switches.quantized_weights), ("qgZ", switches.quantized_gradients)) if flag]
    if switches.hpz_group_size > 1:
        on.append(f"hpZ (groups of {switches.hpz_group_size})")
    head.add_row("ZeRO++", ", ".join(on) or "off")
    head.add_row("world / nodes", f"{summary.world_size} ranks on {summary.nodes} node(s)")
    if summary.tensor_parallel_size > 1:
        head.add_row(
            "tensor parallel",
            f"{summary.tensor_parallel_size} ranks per group"
            + (", sequence parallel" if summary.sequence_parallel else "")
            + f", {si(summary.tensor_parallel_bytes_per_step)}/step per rank",
        )
    zero = summary.config.get("zero", {})  # the grouped key, or the flat one of summaries written before the policies
    if zero.get("activations", {}).get("enabled") or zero.get("activation_checkpointing"):
        head.add_row(
            "activation checkpoints per rank",
            f"device {si(summary.activation_checkpoint_bytes_per_rank)}, "
            f"host {si(summary.activation_checkpoint_host_bytes_per_rank)} (peak of the last step)",
        )
    head.add_row("parameters", f"{summary.param_count:,}")
    head.add_row("final train / val loss", f"{summary.final_train_loss:.4f} / {summary.final_val_loss:.4f}")
    head.add_row("tokens/s all ranks / per rank", f"{summary.tokens_per_s:,.0f} / {summary.tokens_per_s_per_rank:,.0f}")
    mfu = "unknown (no peak FLOPS for this device)" if summary.mfu is None else f"{summary.mfu:.1%}"
    head.add_row("MFU (6N + 12LdT FLOPs/token)", mfu)
    analytic = summary.analytic_model_state_bytes_per_rank
    measured = ", ".join(si(b) for b in summary.model_state_bytes_per_rank)
    on_disk = any(any(io) for io in summary.disk_bytes_per_step_per_rank)
    aside = " (in memory: the disk tiers' files aside)" if on_disk else ""
    head.add_row("model states per rank", f"measured {measured}; analytic {si(analytic)}{aside}")
    if on_disk:
        read, written = summary.disk_bytes_per_step_per_rank[0]
        head.add_row("disk tiers per step", f"read {si(read)}, written {si(written)} (rank 0)")
    head.add_row("peak memory per rank", ", ".join(si(b) for b in summary.peak_memory_bytes_per_rank))
    init, step = summary.init_peak_memory_bytes_per_rank, summary.step_peak_memory_bytes_per_rank
    head.add_row(
        "peak above start: init / steps", ", ".join(f"{si(a)} / {si(b)}" for a, b in zip(init, step, strict=True))
    )
    head.add_row(
        "sent per rank per step",
        f"intra-node {si(summary.intra_node_bytes_per_step)}, inter-node {si(summary.inter_node_bytes_per_step)}",
    )
    inter, zero3 = summary.inter_node_bytes_per_step, summary.zero3_inter_node_bytes_per_step
    if zero3:
        head.add_row("inter-node vs ZeRO-3", f"{si(inter)} vs {si(zero3)} ({inter / zero3:.2f}x)")
    if summary.skipped_steps or summary.precision == "fp16":
        head.add_row(
            "skipped steps (fp16 overflow)", f"{summary.skipped_steps} of {summary.steps - summary.start_step}"
        )
    if summary.checkpoints:
        last = summary.checkpoints[-1]
        head.add_row(
            "checkpoints",
            f"{len(summary.checkpoints)} published; last: step {last.step}, {last.path} ({si(last.bytes)})",
        )
    console.print(head)

    ledger = Table(title="ledger: bytes sent per rank per step (mean over ranks)")
    for column in ("collective", "phase", "intra-node", "inter-node"):
        ledger.add_column(column, justify="right" if "node" in column else "left")
    for op, phases in summary.ledger.items():
        for phase, links in phases.items():
            ledger.add_row(op, phase, si(links["intra"]), si(links["inter"]))
    console.print(ledger)
