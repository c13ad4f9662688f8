"""What the main job shows: a progress bar while training and a summary table at the end."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from zeropp.rates import si
from zeropp.summary import RunSummary

console = Console()


@contextlib.contextmanager
def progress_bar(total: int, enabled: bool) -> Iterator[Callable[..., None] | None]:
    """Yield update(step, train_loss, val_loss, tokens_per_s, skipped=0), or None where disabled (ranks > 0).

    tokens_per_s counts every rank's tokens; val_loss is NaN until the first evaluation; `skipped`:
    fp16 steps skipped so far, shown once there is one. Where the output is not a terminal, a line is
    printed every tenth of the run (and for the last update)."""
    if not enabled:
        yield None
        return
    if not console.is_terminal:
        yield _progress_lines(total)
        return
    columns = [
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[text]}"),
        TimeRemainingColumn(),
    ]
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("train", total=total, text=_progress_text(float("nan"), float("nan"), 0.0))

        def update(step: int, loss: float, val: float, tokens_per_s: float, skipped: int = 0) -> None:
            progress.update(task, completed=step, text=_progress_text(loss, val, tokens_per_s, skipped))

        yield update


def _progress_text(loss: float, val: float, tokens_per_s: float, skipped: int = 0) -> str:
    val_text = "-" if math.isnan(val) else f"{val:.4f}"
    note = f"  {skipped} skipped" if skipped else ""
    return f"loss {loss:.4f}  val {val_text}  {tokens_per_s:,.0f} tok/s (all ranks){note}"


def _progress_lines(total: int) -> Callable[..., None]:
    every = max(1, total // 10)

    def update(step: int, loss: float, val: float, tokens_per_s: float, skipped: int = 0) -> None:
        if step % every == 0 or step >= total:
            text = _progress_text(loss, val, tokens_per_s, skipped)
            console.print(f"step {step}/{total}  {text}", highlight=False)

    return update


def print_summary(summary: RunSummary) -> None:
    head = Table(title="zeropp train: summary", show_header=False)
    head.add_row("stage / precision", f"{summary.stage} / {summary.precision}")
    switches = summary.zeropp
    on = [
        name
        for name, flag in (("qwZ", switches.quantized_weights), ("qgZ", switches.quantized_gradients))
        if flag
    ]
    if switches.hpz_group_size > 1:
        on.append(f"hpZ (groups of {switches.hpz_group_size})")
    head.add_row("ZeRO++", ", ".join(on) or "off")
    head.add_row("world / nodes", f"{summary.world_size} ranks on {summary.nodes} node(s)")
    if summary.tensor_parallel_size > 1:
        head.add_row(
            "tensor parallel",
            f"{summary.tensor_parallel_size} ranks per group, {si(summary.tensor_parallel_bytes_per_step)}/step per rank",
        )
    head.add_row("parameters", f"{summary.param_count:,}")
    head.add_row("final train / val loss", f"{summary.final_train_loss:.4f} / {summary.final_val_loss:.4f}")
    head.add_row("tokens/s (all ranks)", f"{summary.tokens_per_s:,.0f}")
    analytic = summary.analytic_model_state_bytes_per_rank
    measured = ", ".join(si(b) for b in summary.model_state_bytes_per_rank)
    head.add_row("model states per rank", f"measured {measured}; analytic {si(analytic)}")
    head.add_row("peak memory per rank", ", ".join(si(b) for b in summary.peak_memory_bytes_per_rank))
    init, step = summary.init_peak_memory_bytes_per_rank, summary.step_peak_memory_bytes_per_rank
    head.add_row("peak above start: init / steps", ", ".join(f"{si(a)} / {si(b)}" for a, b in zip(init, step, strict=True)))
    head.add_row(
        "sent per rank per step",
        f"intra-node {si(summary.intra_node_bytes_per_step)}, "
        f"inter-node {si(summary.inter_node_bytes_per_step)}",
    )
    inter, zero3 = summary.inter_node_bytes_per_step, summary.zero3_inter_node_bytes_per_step
    if zero3:
        head.add_row("inter-node vs ZeRO-3", f"{si(inter)} vs {si(zero3)} ({inter / zero3:.2f}x)")
    if summary.skipped_steps or summary.precision == "fp16":
        head.add_row("skipped steps (fp16 overflow)", f"{summary.skipped_steps} of {summary.steps - summary.start_step}")
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
