"""What ``zeropp estimate`` prints: the estimate and the papers' tables, as rich tables."""

from __future__ import annotations

from typing import Any

from zeropp.estimate.model import Estimate
from zeropp.estimate.papers import ZERO_TABLE_DP, ZEROPP_TABLE_COLUMNS, ZEROPP_TABLE_PUBLISHED, paper_gb
from zeropp.rates import si


def _seconds(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def _console():
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        console.width = 120
    return console


def print_estimate(est: Estimate, result: dict[str, Any]) -> None:
    from rich.table import Table

    zero, layout = est.zero, est.layout
    head = Table(title="zeropp estimate", show_header=False)
    head.add_row("parameters", f"{est.psi:,} in {len(est.units)} unit(s), {est.padded_psi:,} padded")
    head.add_row("world / nodes", f"{layout.world_size} ranks on {layout.nodes} node(s) of {layout.ranks_per_node}")
    head.add_row(
        "stage / precision",
        f"{zero.stage} / {zero.precision} (gradients {zero.grad_dtype or zero.precision}), "
        f"{zero.gradient_accumulation_steps} micro-batch(es) per step",
    )
    switches = [f"qwZ int{zero.weight_bits}"] if zero.quantized_weights else []
    switches += [f"hpZ (groups of {est.hpz_group_size})"] if est.hpz_group_size > 1 else []
    switches += [f"qgZ int{zero.gradient_bits}"] if zero.quantized_gradients else []
    head.add_row("ZeRO++", ", ".join(switches) or "off")
    head.add_row("model states per rank", si(est.model_state_bytes))
    mean = est.ledger()
    head.add_row(
        "sent per rank per step",
        f"intra-node {si(mean.total(link='intra'))}, inter-node {si(mean.total(link='inter'))} (mean over ranks)",
    )
    zero3, inter = result["zero3_inter_node_bytes_per_step"], mean.total(link="inter")
    if zero.stage == 3 and zero3:
        head.add_row("inter-node vs ZeRO-3", f"{si(inter)} vs {si(zero3)} ({inter / zero3:.3f}x)")
    seconds, bw = result["predicted_comm_seconds_per_step"], result["bandwidth_bits_per_s"]
    head.add_row(
        "predicted comm time",
        f"{_seconds(seconds['total'])} per step = {si(est.busiest_intra_bytes())} at {si(bw['intra'], 'bit/s')} "
        f"+ {si(est.node_inter_bytes())} per node at {si(bw['inter'], 'bit/s')} (no overlap)",
    )
    console = _console()
    console.print(head)
    table = Table(title="bytes sent per rank per step (mean over ranks)")
    for column in ("collective", "phase", "intra-node", "inter-node"):
        table.add_column(column, justify="right" if "node" in column else "left")
    for op, phases in mean.as_dict().items():
        for phase, links in phases.items():
            table.add_row(op, phase, si(links["intra"]), si(links["inter"]))
    console.print(table)


def print_zero_table(table: dict[str, dict[str, dict[int, float]]]) -> None:
    from rich.table import Table

    out = Table(
        title="ZeRO Table 1: model states per device (GB)",
        caption="fp16 parameters and gradients, Adam (K = 12); GB = 1e9 bytes, rounded as the paper does",
    )
    out.add_column("DP")
    for model, stages in table.items():
        for name in stages:
            out.add_column(f"{model}\n{name}", justify="right")
    for n in ZERO_TABLE_DP:
        out.add_row(str(n), *(paper_gb(stages[name][n]) for stages in table.values() for name in stages))
    _console().print(out)


def print_zeropp_table(table: dict[str, Any], hpz: dict[str, float]) -> None:
    from rich.table import Table

    nodes, per_node = table["nodes"], table["ranks_per_node"]
    out = Table(
        title="ZeRO++ Table 1: cross-node volume per node per iteration",
        caption=f"M = the model's fp16 bytes (2Ψ); ours: {nodes} nodes x {per_node} ranks, qwZ int8, hpZ per node, "
        "qgZ int4, blocks of 256 with fp32 scales",
    )
    out.add_column("")
    for column in (*ZEROPP_TABLE_COLUMNS, "total", "intra-node (paper: left out)"):
        out.add_column(column, justify="right")
    for name, published in ZEROPP_TABLE_PUBLISHED.items():
        out.add_row(f"{name} (paper)", *(f"{v:g}M" if v else "0" for v in (*published, sum(published))), "")
    for name, row in table["rows"].items():
        out.add_row(
            f"{name} (ours)", *(f"{v:.4f}M" for v in (*row["inter"], sum(row["inter"]))), f"{row['intra']:.3f}M"
        )
    out.add_row("ZeRO++ / ZeRO-3 (ours)", *(f"{r:.4f}" for r in table["ratios"]), "")
    console = _console()
    console.print(out)
    fig = Table(title="ZeRO++ Fig. 4: 100B parameters on 64 nodes x 16 (fp16, Adam: K = 12)", show_header=False)
    fig.add_row("DP: (2+2+K)M", si(hpz["dp_bytes"]))
    fig.add_row("ZeRO-3: (2+2+K)M/P", si(hpz["zero3_bytes"]))
    fig.add_row(f"hpZ: (2+2+K)M/P + 2M/{hpz['hpz_group_size']}", si(hpz["hpz_bytes"]))
    fig.add_row("hpZ / ZeRO-3", f"{hpz['hpz_over_zero3']:.2f}x (paper: 8.9x)")
    fig.add_row("DP / hpZ", f"{hpz['dp_over_hpz']:.1f}x (paper: 114x)")
    console.print(fig)
