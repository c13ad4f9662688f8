"""``zeropp simulate``'s printing: one step, the ZeRO++ paper's table, the Llama-3 table (Markdown, as
docs/simulate.md shows them)."""

from __future__ import annotations

from typing import Any

from zeropp.config.rates import si
from zeropp.tools.simulate.model import Simulation
from zeropp.tools.simulate.papers import PAPER_PEAK_TFLOPS

NAMES = {"zero3": "ZeRO-3", "zeropp": "ZeRO++", "qwz": "qwZ", "hpz": "hpZ", "qgz": "qgZ", "ddp": "DDP", "hsdp": "HSDP"}


def print_simulation(sim: Simulation, inter_bits_per_s: float, intra_bits_per_s: float) -> None:
    nodes = sim.gpus // sim.ranks_per_node
    shape = "" if sim.shape.given else " (derived from P = 12 L H², with H = 128 L where neither is given)"
    passes = sim.passes_s
    print(
        f"zeropp simulate: {NAMES[sim.variant]} on {sim.gpus} {sim.gpu.name} ({nodes} node(s) x {sim.ranks_per_node}), "
        f"{si(inter_bits_per_s, 'bit/s')} per node between nodes, {si(intra_bits_per_s, 'bit/s')} per GPU inside"
    )
    if sim.tensor_parallel > 1:
        sequence = ", sequence parallelism" if sim.sequence_parallel else ""
        print(
            f"tensor parallelism: {sim.tensor_parallel} GPUs a group{sequence}, ZeRO over "
            f"{sim.gpus // sim.tensor_parallel} data-parallel ranks, each group trains on "
            f"{sim.tensor_parallel * sim.tokens_per_gpu} tokens"
        )
    print(
        f"model: {sim.params / 1e9:.3g}B parameters, {sim.shape.n_layer} layers x d_model {sim.shape.d_model}{shape}, "
        f"{sim.tokens_per_gpu} tokens per GPU, activation checkpointing {'on' if sim.activation_checkpointing else 'off'}"
    )
    print(
        f"step: {sim.step_s:.3g} s (forward {passes['forward']:.3g} s, backward {passes['backward']:.3g} s, "
        f"step's collectives {sim.comm_s['step']:.2g} s, optimizer {sim.optimizer_s:.2g} s)"
    )
    parts = [("compute", sim.compute_s), ("communication", sim.comm_s), ("quantization kernels", sim.kernel_s)]
    if sim.tensor_parallel > 1:
        parts.append(("tensor-parallel collectives (not overlapped)", sim.tensor_parallel_s))
    for name, seconds in parts:
        print(f"  {name}: forward {seconds['forward']:.3g} s, backward {seconds['backward']:.3g} s")
    print(
        f"achieved: {sim.tflops_per_gpu:.1f} TFLOPs per GPU, peak_fraction {sim.peak_fraction:.3f} "
        f"(of {sim.peak_flops / 1e12:g} TFLOPs)"
    )
    parts = ", ".join(f"{k.replace('_', ' ')} {si(v)}" for k, v in sim.memory.items())
    fits = "fits" if sim.fits else "does NOT fit"
    print(f"memory per GPU: {si(sim.memory_bytes)} of {si(sim.memory_capacity)}, {fits} ({parts})")
    if sim.offload:
        print_offload(sim)


def print_offload(sim: Simulation) -> None:
    """ZeRO-Offload's step: PCIe each way, the host step, the host memory of a node."""
    o, host = sim.offload, sim.gpu.host_memory_bytes
    assert o is not None
    if o.in_backward:
        print(
            f"offload (the host step inside backward): {o.seconds:.3g} s left after backward = the last units' "
            f"steps (of gradients to the host {si(o.to_host_bytes)} in {o.to_host_s:.3g} s and the host step, "
            f"{si(o.host_bytes)} through host memory in {o.host_s:.3g} s, as units land) and the parameters back "
            f"({si(o.to_device_bytes)}, {o.to_device_s:.3g} s)"
        )
    else:
        print(
            f"offload (after backward, not overlapping it): {o.seconds:.3g} s = gradients to the host "
            f"{si(o.to_host_bytes)} in {o.to_host_s:.3g} s, then the host step ({si(o.host_bytes)} through host memory, "
            f"{o.host_s:.3g} s) pipelined with the parameters back ({si(o.to_device_bytes)}, {o.to_device_s:.3g} s)"
        )
    print(
        f"host memory per node: {si(o.host_memory_bytes * sim.ranks_per_node)}"
        + (f" of {si(host)}" if host else "")
        + f" ({si(o.host_memory_bytes)} per GPU: masters, moments and the step's gradient copies)"
    )


def paper_markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| source | cell | the text | paper | simulated | ratio | reading |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        if r["unit"] == "x":
            text, paper, simulated = f"{r['paper']:g}x", f"{r['paper']:.2f}x", f"{r['simulated']:.2f}x"
        else:
            text = f"{round(r['paper'] / PAPER_PEAK_TFLOPS * 100, 1):g}%"
            paper, simulated = f"{r['paper']:.1f}", f"{r['simulated']:.1f}"
        lines.append(
            f"| {r['source']} | {r['label']} | {text} | {paper} | {simulated} | {r['ratio']:.2f} | {r['reading']} |"
        )
    return "\n".join(lines)


def llama_markdown(rows: list[dict[str, Any]]) -> str:
    """TFLOPs per GPU (peak fraction) of each variant at each bandwidth, memory per GPU of each variant
    (the same at every bandwidth), ZeRO++ at 100 Gbit/s over ZeRO-3 at 400."""
    keys = [k for k in rows[0] if "@" in k and "/" not in k]
    variants = list(dict.fromkeys(k.split("@")[0] for k in keys))
    speed = " | ".join(f"{NAMES[k.split('@')[0]]} {k.split('@')[1]}G" for k in keys)
    memory = " | ".join(f"{NAMES[v]} GB" for v in variants)
    lines = [
        f"| model | H100s | {speed} | {memory} | ZeRO++ 100G / ZeRO-3 400G |",
        "| --- | ---: |" + " ---: |" * (len(keys) + len(variants) + 1),
    ]
    for r in rows:
        tflops = [f"{r[k]['tflops']:.0f} ({r[k]['peak_fraction']:.0%})" for k in keys]
        gb = []
        for v in variants:
            cell = r[next(k for k in keys if k.startswith(f"{v}@"))]
            gb.append(f"{cell['memory_gb']:.0f}" + ("" if cell["fits"] else " (OOM)"))
        lines.append(
            f"| {r['model']} | {r['gpus']} | {' | '.join(tflops)} | {' | '.join(gb)} | {r['zeropp@100 / zero3@400']:.2f} |"
        )
    return "\n".join(lines)


def tensor_parallel_markdown(rows: list[dict[str, Any]]) -> str:
    """Each configuration's TFLOPs per GPU (peak fraction) and step at each bandwidth, its tensor-parallel
    collectives' seconds (the same at both) and memory per GPU."""
    speeds = [k for k in rows[0] if k[0].isdigit()]
    head = " | ".join(f"{k}G: TFLOPs (peak) | {k}G: step (s)" for k in speeds)
    lines = [
        f"| configuration | T | {head} | tensor-parallel collectives (s) | memory/GPU (GB) |",
        "| --- | ---: |" + " ---: |" * (2 * len(speeds) + 2),
    ]
    for r in rows:
        cells = " | ".join(f"{r[k]['tflops']:.0f} ({r[k]['peak_fraction']:.0%}) | {r[k]['step_s']:.1f}" for k in speeds)
        memory = f"{r['memory_gb']:.0f}" + ("" if r["fits"] else " (OOM)")
        lines.append(
            f"| {r['configuration']} | {r['tensor_parallel']} | {cells} | {r[speeds[0]]['tensor_parallel_s']:.2f} "
            f"| {memory} |"
        )
    return "\n".join(lines)


def _zero_paper_value(value: Any, unit: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return f"{value:.2f}x" if unit == "x" else f"{value:.3g}"


def zero_paper_markdown(rows: list[dict[str, Any]]) -> str:
    """The ZeRO paper's cells: paper against simulated, the ratio, memory per GPU, and why a cell is not
    simulated where the simulator cannot represent it."""
    lines = [
        "| source | cell | unit | paper | simulated | ratio | memory/GPU (GB) | agrees | reading |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for r in rows:
        bound = {">": "over ", "<": "under "}.get(r["bound"], "")
        paper = f"{bound}{_zero_paper_value(r['paper'], r['unit'])}"
        if r["unrepresentable"]:
            lines.append(
                f"| {r['source']} | {r['label']} | {r['unit']} | {paper} | not simulated | | | | {r['unrepresentable']} |"
            )
            continue
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else ""
        agrees = {True: "yes", False: "**no**", None: ""}[r["agrees"]]
        simulated = _zero_paper_value(r["simulated"], r["unit"])
        if r["quantity"] == "memory":
            simulated = "fits" if r["memory_gb"] <= 32 else "OOM"
        reading = "; ".join(x for x in (r["configuration"], r["reading"]) if x)
        lines.append(
            f"| {r['source']} | {r['label']} | {r['unit']} | {paper} | {simulated} | {ratio} | "
            f"{r['memory_gb']:.1f}{' (OOM)' if r['memory_gb'] > 32 else ''} | {agrees} | {reading} |"
        )
    return "\n".join(lines)
