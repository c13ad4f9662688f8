"""``zeropp bench largest``: the deepest GPT of one width that constructs and trains two steps within a memory limit.

For each variant (zeropp with the model built on the meta device, built whole on every rank, with
the optimizer offloaded; FSDP2 with meta-device init), depths are tried from ``--depths`` in
increasing order inside a memory cgroup limited to ``--limit-gib`` (cgroup v1, root), so that running
out of memory kills the attempt and nothing else on the machine; the deepest depth that succeeds is
the answer. fp32, AdamW, ZeRO-3 without ZeRO++, one sequence of ``--block-size`` tokens per rank.

    zeropp bench largest [--world 4] [--d-model 2048] [--depths 8 12 16 20 24 28] [--limit-gib 20]
                         [--out results/bench_largest.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from zeropp.config import ModelConfig
from zeropp.models.gpt import gpt_config

CGROUP = Path("/sys/fs/cgroup/memory/zeropp-bench-largest")


def attempt(variant: str, world: int, depth: int, args: argparse.Namespace) -> bool:
    """Whether `variant` constructs and trains two steps at `depth` inside the memory limit."""
    from zeropp.benchmarks.memory import VARIANTS

    size = ["--n-layer", str(depth), "--d-model", str(args.d_model), "--block-size", str(args.block_size)]
    if variant == "FSDP2 meta":
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                   "-m", "zeropp.benchmarks.memory", "--fsdp2-worker", os.devnull, *size]  # fmt: skip
    else:
        command = [sys.executable, "-m", "zeropp.cli", "train", *size, "--n-head", str(args.d_model // 64),
                   "--micro-batch-size", "1", "--steps", "2", "--eval-interval", "3", "--eval-batches", "1",
                   "--stage", "3", "--no-quantized-weights", "--hpz-partition-size", "1", "--no-quantized-gradients",
                   "--nproc-per-node", str(world), "--nodes", "1",
                   *VARIANTS[variant]]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def enter_cgroup() -> None:
        (CGROUP / "cgroup.procs").write_text(str(os.getpid()))

    run = subprocess.run(command, env=env, preexec_fn=enter_cgroup, capture_output=True, timeout=args.timeout_s)
    return run.returncode == 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zeropp bench largest", description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--depths", type=int, nargs="+", default=[8, 12, 16, 20, 24, 28])
    parser.add_argument("--limit-gib", type=float, default=20.0)
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("--variants", nargs="+", default=["zeropp eager", "zeropp meta", "zeropp meta + offload", "FSDP2 meta"])
    parser.add_argument("--out", type=Path, default=Path("results/bench_largest.json"))
    args = parser.parse_args(argv)
    if not Path("/sys/fs/cgroup/memory").is_dir() or os.geteuid() != 0:
        print("zeropp bench largest: error: needs root and the cgroup v1 memory controller", file=sys.stderr)
        return 2
    CGROUP.mkdir(exist_ok=True)
    (CGROUP / "memory.limit_in_bytes").write_text(str(int(args.limit_gib * 2**30)))
    rows = []
    for variant in args.variants:
        largest = None
        for depth in sorted(args.depths):
            ok = attempt(variant, args.world, depth, args)
            params = gpt_config(ModelConfig(n_layer=depth, d_model=args.d_model, block_size=args.block_size)).param_count
            print(f"{variant}: depth {depth} ({params / 1e9:.2f}B parameters): {'trains' if ok else 'fails'}", flush=True)
            if not ok:
                break
            largest = {"depth": depth, "params": params}
        rows.append({"variant": variant, "largest": largest})
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"world": args.world, "limit_gib": args.limit_gib, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
