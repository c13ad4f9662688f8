"""What ``zeropp estimate`` prints: the estimate and the papers' tables, as rich tables."""

from __future__ import annotations

from typing import Any

from zeropp.config.rates import si
from zeropp.tools.estimate.model import Estimate
from zeropp.tools.estimate.papers import (
    ZERO_TABLE_2_DP,
    ZERO_TABLE_DP,
    ZEROPP_TABLE_COLUMNS,
    ZEROPP_TABLE_PUBLISHED,
    paper_gb,
    paper_params,
)


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
    per_rank = " per tensor-parallel rank" if layout.tensor_parallel_size > 1 else ""
    head.add_row("parameters", f"{est.psi:,}{per_rank} in {len(est.units)} unit(s), {est.padded_psi:,} padded")
    if est.frozen_psi:
        stored = f"int{zero.nontrainable_weight_bits}" if zero.quantized_nontrainable_weights else zero.precision
        head.add_row(
            "frozen parameters", f"{est.frozen_psi:,} beside them (no gradient or optimizer state), stored {stored}"
        )
    head.add_row("world / nodes", f"{layout.world_size} ranks on {layout.nodes} node(s) of {layout.ranks_per_node}")
    tp = layout.tensor_parallel_size
    if tp > 1:
        head.add_row(
            "mesh",
            f"{est.data_parallel.world_size} data-parallel x {tp} tensor-parallel (model states: this rank's share)",
        )
    head.add_row(
        "stage / precision",
        f"{zero.stage} / {zero.precision} (gradients {zero.grad_dtype or zero.precision}), "
        f"{zero.gradient_accumulation_steps} micro-batch(es) per step",
    )
    switches = [f"{'qWD' if zero.qwz.delta else 'qwZ'} int{zero.qwz.bits}"] if zero.qwz.enabled else []
    switches += [f"hpZ (groups of {est.hpz_group_size})"] if est.hpz_group_size > 1 else []
    switches += [f"qgZ int{zero.qgz.bits}"] if zero.qgz.enabled else []
    head.add_row("ZeRO++", ", ".join(switches) or "off")
    outer = result["outer_exchange"]
    if outer is not None:
        _outer_rows(head, est, outer)
    head.add_row("model states per rank", si(est.model_state_bytes))
    tiers, disk = result["model_state_bytes_per_rank_by_tier"], result["disk_tiers_per_rank"]
    if tiers["host"] or tiers["disk"]:
        head.add_row("  by tier", f"device {si(tiers['device'])}, host {si(tiers['host'])}, disk {si(tiers['disk'])}")
    if disk is not None:
        head.add_row(
            "  disk tiers",
            f"host ring {si(disk['host_ring_bytes'])}; per step read {si(disk['read_bytes_per_step'])}, "
            f"written {si(disk['written_bytes_per_step'])}",
        )
    transient = result["stage3_transient_bytes_per_rank"]
    if transient is not None:
        head.add_row(
            "  while a step runs",
            f"+ {si(transient['units_gathered'])} gathered units (1 + prefetch {zero.prefetch}), "
            f"+ {si(transient['gradients_in_reduction'])} whole gradients (the unit in backward, the reductions in flight)",
        )
    _activation_rows(head, est)
    mean, amortized = est.ledger(), "; DiLoCo's exchange spread over its steps" if outer else ""
    head.add_row(
        "sent per rank per step",
        f"intra-node {si(mean.total(link='intra'))}, inter-node {si(mean.total(link='inter'))} (mean over ranks{amortized})",
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
    step = result["predicted_step_seconds"]
    if step is not None:
        head.add_row(
            "predicted step",
            f"{_seconds(step['total_s'])} with {_seconds(result['compute_seconds_per_step'])} of compute, overlapped "
            f"over {est.gathered_units} gathered unit(s) (forward {_seconds(step['forward_s'])}, backward "
            f"{_seconds(step['backward_s'])}; {result['backend']})",
        )
    console = _console()
    console.print(head)
    table = Table(title=f"bytes sent per rank per step (mean over ranks{amortized})")
    for column in ("collective", "phase", "intra-node", "inter-node"):
        table.add_column(column, justify="right" if "node" in column else "left")
    for op, phases in mean.as_dict().items():
        for phase, links in phases.items():
            table.add_row(op, phase, si(links["intra"]), si(links["inter"]))
    console.print(table)


def _outer_rows(head: Any, est: Estimate, outer: dict[str, Any]) -> None:
    """DiLoCo: the replicas and the exchange, per synchronization and spread over the steps."""
    every, bits = outer["sync_every"], outer["bits"]
    blocks = f"blocks of {est.zero.outer.block_size}"
    how = f"int{bits} reduce-scatter and all-gather ({blocks})" if bits else "fp32 all-reduce"
    head.add_row(
        "DiLoCo",
        f"{est.layout.nodes} replicas, ZeRO over each node's {est.shard_layout.world_size} data-parallel ranks "
        f"(nothing else crosses a node); every {every} steps an {how} of {outer['shard_numel']:,} values per rank",
    )
    if outer["fragments"] > 1:
        head.add_row(
            "  fragments",
            f"{outer['fragments']}, staggered over the {every} steps (one synchronized at a time): per fragment's "
            f"sync {', '.join(si(b) for b in outer['fragment_bytes_per_sync_per_rank'])} per rank",
        )
    head.add_row(
        "  outer exchange",
        f"{'per sync' if outer['fragments'] == 1 else f'every {every} steps'} "
        f"{si(outer['bytes_per_sync_per_rank'])} per rank ({si(outer['node_bytes_per_sync'])} per node); "
        f"per step {si(outer['bytes_per_step_per_rank'])} per rank ({si(outer['node_bytes_per_step'])} per node)",
    )
    if outer["intra_node_bytes_per_sync_per_rank"]:
        head.add_row(
            "  after each sync" if outer["fragments"] == 1 else "  after every fragment's sync",
            f"the resident units' new weights gathered again inside the node: "
            f"{si(outer['intra_node_bytes_per_sync_per_rank'])} per rank",
        )


def _activation_rows(head: Any, est: Estimate) -> None:
    """Saved activations, checkpoints and tensor-parallel traffic, where the activations are known."""
    acts, tp = est.activations, est.layout.tensor_parallel_size
    if acts is None:
        if tp > 1:
            head.add_row("tensor-parallel traffic", "not priced: give --n-layer, --d-model and --block-size")
        return
    saved = est.activation_bytes()
    if saved is not None:
        tokens = f"{acts.batch} x {acts.seq // acts.context_parallel} tokens"
        logits = "whole logits" if acts.logit_tiles == 1 else f"logits in {acts.logit_tiles} tiles"
        head.add_row("activations per rank", f"{si(saved)} saved by forward ({tokens}, {logits})")
    if acts.activation_checkpointing:
        kind = "Pa+cpu" if acts.cpu_checkpointing else "Pa" if acts.partition_activations else None
        split = f"1/{tp} of the sequence" if acts.sequence_parallel and tp > 1 else "whole on every tp rank"
        kind = split if kind is None else f"{kind}; {split}" if acts.sequence_parallel and tp > 1 else kind
        host = est.activation_checkpoint_bytes("host")
        head.add_row(
            "activation checkpoints per rank",
            f"{si(est.activation_checkpoint_bytes())} on the device, {si(host)} on the host ({kind}; "
            f"{acts.layers} blocks of {acts.batch} x {acts.seq} x {acts.hidden})",
        )
    if tp > 1:
        tp_bytes, pa = est.bytes_of("tp"), est.bytes_of("pa")
        head.add_row(
            "tensor-parallel traffic",
            f"{si(tp_bytes)} per rank per step ("
            + (
                "sequence parallelism's all-gathers and reduce-scatters"
                if acts.sequence_parallel
                else "Megatron's all-reduces"
            )
            + ", inside a node)"
            + (f"; Pa's all-gathers {si(pa)} = {pa / tp_bytes:.3f}x of it" if pa else ""),
        )


def print_zero_table(table: dict[str, dict[str, dict[int, float]]], mp: int = 1) -> None:
    from rich.table import Table

    out = Table(
        title="ZeRO Table 1: model states per device (GB)" + (f", model parallelism {mp}" if mp > 1 else ""),
        caption="fp16 parameters and gradients, Adam (K = 12); GB = 1e9 bytes, rounded as the paper does"
        + (f"; each device holds Ψ/{mp} (ZeRO §7)" if mp > 1 else ""),
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


def print_max_model_table(result: dict[str, Any]) -> None:
    from rich.table import Table

    table = result["zero_table_2_max_params"]
    stages = next(iter(table.values()))
    out = Table(
        title=f"ZeRO Table 2: largest model whose model states fit a 32 GB V100, MP x {ZERO_TABLE_2_DP} DP",
        caption="ours, exact; the paper multiplies its MP = 1 figure, cut to 0.1B, by MP (7.6B x 16 = 121.6B)",
    )
    for column in ("MP", "GPUs", *stages):
        out.add_column(column, justify="right")
    for mp, row in table.items():
        out.add_row(str(mp), str(mp * ZERO_TABLE_2_DP), *(paper_params(v) for v in row.values()))
    console = _console()
    console.print(out)
    example = Table(title="ZeRO §7: 32B parameters, MP 16 x DP 64 (GB per device)", show_header=False)
    for name, gb in result["zero_section_7_example_gb"].items():
        example.add_row(name, f"{gb:.4g}")
    console.print(example)
    trillion = result["zero_trillion_example"]
    one_t = Table(
        title=f"ZeRO §8: 1T parameters on {trillion['gpus']} GPUs, MP {trillion['mp']} x DP {trillion['dp']} (per GPU)",
        show_header=False,
    )
    for name, used in trillion["bytes_per_gpu"].items():
        one_t.add_row(name, si(used), "fits 32 GB" if trillion["fits"][name] else "does not fit 32 GB")
    console.print(one_t)


def print_pa_example(example: dict[str, Any]) -> None:
    from rich.table import Table

    out = Table(
        title=f"ZeRO-R Pa (SC20 §6.1, §8): {example['params'] / 1e9:.1f}B GPT ({example['layers']} layers, hidden "
        f"{example['hidden']}), batch {example['batch']}, sequence {example['seq']}, MP {example['mp']}, fp16",
        show_header=False,
    )
    elements, stored = example["checkpoint_elements"], example["checkpoint_bytes"]
    out.add_row(
        "checkpoints per GPU, without Pa",
        f"{si(stored['without Pa'])} ({elements['without Pa'] / 1e9:.2f}G elements; paper: about 33 GB)",
    )
    out.add_row(
        "checkpoints per GPU, Pa", f"{si(stored['Pa'])} ({elements['Pa'] / 1e9:.2f}G elements; paper: about 2 GB)"
    )
    out.add_row(
        "checkpoints per GPU, Pa+cpu", f"{si(stored['Pa+cpu'])} on the device, {si(stored['Pa+cpu host'])} on the host"
    )
    out.add_row(
        "Pa's all-gathers / tensor-parallel all-reduces",
        f"{si(example['pa_bytes_per_step'])} / {si(example['tensor_parallel_bytes_per_step'])} per GPU per step = "
        f"{example['pa_over_tensor_parallel']:.4f} (paper: under 1/10)",
    )
    _console().print(out)
