"""Benchmark: does ZeRO++ converge like ZeRO-3? Train the embedded GPT with zeropp train at world 4
(2 simulated nodes x 2, gloo) three ways and compare validation loss and cross-node bytes:

- ZeRO-3 (every ZeRO++ switch off);
- ZeRO++ (qwZ int8 blocks of 256, hpZ over each node, qgZ int4 blocks of 256);
- ZeRO++ with per-tensor weight quantization (one scale per shard): the paper's Fig. 2 baseline.

    python bench/bench_zeropp.py [--steps 300] [--preset small] [--precision fp32] [--out results/bench_zeropp.json]

Prints a markdown table and writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

RUNS = {
    "ZeRO-3": ["--no-quantized-weights", "--hpz-partition-size", "1", "--no-quantized-gradients"],
    "ZeRO++": [],
    "ZeRO++ per-tensor weights": ["--weight-quantization", "tensor"],
}


def train(flags: list[str], steps: int, preset: str, precision: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "summary.json"
        cmd = ["zeropp", "train", "--stage", "3", "--steps", str(steps), "--preset", preset]
        cmd += ["--precision", precision, "--eval-interval", str(steps + 1), "--eval-batches", "32"]
        subprocess.run([*cmd, *flags, "--summary-json", str(out)], check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--out", type=Path, default=Path("results/bench_zeropp.json"))
    args = parser.parse_args()
    results = {name: train(flags, args.steps, args.preset, args.precision) for name, flags in RUNS.items()}
    base = results["ZeRO-3"]
    print(f"steps {args.steps}, preset {args.preset}, {args.precision}, world 4 = 2 simulated nodes x 2\n")
    print("| run | final val loss | vs ZeRO-3 | final train loss | inter-node bytes/rank/step | vs ZeRO-3 | tokens/s |")
    print("|---|---|---|---|---|---|---|")
    for name, s in results.items():
        gap = s["final_val_loss"] / base["final_val_loss"] - 1
        volume = s["inter_node_bytes_per_step"] / base["inter_node_bytes_per_step"]
        print(
            f"| {name} | {s['final_val_loss']:.4f} | {gap:+.2%} | {s['final_train_loss']:.4f} | "
            f"{s['inter_node_bytes_per_step'] / 2**20:.3f} MiB | {volume:.3f}x | {s['tokens_per_s']:,.0f} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "results": results}, indent=2))


if __name__ == "__main__":
    main()
