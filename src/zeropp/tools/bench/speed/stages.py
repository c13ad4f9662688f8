"""``zeropp bench stages``: step time and tokens/s of ZeRO stages 0-3, and stage 3's overhead at world 1.

Stages 0-3 train the embedded GPT with ``zeropp train`` at world 4 (2 simulated nodes x 2, gloo);
at world 1, plain PyTorch and zeropp stage 3 time the same model on the same batches in this process.

    zeropp bench stages [--steps 30] [--preset small] [--out results/bench_stages.json]

Prints a markdown table and writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from zeropp.app.launch import usable_cpus
from zeropp.tools.bench.runs import output_file, train_summary

ROW_FIELDS = (
    "stage", "median_step_time_s", "tokens_per_s", "param_count", "intra_node_bytes_per_step",
    "inter_node_bytes_per_step",
)  # fmt: skip


def world4_stage(stage: int, steps: int, preset: str) -> dict[str, Any]:
    """One row of the table: `stage` at world 4, from its run summary."""
    flags = ["--stage", str(stage), "--steps", str(steps), "--preset", preset]
    s = train_summary([*flags, "--eval-interval", str(steps + 1), "--eval-batches", "1"])
    return {k: getattr(s, k) for k in ROW_FIELDS} | {"model_state_bytes_per_rank": s.model_state_bytes_per_rank[0]}


def world1_overhead(steps: int, preset: str) -> dict[str, float]:
    """Median step time of plain PyTorch vs zeropp stage 3 on one process, same model and batches."""
    from zeropp.app.data.batches import Batches
    from zeropp.app.models.gpt import GPT, PRESETS
    from zeropp.config.sections import TopologyConfig, ZeroConfig
    from zeropp.engine import ZeroEngine
    from zeropp.topology import init_topology

    torch.set_num_threadsusable_cpus()
    config = PRESETS[preset]
    batches = Batches("train", config.block_size, 8, 1, 0, seed=0)

    def timed(forward_backward_step) -> float:
        times = []
        for step in range(steps):
            x, y = batches.local_batch(step)
            tick = time.perf_counter()
            forward_backward_step(x, y)
            times.append(time.perf_counter() - tick)
        return statistics.median(times[2:])

    torch.manual_seed(0)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def plain(x, y):
        optimizer.zero_grad(set_to_none=True)
        model(x, y).backward()
        optimizer.step()

    plain_s = timed(plain)
    torch.manual_seed(0)
    engine = ZeroEngine(
        GPT(config), torch.optim.AdamW, dict(lr=1e-3), ZeroConfig(stage=3), init_topology(TopologyConfig())
    )

    def zero3(x, y):
        engine.backward(engine(x, y))
        engine.step()

    zero_s = timed(zero3)
    return {"plain_pytorch_step_s": plain_s, "zeropp_stage3_step_s": zero_s, "ratio": zero_s / plain_s}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="zeropp bench stages", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--out", type=Path, default=Path("results/bench_stages.json"))
    args = parser.parse_args(argv)
    args.out = output_file(parser, args.out, "bench_stages.json")

    rows = [world4_stage(stage, args.steps, args.preset) for stage in range(4)]
    overhead = world1_overhead(args.steps, args.preset)
    results = {
        "machine": f"{usable_cpus()} CPU cores, torch {torch.__version__}, gloo",
        "preset": args.preset,
        "steps": args.steps,
        "world4_2nodes": rows,
        "world1_stage3_vs_plain": overhead,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))

    print(
        f"## zeropp stages on the embedded GPT ({args.preset}, {rows[0]['param_count']:,} params), "
        f"world 4 = 2 simulated nodes x 2, {results['machine']}\n"
    )
    print("| stage | median step (s) | tokens/s | sent/rank/step intra | inter | model states/rank |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['stage']} | {r['median_step_time_s']:.3f} | {r['tokens_per_s']:,.0f} | "
            f"{r['intra_node_bytes_per_step'] / 2**20:.2f} MiB | {r['inter_node_bytes_per_step'] / 2**20:.2f} MiB | "
            f"{r['model_state_bytes_per_rank'] / 2**20:.2f} MiB |"
        )
    o = overhead
    print(
        f"\nworld 1: plain PyTorch {o['plain_pytorch_step_s'] * 1e3:.1f} ms/step, zeropp stage 3 "
        f"{o['zeropp_stage3_step_s'] * 1e3:.1f} ms/step, ratio {o['ratio']:.3f} (goal <= 1.15)"
    )
    print(f"\nwritten to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
