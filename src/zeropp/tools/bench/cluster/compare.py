"""``zeropp bench cluster``: zeropp beside DDP, FSDP2 and DeepSpeed on an emulated cluster (root).

Every configuration trains the embedded GPT (same init, data and AdamW, fp32, one sequence per rank:
the paper's small-batch regime) on emulated nodes (``zeropp.tools.cluster``; ``--nodes 2 3 4`` x
``--ranks-per-node``, 2 x 2 by default), at each inter-node bandwidth asked for. For each run:
median step time, tokens/s, cross-node bytes per step (the ledger's, for zeropp; the wire's for
all: bytes that crossed the links during the run divided by the steps, start-up included), peak
memory per rank, the speedup over zeropp ZeRO-3 at the same bandwidth and nodes, and for zeropp
on a shaped link the step's lower bound, the fraction of it reached and the estimator's prediction
(:mod:`zeropp.tools.bench.cluster.bound`; the unshaped runs, added when not asked for, give the
compute, and every shaped link is probed first). Writes results.json, results.md and the plots
(step time with the bound, cross-node bytes) to the results folder. ``--plan``: the configurations
of a ``zeropp plan --json`` output, in its order (docs/simulate.md, "zeropp plan").

DeepSpeed runs when it is installed (``pip install deepspeed``; ``DS_ACCELERATOR=cpu``, gloo); its
ZeRO++ (qwZ/qgZ) is CUDA-only and fails on CPU, which is recorded as the result.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from zeropp.app.flags import as_flags
from zeropp.app.summary import RunSummary
from zeropp.config.sections import ZEROPP_SWITCHES
from zeropp.tools.bench.cluster.bound import UNSHAPED, add_bounds, busiest_node_bytes, estimator_fields
from zeropp.tools.bench.rivals import RivalSummary
from zeropp.tools.bench.runs import ZEROPP_OFF, publish_report
from zeropp.tools.cluster import probe_bandwidth, run_cluster
from zeropp.tools.cluster.errors import ClusterError
from zeropp.tools.cluster.links import check_privileges, parse_bandwidth

ZEROPP_KEYS: dict[str, dict[str, Any]] = {  # each configuration's ZeRO keys (zeropp simulate prices the same)
    "zeropp ZeRO-1": {"stage": 1},
    "zeropp ZeRO-2": {"stage": 2},
    "zeropp ZeRO-3": {"stage": 3, **ZEROPP_OFF},
    "zeropp ZeRO-3 + qwZ": {"stage": 3, **ZEROPP_OFF, "quantized_weights": True},
    "zeropp ZeRO-3 + hpZ": {"stage": 3, **ZEROPP_OFF, "hpz_partition_size": 0},
    "zeropp ZeRO-3 + qgZ": {"stage": 3, **ZEROPP_OFF, "quantized_gradients": True},
    "zeropp ZeRO++": {"stage": 3, **ZEROPP_SWITCHES},
    "zeropp ZeRO++ unquantized intra-node hop": {"stage": 3, **ZEROPP_SWITCHES, "gradient_intra_node_bits": 0},
    "zeropp ZeRO++ chunks of any size": {"stage": 3, **ZEROPP_SWITCHES, "qgz_pipeline_min_chunk": 1},
    # DiLoCo: ZeRO-3 (ZeRO++ inside the node) in each node, the nodes synchronized every 10 steps, the change in int8
    "zeropp DiLoCo H=10": {"stage": 3, **ZEROPP_SWITCHES, "outer_sync_every": 10},
    "zeropp DiLoCo H=10 int8": {"stage": 3, **ZEROPP_SWITCHES, "outer_sync_every": 10, "outer_bits": 8},
}
ZEROPP = {name: as_flags(keys) for name, keys in ZEROPP_KEYS.items()}
RIVALS = {
    "DDP": "ddp",
    "FSDP2": "fsdp2",
    "FSDP2 HSDP": "fsdp2-hsdp",
    "FSDP2 reshard to node": "fsdp2-reshard-node",
    "DeepSpeed ZeRO-3": "deepspeed-zero3",
    "DeepSpeed hpZ": "deepspeed-hpz",
    "DeepSpeed ZeRO++": "deepspeed-zeropp",
}


def run_one(
    name: str, nodes: int, ranks_per_node: int, bandwidth: str, preset: str, steps: int, flags: list[str] | None = None
) -> dict[str, Any]:
    """One configuration: `name` of :data:`ZEROPP` or :data:`RIVALS`, or zeropp with `flags` (a plan's)."""
    common = ["--preset", preset, "--steps", str(steps), "--micro-batch-size", "1"]
    flags = flags if flags is not None else ZEROPP.get(name)
    with tempfile.TemporaryDirectory() as tmp:
        summary_path = Path(tmp) / "summary.json"
        if flags is not None:
            args = [*common, "--eval-batches", "1", "--eval-interval", str(steps + 1), *flags]
            result = run_cluster(nodes, ranks_per_node, bandwidth, args, summary_path, timeout_s=900)
        else:
            args = ["--rival", RIVALS[name], *common]
            result = run_cluster(
                nodes, ranks_per_node, bandwidth, args, summary_path, module="zeropp.tools.bench.rivals",
                timeout_s=900, env={**os.environ, "DS_ACCELERATOR": "cpu"},
            )  # fmt: skip
    row: dict[str, Any] = {
        "name": name, "nodes": nodes, "ranks_per_node": ranks_per_node, "bandwidth": bandwidth,
        "returncode": result.returncode,
    }  # fmt: skip
    if result.returncode != 0 or not result.summary:
        lines = [line for tail in result.log_tails for line in tail if re.search(r"\w+Error: ", line)]
        lines = [line for line in lines if "ChildFailedError" not in line and "elastic" not in line]
        reason = lines[-1] if lines else ""
        row["error"] = reason.strip()[-200:] or f"exit status {result.returncode}"
        return row
    s = result.summary if isinstance(result.summary, RunSummary) else RivalSummary.from_dict(result.summary)
    ledger = s.inter_node_bytes_per_step if isinstance(s, RunSummary) else 0  # rivals have no ledger
    row.update(
        median_step_time_s=s.median_step_time_s,
        mean_step_time_s=getattr(s, "mean_step_time_s", 0.0) or None,
        tokens_per_s=s.tokens_per_s,
        wire_bytes_per_step=sum(result.wire_bytes.values()) / steps,
        ledger_inter_bytes_per_step=ledger * nodes * ranks_per_node or None,
        peak_memory_bytes=max(s.peak_memory_bytes_per_rank),
        final_train_loss=s.final_train_loss,
    )
    if isinstance(s, RunSummary):
        row.update(node_inter_bytes=busiest_node_bytes(s.inter_node_bytes_per_step_by_rank, ranks_per_node))
        if not s.config["zero"]["outer"]["sync_every"]:  # the estimator does not price DiLoCo yet
            row.update(estimator_fields(s.config, nodes, ranks_per_node))
    return row


def planned(path: Path) -> dict[str, list[str]]:
    """The configurations of a ``zeropp plan --json`` output, in its order: ``plan N: name`` -> zeropp flags."""
    ranked = json.loads(path.read_text())["ranked"]
    return {f"plan {i}: {entry['name']}": entry["zero_flags"] for i, entry in enumerate(ranked, 1)}


def step_of(row: dict[str, Any]) -> float:
    """The step a speedup compares: the mean where the run has one (DiLoCo's synchronizations are in it,
    not in the median), else the median (the rivals')."""
    return row.get("mean_step_time_s") or row["median_step_time_s"]


def markdown(rows: list[dict[str, Any]], nodes: int, bandwidth: str) -> str:
    base = next((r for r in rows if r["name"] == "zeropp ZeRO-3" and "error" not in r), None)
    lines = [
        f"### {nodes} nodes x {rows[0]['ranks_per_node']} ranks, inter-node bandwidth {bandwidth}",
        "",
        "| configuration | median step (s) | mean step (s) | tokens/s | speedup vs zeropp ZeRO-3 (mean step) | cross-node MB/step: ledger | wire | "
        "peak memory/rank (MiB) | bound (s) | step / bound | estimator (s) | estimator error |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | failed: {r['error']} | | | | | | | | | | |")
            continue
        speedup = f"{step_of(base) / step_of(r):.2f}x" if base else "n/a"  # no ZeRO-3 run (a plan's)
        mean = f"{r['mean_step_time_s']:.3f}" if r.get("mean_step_time_s") else "n/a"
        ledger = f"{r['ledger_inter_bytes_per_step'] / 1e6:.2f}" if r["ledger_inter_bytes_per_step"] else "n/a"
        bound = (
            f"{r['bound_s']:.3f} | {r['of_bound']:.2f}x | {r['predicted_s']:.3f} | {r['estimator_error']:+.1%}"
            if "bound_s" in r
            else "| | |"
        )
        lines.append(
            f"| {r['name']} | {r['median_step_time_s']:.3f} | {mean} | {r['tokens_per_s']:,.0f} | {speedup} | {ledger} | "
            f"{r['wire_bytes_per_step'] / 1e6:.2f} | {r['peak_memory_bytes'] / 2**20:,.0f} | {bound} |"
        )
    return "\n".join(lines)


def plot(groups: dict[tuple[int, str], list[dict[str, Any]]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for metric, label, color, name in (
        ("median_step_time_s", "median step time (s); black: the bound", "tab:blue", "step_time.png"),
        (
            "wire_bytes_per_step",
            "cross-node wire MB per step (start-up included)",
            "tab:orange",
            "cross_node_bytes.png",
        ),
    ):
        fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 5), squeeze=False)
        for ax, ((nodes, bandwidth), group) in zip(axes[0], groups.items(), strict=True):
            rows = [r for r in group if "error" not in r]
            scale = 1 if metric == "median_step_time_s" else 1e-6
            ax.barh([r["name"] for r in rows], [r[metric] * scale for r in rows], color=color)
            if metric == "median_step_time_s":
                bounded = [(i, r["bound_s"]) for i, r in enumerate(rows) if "bound_s" in r]
                ax.scatter([b for _, b in bounded], [i for i, _ in bounded], marker="|", s=300, color="black")
            ax.set_title(f"{nodes} nodes, inter-node {bandwidth}")
            ax.set_xlabel(label)
            ax.invert_yaxis()
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
    plt.close("all")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zeropp bench cluster", description=__doc__)
    parser.add_argument("--bandwidths", nargs="+", default=["200mbit", "1gbit", UNSHAPED])
    parser.add_argument("--nodes", nargs="+", type=int, default=[2], help="node counts to run, e.g. 2 3 4")
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--only", nargs="+", help="configuration names to run (default: all)")
    parser.add_argument(
        "--plan",
        type=Path,
        help="a `zeropp plan --json` output: run its configurations, named 'plan N: ...' "
        "(beside those of --only, if given)",
    )
    parser.add_argument("--out", type=Path, default=Path("results/bench_cluster"))
    args = parser.parse_args(argv)
    names = [*ZEROPP, *RIVALS]
    if importlib.util.find_spec("deepspeed") is None:
        names = [n for n in names if not n.startswith("DeepSpeed")]
        print("deepspeed is not installed: its rows are left out (pip install deepspeed)")
    plan = planned(args.plan) if args.plan else {}
    names = [n for n in names if (not args.only and not plan) or n in (args.only or ())] + list(plan)
    shaped = [b for b in args.bandwidths if parse_bandwidth(b) is not None]
    try:  # before anything is written
        check_privileges(shaped=bool(shaped))
    except ClusterError as error:
        print(str(error).replace("zeropp cluster:", "zeropp bench cluster:"), file=sys.stderr)
        return error.code
    args.out.mkdir(parents=True, exist_ok=True)
    goodput = {b: probe_bandwidth(b)["goodput_bps"] for b in shaped}
    print(json.dumps({"probed_goodput_bps": goodput}), flush=True)
    recorded = vars(args) | {"out": str(args.out), "plan": args.plan and str(args.plan)}
    bandwidths = [UNSHAPED, *shaped]  # the unshaped runs give each configuration's compute: the bound needs them
    rows: list[dict[str, Any]] = []
    for nodes in args.nodes:
        for bandwidth in bandwidths:
            for name in names:
                rows.append(
                    run_one(name, nodes, args.ranks_per_node, bandwidth, args.preset, args.steps, plan.get(name))
                )
                print(json.dumps(rows[-1]), flush=True)
                (args.out / "results.json").write_text(
                    json.dumps({"args": recorded, "goodput_bps": goodput, "rows": rows}, indent=1)
                )
    add_bounds(rows, goodput)
    (args.out / "results.json").write_text(
        json.dumps({"args": recorded, "goodput_bps": goodput, "rows": rows}, indent=1)
    )
    groups = {
        (n, b): [r for r in rows if (r["nodes"], r["bandwidth"]) == (n, b)] for n in args.nodes for b in bandwidths
    }
    report = "\n\n".join(markdown(group, *key) for key, group in groups.items())
    publish_report(args.out, report, lambda: plot(groups, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
