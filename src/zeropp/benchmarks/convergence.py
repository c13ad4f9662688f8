"""``zeropp bench convergence``: does ZeRO++ converge like ZeRO-3, and what does it send across nodes?

Trains the embedded GPT with ``zeropp train`` at stage 3, world 4 (2 simulated nodes x 2, gloo),
three ways, and compares validation loss and cross-node bytes:

- ZeRO-3 (every ZeRO++ switch off);
- ZeRO++ (qwZ int8 blocks of 256, hpZ over each node, qgZ int4 blocks of 256);
- ZeRO++ with per-tensor weight quantization (one scale per shard): the paper's Fig. 2 baseline.

    zeropp bench convergence [--steps 300] [--preset small] [--precision fp32] [--out results/bench_zeropp.json]

Prints a markdown table and writes the summaries as JSON.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from zeropp.benchmarks.runs import ZEROPP_OFF_FLAGS, ZEROPP_ON_FLAGS, train_summary

RUNS = {
    "ZeRO-3": ZEROPP_OFF_FLAGS,
    "ZeRO++": ZEROPP_ON_FLAGS,
    "ZeRO++ per-tensor weights": [*ZEROPP_ON_FLAGS, "--weight-quantization", "tensor"],
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="zeropp bench convergence", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--out", type=Path, default=Path("results/bench_zeropp.json"))
    args = parser.parse_args(argv)
    common = ["--stage", "3", "--steps", str(args.steps), "--preset", args.preset, "--precision", args.precision]
    common += ["--eval-interval", str(args.steps + 1), "--eval-batches", "32"]
    results = {name: train_summary([*common, *flags]) for name, flags in RUNS.items()}
    base = results["ZeRO-3"]
    print(f"steps {args.steps}, preset {args.preset}, {args.precision}, world 4 = 2 simulated nodes x 2\n")
    print("| run | final val loss | vs ZeRO-3 | final train loss | inter-node bytes/rank/step | vs ZeRO-3 | tokens/s |")
    print("|---|---|---|---|---|---|---|")
    for name, s in results.items():
        gap = s.final_val_loss / base.final_val_loss - 1
        volume = s.inter_node_bytes_per_step / base.inter_node_bytes_per_step
        print(
            f"| {name} | {s.final_val_loss:.4f} | {gap:+.2%} | {s.final_train_loss:.4f} | "
            f"{s.inter_node_bytes_per_step / 2**20:.3f} MiB | {volume:.3f}x | {s.tokens_per_s:,.0f} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    summaries = {name: s.as_dict() for name, s in results.items()}
    args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "results": summaries}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
