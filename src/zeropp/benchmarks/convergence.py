"""``zeropp bench convergence``: does quantized communication converge like ZeRO-3, over seeds?

Trains the embedded GPT with ``zeropp train`` at stage 3, world 4 (2 simulated nodes x 2, gloo),
each configuration below once per seed. A seed fixes the initial weights and the batches, so the
runs of one seed are paired: their differences are the configurations', not the data's.

- ZeRO-3 (every ZeRO++ switch off);
- ZeRO++ (qwZ int8 blocks of 256, hpZ over each node, qgZ int4 blocks of 256);
- ZeRO++ with qgZ's LoCo error feedback (``--gradient-error-feedback loco``, DeepSpeed's defaults);
- ZeRO++ with two-level qgZ (int8 inside a node, int4 across) and the Hadamard rotation;
- ZeRO++ with qgZ for the first half of the run and a full-precision reduce-scatter after (the
  paper's schedule).

Per configuration: validation loss every ``--eval-interval`` steps, mean and standard deviation
over the seeds, and the paired gap to ZeRO-3 (mean and standard deviation of the per-seed
differences); cross-node bytes per rank and step; and the weight error after 10 steps (first
seed's batches) against ZeRO-3's: ||w - w_zero3|| / ||w_zero3 - w_0|| over all parameters, w_0
the initial weights (a one-step run at a learning rate of 1e-30).

    zeropp bench convergence [--seeds 1 2 3] [--steps 300] [--preset tiny] [--lr LR] [--out results/bench_convergence]

Writes results.json (every run's summary), results.md and curves.png (means with +-1 std bands).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from zeropp.benchmarks.runs import ZEROPP_OFF_FLAGS, ZEROPP_ON_FLAGS, publish_report, train_summary

CONFIGS = {
    "ZeRO-3": ZEROPP_OFF_FLAGS,
    "ZeRO++": ZEROPP_ON_FLAGS,
    "ZeRO++ + error feedback": [*ZEROPP_ON_FLAGS, "--gradient-error-feedback", "loco"],
    "ZeRO++ two-level + Hadamard": [*ZEROPP_ON_FLAGS, "--gradient-intra-node-bits", "8", "--gradient-hadamard"],
    "ZeRO++ qgZ first half": [*ZEROPP_ON_FLAGS, "--quantized-gradients-until", "0.5"],
}


def _common(args: argparse.Namespace, steps: int) -> list[str]:
    common = ["--stage", "3", "--steps", str(steps), "--preset", args.preset, "--precision", args.precision]
    return common if args.lr is None else [*common, "--lr", args.lr]


def _final_weights(common: list[str], flags: list[str]) -> dict[str, Any]:
    """The fp32 weights after a ``zeropp train`` run (saved, then exported to one file)."""
    from safetensors.torch import load_file

    from zeropp.checkpoint import export_checkpoint, find_latest

    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "zeropp.cli", "train", *common, *flags, "--checkpoint-dir", tmp]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        export_checkpoint(find_latest(tmp), Path(tmp) / "model.safetensors")
        return load_file(str(Path(tmp) / "model.safetensors"))


def weight_errors(args: argparse.Namespace) -> dict[str, float]:
    """||w - w_zero3|| / ||w_zero3 - w_0|| after --weight-steps steps of the first seed."""
    import torch

    seed = ["--seed", str(args.seeds[0]), "--eval-batches", "1"]
    initial = _final_weights(_common(args, 1) + seed, [*ZEROPP_OFF_FLAGS, "--lr", "1e-30"])
    names = [name for name in CONFIGS if name in args.names]
    weights = {name: _final_weights(_common(args, args.weight_steps) + seed, CONFIGS[name]) for name in names}
    flat = {name: torch.cat([w[k].double().reshape(-1) for k in sorted(w)]) for name, w in weights.items()}
    start = torch.cat([initial[k].double().reshape(-1) for k in sorted(initial)])
    exact = flat["ZeRO-3"]
    moved = float((exact - start).norm())
    return {name: float((w - exact).norm()) / moved for name, w in flat.items()}


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def curves(runs: dict[str, dict[int, dict]]) -> dict[str, dict[str, list]]:
    """Per configuration: steps, mean and std of the validation loss over seeds, and the paired gap
    to ZeRO-3 (relative, per seed) as mean and std."""
    out = {}
    base = runs["ZeRO-3"]
    for name, by_seed in runs.items():
        seeds = sorted(s for s in by_seed if s in base)
        steps = [int(s) for s, _ in by_seed[seeds[0]]["val_losses"]]
        rows: dict[str, list] = {"steps": steps, "mean": [], "std": [], "gap_mean": [], "gap_std": []}
        for i in range(len(steps)):
            losses = [by_seed[s]["val_losses"][i][1] for s in seeds]
            gaps = [by_seed[s]["val_losses"][i][1] / base[s]["val_losses"][i][1] - 1 for s in seeds]
            for key, value in zip(
                ("mean", "std", "gap_mean", "gap_std"), (*_mean_std(losses), *_mean_std(gaps)), strict=True
            ):
                rows[key].append(value)
        out[name] = rows
    return out


def markdown(args: argparse.Namespace, runs: dict[str, dict[int, dict]], errors: dict[str, float]) -> str:
    table = curves(runs)
    steps = table["ZeRO-3"]["steps"]
    base_bytes = statistics.fmean(r["inter_node_bytes_per_step"] for r in runs["ZeRO-3"].values())
    lines = [
        f"seeds {' '.join(map(str, args.seeds))}, {args.steps} steps, preset {args.preset}, {args.precision}, "
        f"world 4 = 2 simulated nodes x 2; validation loss over {args.eval_batches} batches per rank, "
        "mean +- std over seeds",
        "",
        "| run | " + " | ".join(f"step {s}" for s in steps) + " |",
        "|---|" + "---|" * len(steps),
    ]
    for name, rows in table.items():
        cells = [f"{m:.4f} ± {s:.4f}" for m, s in zip(rows["mean"], rows["std"], strict=True)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| run | gap to ZeRO-3 at each step (paired, mean ± std) | cross-node bytes/rank/step | vs ZeRO-3 "
        f"| weight error after {args.weight_steps} steps |",
        "|---|---|---|---|---|",
    ]
    for name, rows in table.items():
        gaps = ", ".join(f"{m:+.2%} ± {s:.2%}" for m, s in zip(rows["gap_mean"], rows["gap_std"], strict=True))
        sent = statistics.fmean(r["inter_node_bytes_per_step"] for r in runs[name].values())
        error = f"{errors[name]:.3f}" if name in errors else "-"
        lines.append(f"| {name} | {gaps} | {sent / 2**20:.3f} MiB | {sent / base_bytes:.3f}x | {error} |")
    return "\n".join(lines)


def plot(runs: dict[str, dict[int, dict]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, rows in curves(runs).items():
        low = [m - s for m, s in zip(rows["mean"], rows["std"], strict=True)]
        high = [m + s for m, s in zip(rows["mean"], rows["std"], strict=True)]
        (line,) = ax.plot(rows["steps"], rows["mean"], label=name)
        ax.fill_between(rows["steps"], low, high, alpha=0.15, color=line.get_color())
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (mean ± std over seeds)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="zeropp bench convergence", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-interval", type=int, default=50)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument(
        "--lr", help="peak learning rate of every run (default: zeropp train's; see docs/benchmarks.md)"
    )
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--weight-steps", type=int, default=10, help="steps of the weight-error runs (0: none)")
    parser.add_argument("--only", nargs="+", choices=list(CONFIGS), help="configurations to run (ZeRO-3 always runs)")
    parser.add_argument("--train-flags", nargs=argparse.REMAINDER, default=[], help="more zeropp train flags, last")
    parser.add_argument("--out", type=Path, default=Path("results/bench_convergence"))
    args = parser.parse_args(argv)
    if len(args.seeds) < 2:
        parser.error("--seeds: give at least 2 seeds (a standard deviation needs two)")
    args.names = [n for n in CONFIGS if n == "ZeRO-3" or not args.only or n in args.only]
    args.out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict[int, dict]] = {name: {} for name in args.names}
    evals = ["--eval-interval", str(args.eval_interval), "--eval-batches", str(args.eval_batches)]
    for seed in args.seeds:  # seed by seed, configurations alternating: a partial result is still paired
        for name in args.names:
            flags = [*_common(args, args.steps), *evals, "--seed", str(seed), *CONFIGS[name], *args.train_flags]
            runs[name][seed] = train_summary(flags).as_dict()
            final = runs[name][seed]["final_val_loss"]
            print(f"seed {seed} {name}: final val loss {final:.4f}", flush=True)
            (args.out / "results.json").write_text(json.dumps({"args": _jsonable(args), "runs": runs}, indent=1))
    errors = weight_errors(args) if args.weight_steps else {}
    report = markdown(args, runs, errors)
    (args.out / "results.json").write_text(
        json.dumps({"args": _jsonable(args), "runs": runs, "curves": curves(runs), "weight_errors": errors}, indent=1)
    )
    publish_report(args.out, report, lambda: plot(runs, args.out))
    return 0


def _jsonable(args: argparse.Namespace) -> dict[str, Any]:
    return vars(args) | {"out": str(args.out)}


if __name__ == "__main__":
    raise SystemExit(main())
