"""``zeropp bench convergence``: does quantized communication (or low-precision state) converge like ZeRO-3, over seeds?

Trains the embedded GPT with ``zeropp train`` at stage 3, world 4 (2 simulated nodes x 2, gloo),
each configuration below once per seed. A seed fixes the initial weights and the batches, so the
runs of one seed are paired: their differences are the configurations', not the data's.

- ZeRO-3 (every ZeRO++ switch off);
- ZeRO++ (qwZ int8 blocks of 256, hpZ over each node, qgZ int4 blocks of 256);
- ZeRO++ with qgZ's LoCo error feedback (``--gradient-error-feedback loco``, DeepSpeed's defaults);
- ZeRO++ with two-level qgZ (int8 inside a node, int4 across) and the Hadamard rotation;
- ZeRO++ with qgZ for the first half of the run and a full-precision reduce-scatter after (the
  paper's schedule);
- ZeRO-3 with Adam's moments stored in bf16 (``--optimizer-state-dtype bf16``: 12 bytes of model
  states per parameter instead of 16);
- with the best gradient path (error feedback, two-level qgZ, Hadamard) and hpZ: qwZ int4 on the raw
  weights, and qWD (``--weight-quantization delta``: the weights' change since the last gather) int4 and int8.
- ZeRO-3 with bf16 masters too (``--master-dtype bf16``, Kahan-compensated: 10 bytes per parameter).
- ZeRO-3 with Muon for the blocks' matrices and AdamW for the rest (``--optimizer muon``), and with
  torchao's AdamW with 8-bit or 4-bit states (``--optimizer adamw8bit``, ``adamw4bit``): other
  optimizers at equal steps, not another communication (no weight error against AdamW's run).
- DiLoCo (``--outer-sync-every``): each simulated node trains alone with ZeRO-3 over its 2 ranks and
  the nodes meet every 10 or 50 steps (Nesterov SGD, lr 0.7, momentum 0.9), and as often with the
  change in int4 blocks with error feedback (no weight error: the nodes apart between synchronizations
  are the algorithm, not an error); and Streaming DiLoCo (``--outer-fragments 3``: one unit of the
  tiny GPT synchronized at a time, staggered over the 50 steps).

Per configuration: validation loss every ``--eval-interval`` steps, mean and standard deviation
over the seeds, and the paired gap to ZeRO-3 (mean and standard deviation of the per-seed
differences) at every evaluation after warm-up; cross-node bytes per rank and step; and the weight
error after ``--weight-steps`` AdamW steps on one fixed batch against the exact run (ZeRO-3):
:mod:`zeropp.tools.bench.quality.weight_error`.

    zeropp bench convergence [--seeds 1 2 3] [--steps 300] [--lr 1e-3] [--warmup-steps 50] [--resume]
                             [--preset tiny] [--out results/bench_convergence]

Writes results.json (every run's summary), results.md and curves.png (means with +-1 std bands).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from zeropp.app.flags import as_flags
from zeropp.config.sections import ZEROPP_SWITCHES
from zeropp.tools.bench.quality.weight_error import base_config, measure
from zeropp.tools.bench.runs import ZEROPP_OFF, publish_report, train_summary

# The recipe (docs/benchmarks.md, "ZeRO++ convergence"; zeropp train's defaults too): at lr 1e-3 with
# 50 warm-up steps ZeRO-3's seeds leave the unigram plateau by step ~100 together; at 3e-3 each run
# leaves it at a step that depends on chance.
LR, WARMUP_STEPS, STEPS = 1e-3, 50, 300

# ZeRO++ with the best gradient path today: qgZ's error feedback and two-level qgZ with the Hadamard rotation
BEST_QGZ = {
    **ZEROPP_SWITCHES,
    "gradient_error_feedback": "loco",
    "gradient_intra_node_bits": 8,
    "gradient_hadamard": True,
}
CONFIGS: dict[str, dict[str, Any]] = {  # zero keys of each configuration
    "ZeRO-3": ZEROPP_OFF,
    "ZeRO++": ZEROPP_SWITCHES,
    "ZeRO++ + error feedback": {**ZEROPP_SWITCHES, "gradient_error_feedback": "loco"},
    "ZeRO++ two-level + Hadamard": {**ZEROPP_SWITCHES, "gradient_intra_node_bits": 8, "gradient_hadamard": True},
    "ZeRO++ unquantized intra-node hop": {**ZEROPP_SWITCHES, "gradient_intra_node_bits": 0},
    "ZeRO++ qgZ first half": {**ZEROPP_SWITCHES, "quantized_gradients_until": 0.5},
    "ZeRO-3 + bf16 optimizer states": {**ZEROPP_OFF, "optimizer_state_dtype": "bf16"},
    "ZeRO++ int4 qwZ": {**BEST_QGZ, "weight_bits": 4},
    "ZeRO++ int4 qWD": {**BEST_QGZ, "weight_bits": 4, "weight_quantization": "delta"},
    "ZeRO++ int8 qWD": {**BEST_QGZ, "weight_quantization": "delta"},
    # bf16 masters, Kahan-compensated, with bf16 moments: 10 bytes of model states per parameter (--precision bf16)
    "ZeRO-3 + bf16 masters and states": {**ZEROPP_OFF, "optimizer_state_dtype": "bf16", "master_dtype": "bf16"},
    # another optimizer, not another communication: whole parameters on owner ranks (no weight error: not AdamW)
    "ZeRO-3, Muon + AdamW": {**ZEROPP_OFF, "optimizer": "muon"},
    "ZeRO-3, torchao AdamW 8-bit": {**ZEROPP_OFF, "optimizer": "adamw8bit"},
    "ZeRO-3, torchao AdamW 4-bit": {**ZEROPP_OFF, "optimizer": "adamw4bit"},
    # DiLoCo: the nodes synchronized every H steps, not every step (See [Note: the outer loop])
    "ZeRO-3 DiLoCo H=10": {**ZEROPP_OFF, "outer_sync_every": 10},
    "ZeRO-3 DiLoCo H=50": {**ZEROPP_OFF, "outer_sync_every": 50},
    "ZeRO-3 DiLoCo H=10 int4": {**ZEROPP_OFF, "outer_sync_every": 10, "outer_bits": 4},
    "ZeRO-3 DiLoCo H=50 int4": {**ZEROPP_OFF, "outer_sync_every": 50, "outer_bits": 4},
    # Streaming DiLoCo: the tiny GPT's 3 units (2 blocks, the root) each synchronized once in 50 steps, staggered
    "ZeRO-3 Streaming DiLoCo H=50 F=3 int4": {
        **ZEROPP_OFF,
        "outer_sync_every": 50,
        "outer_fragments": 3,
        "outer_bits": 4,
    },
}


def _common(args: argparse.Namespace) -> list[str]:
    """The recipe's zeropp train flags, shared by every run."""
    return [
        "--stage", "3", "--steps", str(args.steps), "--preset", args.preset, "--precision", args.precision,
        "--lr", str(args.lr), "--warmup-steps", str(args.warmup_steps), "--micro-batch-size", str(args.micro_batch_size),
    ]  # fmt: skip


def weight_errors(args: argparse.Namespace) -> dict[str, float]:
    """Weight error after --weight-steps steps on the first seed's first batch (zeropp.tools.bench.quality.weight_error)."""
    base = base_config(args.preset, args.precision, args.lr, args.weight_steps, args.seeds[0], args.micro_batch_size)
    exact_kind = [name for name in args.names if not {"optimizer", "outer_sync_every"} & set(CONFIGS[name])]
    configs = {name: CONFIGS[name] for name in exact_kind}
    return measure({"base": base, "configs": configs, "exact": "ZeRO-3"})


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def curves(runs: dict[str, dict[int, dict]], base_name: str = "ZeRO-3") -> dict[str, dict[str, list]]:
    """Per configuration: steps, mean and std of the validation loss over seeds, and the paired gap
    to `base_name`'s runs (relative, per seed) as mean and std."""
    out = {}
    base = runs[base_name]
    for name, by_seed in runs.items():
        seeds = sorted(s for s in by_seed if s in base)
        steps = [int(s) for s, _ in by_seed[seeds[0]]["val_losses"]]
        rows: dict[str, list] = {"steps": steps, "mean": [], "std": [], "gap_mean": [], "gap_std": []}
        for i in range(len(steps)):
            losses = [by_seed[s]["val_losses"][i][1] for s in seeds]
            gaps = [by_seed[s]["val_losses"][i][1] / base[s]["val_losses"][i][1] - 1 for s in seeds]
            for key, value in zip(
                ("mean", "std", "gap_mean", "gap_std"), (*mean_std(losses), *mean_std(gaps)), strict=True
            ):
                rows[key].append(value)
        out[name] = rows
    return out


def markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Markdown lines of a table."""
    return [f"| {' | '.join(header)} |", "|" + "---|" * len(header), *(f"| {' | '.join(r)} |" for r in rows)]


def markdown(args: argparse.Namespace, runs: dict[str, dict[int, dict]], errors: dict[str, float]) -> str:
    table = curves(runs)
    steps = table["ZeRO-3"]["steps"]
    after = [i for i, s in enumerate(steps) if s > args.warmup_steps]  # evaluation points after warm-up
    base_bytes = statistics.fmean(r["inter_node_bytes_per_step"] for r in runs["ZeRO-3"].values())
    seeds = sorted(runs["ZeRO-3"])
    spread = table["ZeRO-3"]["std"][-1] / table["ZeRO-3"]["mean"][-1]
    summary = []
    for name, rows in table.items():
        worst = max(after, key=lambda i: abs(rows["gap_mean"][i]), default=None)
        gap = (
            "-"
            if worst is None
            else f"{rows['gap_mean'][worst]:+.2%} ± {rows['gap_std'][worst]:.2%} (step {steps[worst]})"
        )
        sent = statistics.fmean(r["inter_node_bytes_per_step"] for r in runs[name].values())
        error = f"{errors[name]:.3f}" if name in errors else "-"
        summary.append([name, gap, f"{sent / 2**20:.3f} MiB", f"{sent / base_bytes:.3f}x", error])
    lines = [
        f"seeds {' '.join(map(str, seeds))}, {args.steps} steps, preset {args.preset}, {args.precision}, "
        f"lr {args.lr:g} ({args.warmup_steps} warm-up steps, cosine decay), {args.micro_batch_size} sequences per rank, "
        f"world 4 = 2 simulated nodes x 2; validation loss over {args.eval_batches} batches per rank, "
        "mean ± std over seeds",
        "",
        *markdown_table(
            ["run", *(f"step {s}" for s in steps)],
            [
                [name, *(f"{m:.4f} ± {d:.4f}" for m, d in zip(rows["mean"], rows["std"], strict=True))]
                for name, rows in table.items()
            ],
        ),
        "",
        f"ZeRO-3's seeds at step {steps[-1]}: std / mean = {spread:.2%}. Paired gap to ZeRO-3 "
        "(per seed: loss / ZeRO-3's loss − 1; mean ± std over seeds) after warm-up:",
        "",
        *markdown_table(
            ["run", *(f"step {steps[i]}" for i in after)],
            [
                [name, *(f"{rows['gap_mean'][i]:+.2%} ± {rows['gap_std'][i]:.2%}" for i in after)]
                for name, rows in table.items()
            ],
        ),
        "",
        *markdown_table(
            [
                "run",
                "largest mean gap after warm-up",
                "cross-node bytes/rank/step",
                "vs ZeRO-3",
                f"weight error, {args.weight_steps} steps on one batch",
            ],
            summary,
        ),
    ]
    return "\n".join(lines)


def plot(runs: dict[str, dict[int, dict]], out: Path, base_name: str = "ZeRO-3") -> None:
    """curves.png: the validation loss (left) and the paired gap to `base_name` in % (right), mean ± std bands."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (losses, gaps) = plt.subplots(1, 2, figsize=(12, 5))
    for name, rows in curves(runs, base_name).items():
        for ax, mean, std, scale in ((losses, "mean", "std", 1), (gaps, "gap_mean", "gap_std", 100)):
            middle = [scale * m for m in rows[mean]]
            spread = [scale * s for s in rows[std]]
            (line,) = ax.plot(rows["steps"], middle, label=name)
            low = [m - s for m, s in zip(middle, spread, strict=True)]
            high = [m + s for m, s in zip(middle, spread, strict=True)]
            ax.fill_between(rows["steps"], low, high, alpha=0.15, color=line.get_color())
    losses.set_ylabel("validation loss (mean ± std over seeds)")
    gaps.set_ylabel(f"paired gap to {base_name}, % (mean ± std over seeds)")
    for ax in (losses, gaps):
        ax.set_xlabel("step")
    losses.legend()
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=120)
    plt.close(fig)


RECIPE = (
    "steps",
    "preset",
    "precision",
    "lr",
    "warmup_steps",
    "micro_batch_size",
    "eval_interval",
    "eval_batches",
    "train_flags",
)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="zeropp bench convergence", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--eval-interval", type=int, default=50)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--lr", type=float, default=LR, help="peak learning rate (cosine schedule)")
    parser.add_argument("--warmup-steps", type=int, default=WARMUP_STEPS)
    parser.add_argument("--micro-batch-size", type=int, default=4, help="sequences per rank and step")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--weight-steps", type=int, default=10, help="steps of the weight-error runs (0: none)")
    parser.add_argument("--only", nargs="+", choices=list(CONFIGS), help="configurations to run (ZeRO-3 always runs)")
    parser.add_argument(
        "--resume", action="store_true", help="keep the runs OUT/results.json holds from the same recipe; run the rest"
    )
    parser.add_argument("--train-flags", nargs=argparse.REMAINDER, default=[], help="more zeropp train flags, last")
    parser.add_argument("--out", type=Path, default=Path("results/bench_convergence"))
    args = parser.parse_args(argv)
    if len(args.seeds) < 2:
        parser.error("--seeds: give at least 2 seeds (a standard deviation needs two)")
    args.names = [n for n in CONFIGS if n == "ZeRO-3" or not args.only or n in args.only]
    args.out.mkdir(parents=True, exist_ok=True)
    runs = _finished_runs(args) if args.resume else {}
    runs = {name: {seed: runs[name][seed] for seed in args.seeds if seed in runs.get(name, {})} for name in args.names}
    evals = ["--eval-interval", str(args.eval_interval), "--eval-batches", str(args.eval_batches)]
    for seed in args.seeds:  # seed by seed, configurations alternating: a partial result is still paired
        for name in args.names:
            if seed not in runs[name]:
                flags = [*_common(args), *evals, "--seed", str(seed), *as_flags(CONFIGS[name]), *args.train_flags]
                runs[name][seed] = train_summary(flags).as_dict()
                (args.out / "results.json").write_text(json.dumps({"args": _jsonable(args), "runs": runs}, indent=1))
            print(f"seed {seed} {name}: final val loss {runs[name][seed]['final_val_loss']:.4f}", flush=True)
    errors = weight_errors(args) if args.weight_steps else {}
    report = markdown(args, runs, errors)
    (args.out / "results.json").write_text(
        json.dumps({"args": _jsonable(args), "runs": runs, "curves": curves(runs), "weight_errors": errors}, indent=1)
    )
    publish_report(args.out, report, lambda: plot(runs, args.out))
    return 0


def _finished_runs(args: argparse.Namespace) -> dict[str, dict[int, dict]]:
    """The runs OUT/results.json holds, where its recipe is this one (else none, with a line saying so)."""
    path = args.out / "results.json"
    if not path.is_file():
        return {}
    saved = json.loads(path.read_text())
    differs = [key for key in RECIPE if saved["args"].get(key) != getattr(args, key)]
    if differs:
        print(f"--resume: {path} has another {', '.join(differs)}; running every run again", flush=True)
        return {}
    return {name: {int(seed): run for seed, run in by_seed.items()} for name, by_seed in saved["runs"].items()}


def _jsonable(args: argparse.Namespace) -> dict[str, Any]:
    return vars(args) | {"out": str(args.out)}


if __name__ == "__main__":
    raise SystemExit(main())
