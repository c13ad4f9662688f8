"""``zeropp bench moe``: a mixture-of-experts GPT at stage 3 without expert parallelism (E 1) against E 2 and E 4.

``zeropp train`` runs the embedded GPT whose blocks' MLPs are mixtures of ``--experts`` experts (top
``--top-k``) at ``--world`` ranks on one node, once per E of ``--ep``, for ``--rounds`` rounds (each
round in turn starts at the next variant). Every variant runs plain ZeRO-3 (qwZ, hpZ and qgZ off),
so only E differs. Reported per E: the median step time (the summary's, steps after the first) over
the rounds with its spread, the ratio to E 1's time in the same round, all-gather and all-to-all
bytes per step and rank (the ledger's, forward and backward; reduce-scatter's in the results file)
beside ``zeropp estimate``'s (:func:`predicted`: the all-to-all for routing spread evenly), model-state bytes
per rank (measured and the summary's analytic) and peak memory per rank. The CPU model (``lscpu``)
and the date go with the results.

    zeropp bench moe [--preset small] [--experts 8] [--top-k 2] [--world 4] [--ep 1 2 4] [--steps 8]
                     [--rounds 3] [--micro-batch-size 4] [--block-size N] [--out results/bench_moe.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from zeropp.tools.bench.runs import cpu_model, output_file, train_summary

OPS = ("all_gather", "ep.all_to_all")
PLAIN_ZERO3 = ["--stage", "3", "--no-quantized-weights", "--hpz-partition-size", "1", "--no-quantized-gradients"]
MB = 1e6


def predicted(args: argparse.Namespace, ep: int) -> dict[str, float]:
    """``zeropp estimate``'s bytes per step and rank of variant E = `ep` (its ledger's all-gather, and the
    all-to-all for routing spread evenly over the experts)."""
    from zeropp.config.model import ModelConfig
    from zeropp.config.sections import ZeroConfig
    from zeropp.tools.estimate import estimate
    from zeropp.tools.estimate.gpt import gpt_activations, gpt_expert_unit_numels, gpt_experts, gpt_unit_numels

    model = ModelConfig(preset=args.preset, n_experts=args.experts, top_k=args.top_k, block_size=args.block_size)
    zero = ZeroConfig(stage=3, quantized_weights=False, hpz_partition_size=1, quantized_gradients=False)
    est = estimate(
        gpt_unit_numels(model), args.world, 1, zero, experts=gpt_experts(model, ep),
        expert_units=gpt_expert_unit_numels(model), activations=gpt_activations(model, args.micro_batch_size),
    )  # fmt: skip
    ledger = est.ledger().as_dict()
    return {op: sum(sum(links.values()) for links in ledger.get(op, {}).values()) for op in OPS}


def _ledger(summary: Any, op: str) -> dict[str, float]:
    phases = summary.ledger.get(op, {})
    return {phase: sum(phases.get(phase, {}).values()) for phase in ("forward", "backward")}


def train_args(args: argparse.Namespace, ep: int) -> list[str]:
    """``zeropp train`` flags of the variant with expert parallelism E = `ep`."""
    flags = [
        "--preset", args.preset, "--n-experts", str(args.experts), "--top-k", str(args.top_k), "--nodes", "1",
        "--nproc-per-node", str(args.world), "--expert-parallel-size", str(ep), "--steps", str(args.steps),
        "--micro-batch-size", str(args.micro_batch_size), "--eval-batches", "1", *PLAIN_ZERO3,
    ]  # fmt: skip
    return flags + (["--block-size", str(args.block_size)] if args.block_size else [])


def measure(args: argparse.Namespace, ep: int) -> dict[str, Any]:
    """One ``zeropp train`` run of variant E = `ep`: what the table needs of its summary."""
    summary = train_summary(train_args(args, ep))
    return dict(
        step_time_s=summary.median_step_time_s, all_gather=_ledger(summary, "all_gather"),
        reduce_scatter=_ledger(summary, "reduce_scatter"), all_to_all=_ledger(summary, "ep.all_to_all"),
        counts_all_gather=_ledger(summary, "ep.all_gather"),
        model_state_bytes_per_rank=summary.model_state_bytes_per_rank,
        analytic_model_state_bytes_per_rank=summary.analytic_model_state_bytes_per_rank,
        peak_memory_bytes_per_rank=summary.peak_memory_bytes_per_rank,
        step_peak_memory_bytes_per_rank=summary.step_peak_memory_bytes_per_rank,
        final_train_loss=summary.final_train_loss,
    )  # fmt: skip


def rows(runs: list[dict[int, dict[str, Any]]], args: argparse.Namespace) -> dict[int, dict[str, Any]]:
    """Per E: step times and their ratio to E 1's in each round, medians, bytes beside their formulas."""
    out = {}
    for ep in args.ep:
        done = [run for run in runs if ep in run and 1 in run]
        times = [run[ep]["step_time_s"] for run in done]
        ratios = [run[ep]["step_time_s"] / run[1]["step_time_s"] for run in done]
        last = done[-1][ep]
        out[ep] = dict(
            step_times_s=times, median_step_time_s=statistics.median(times), ratios_to_e1=ratios,
            median_ratio_to_e1=statistics.median(ratios), all_gather_bytes=last["all_gather"],
            predicted_all_gather_bytes=predicted(args, ep)["all_gather"],
            reduce_scatter_bytes=last["reduce_scatter"], all_to_all_bytes=last["all_to_all"],
            predicted_all_to_all_bytes=predicted(args, ep)["ep.all_to_all"],
            counts_all_gather_bytes=last["counts_all_gather"],
            model_state_bytes_per_rank=last["model_state_bytes_per_rank"],
            analytic_model_state_bytes_per_rank=last["analytic_model_state_bytes_per_rank"],
            peak_memory_bytes_per_rank=last["peak_memory_bytes_per_rank"],
            step_peak_memory_bytes_per_rank=last["step_peak_memory_bytes_per_rank"],
            final_train_losses=[run[ep]["final_train_loss"] for run in done],
        )  # fmt: skip
    return out


def _spread(values: list[float], scale: float, digits: int) -> str:
    median = statistics.median(values) * scale
    return f"{median:.{digits}f} ({min(values) * scale:.{digits}f}-{max(values) * scale:.{digits}f})"


def markdown(table: dict[int, dict[str, Any]]) -> str:
    """The results as two markdown tables: time, bytes and memory per E; all-gather and all-to-all against their formulas."""
    lines = [
        "| E | step ms, median (min-max) | / E 1, same round | all-gather MB/step/rank | all-to-all MB/step/rank "
        "| model states MB/rank (analytic) | peak MB/rank (steps' peak above start) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for ep, row in table.items():
        gathered, moved = sum(row["all_gather_bytes"].values()), sum(row["all_to_all_bytes"].values())
        lines.append(
            f"| {ep} | {_spread(row['step_times_s'], 1e3, 0)} | {_spread(row['ratios_to_e1'], 1, 2)} | "
            f"{gathered / MB:.2f} | {moved / MB:.2f} | {max(row['model_state_bytes_per_rank']) / MB:.2f} "
            f"({row['analytic_model_state_bytes_per_rank'] / MB:.2f}) | {max(row['peak_memory_bytes_per_rank']) / MB:.0f} "
            f"({max(row['step_peak_memory_bytes_per_rank']) / MB:.0f}) |"
        )
    lines += [
        "",
        "| E | all-gather bytes: measured | zeropp estimate | measured / estimate | all-to-all bytes: measured "
        "(forward + backward) | zeropp estimate (routing spread evenly) | measured / estimate |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for ep, row in table.items():
        gathered, predicted_gather = sum(row["all_gather_bytes"].values()), row["predicted_all_gather_bytes"]
        moved, uniform = row["all_to_all_bytes"], row["predicted_all_to_all_bytes"]
        lines.append(
            f"| {ep} | {gathered:,.0f} | {predicted_gather:,.0f} | {gathered / predicted_gather:.4f} | "
            f"{sum(moved.values()):,.0f} ({moved['forward']:,.0f} + {moved['backward']:,.0f}) | {uniform:,.0f} | "
            + (f"{sum(moved.values()) / uniform:.3f} |" if uniform else "- |")
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zeropp bench moe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=("tiny", "small", "medium"), default="small")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4], help="expert-parallel sizes; 1 included")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=None, help="unset: the preset's")
    parser.add_argument("--out", type=Path, default=Path("results/bench_moe.json"))
    args = parser.parse_args(argv)
    if 1 not in args.ep or any(args.world % ep or args.experts % ep for ep in args.ep):
        parser.error(f"--ep {args.ep}: expected 1 and divisors of --world {args.world} and --experts {args.experts}")
    args.out = output_file(parser, args.out, "bench_moe.json")
    when, cpu = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"), cpu_model()
    from zeropp.app.launch import usable_cpus

    command = shlex.join(["zeropp", "bench", "moe", *(argv if argv is not None else [])])
    print(
        f"{cpu}, {usable_cpus()} CPUs, {when}; GPT {args.preset}, {args.experts} experts top {args.top_k}, world {args.world}"
    )
    runs: list[dict[int, dict[str, Any]]] = []
    for r in range(args.rounds):
        order = args.ep[r % len(args.ep) :] + args.ep[: r % len(args.ep)]
        runs.append({})
        for ep in order:
            runs[-1][ep] = measure(args, ep)
            print(f"round {r + 1}, E {ep}: {runs[-1][ep]['step_time_s'] * 1e3:.0f} ms per step", flush=True)
        table = rows(runs, args)
        record = dict(
            cpu=cpu, cpus=usable_cpus(), date=when, command=command, options=vars(args) | {"out": str(args.out)},
            train_flags={ep: train_args(args, ep) for ep in args.ep}, rounds=runs, variants=table,
        )  # fmt: skip
        args.out.write_text(json.dumps(record, indent=1))
    print(markdown(table))
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
