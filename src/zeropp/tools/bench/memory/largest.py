"""``zeropp bench largest``: the deepest GPT of one width that constructs and trains two steps within a memory limit.

For each variant (zeropp with the model built on the meta device, built whole on every rank, with
the optimizer offloaded to host memory, with the optimizer on disk (``--offload-path``, the disk
tier), with the parameters on disk too, with Adam's moments in bf16; FSDP2 with meta-device init;
DeepSpeed ZeRO-3 with ``zero.Init``), depths
are tried from ``--depths`` in increasing order inside a memory cgroup limited to ``--limit-gib``
(cgroup v1, root), so that running out of memory kills the attempt and nothing else on the machine;
the deepest depth that succeeds is the answer, and the first failure's cause is recorded (out of
memory, timeout, or the error's last line) with the cgroup's peak usage, the page cache charged to it
at the end (each attempt starts from none), the steps per second, and
for the disk tiers the bytes they read and wrote per step. AdamW, ZeRO-3 without ZeRO++, one sequence of ``--block-size``
tokens per rank, zeropp in ``--precision`` (fp32 by default; the rivals in fp32).

    zeropp bench largest [--world 4] [--d-model 2048] [--depths 8 12 16 20 24 28] [--limit-gib 20]
                         [--precision fp32] [--max-grad-norm N] [--offload-path results/offload]
                         [--out results/bench_largest.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from zeropp.app.models.gpt import gpt_config
from zeropp.app.summary import RunSummary
from zeropp.config.model import ModelConfig
from zeropp.tools.bench.memory.peak import VARIANTS
from zeropp.tools.bench.memory.rivals import RIVALS, worker_command, worker_env
from zeropp.tools.bench.runs import ZEROPP_OFF_FLAGS, cpu_model, output_file

CGROUP = Path("/sys/fs/cgroup/memory/zeropp-bench-largest")
ZEROPP_VARIANTS = {  # the memory tiers: in memory, host offload, the disk tiers, and bf16 moments
    **VARIANTS,
    "zeropp meta + nvme offload": ["--offload-optimizer", "nvme"],
    "zeropp meta + nvme offload + nvme params": ["--offload-optimizer", "nvme", "--offload-params", "nvme"],
    "zeropp meta + bf16 states": ["--optimizer-state-dtype", "bf16"],
}


def command(variant: str, world: int, depth: int, args: argparse.Namespace) -> list[str]:
    size = ["--n-layer", str(depth), "--d-model", str(args.d_model), "--block-size", str(args.block_size)]
    if variant in RIVALS:
        return worker_command(variant, os.devnull, world, size, steps=2)
    return [sys.executable, "-m", "zeropp.cli", "train", *size, "--n-head", str(args.d_model // 64),
            "--micro-batch-size", "1", "--steps", "2", "--eval-interval", "3", "--eval-batches", "1",
            "--stage", "3", *ZEROPP_OFF_FLAGS, "--nproc-per-node", str(world), "--nodes", "1",
            "--precision", args.precision, *ZEROPP_VARIANTS[variant],
            *(["--max-grad-norm", str(args.max_grad_norm)] if args.max_grad_norm is not None else []),
            *(["--offload-path", str(args.offload_path)] if "nvme" in ZEROPP_VARIANTS[variant] else [])]  # fmt: skip


def attempt(variant: str, world: int, depth: int, args: argparse.Namespace) -> dict[str, Any]:
    """:func:`run_limited` for `variant` at `depth` (zeropp's runs read back from their summary)."""
    return run_limited(command(variant, world, depth, args), world, args.timeout_s, summary=variant not in RIVALS)


def run_limited(cmd: list[str], world: int, timeout_s: float, summary: bool = True) -> dict[str, Any]:
    """Whether `cmd` constructs and trains two steps inside the cgroup's memory limit, and if not
    why: ``out of memory`` (the cgroup's OOM killer fired), ``timeout`` or ``error: <last line>``;
    with the cgroup's peak usage and the wall time, and for a ``zeropp train`` (`summary`) the median
    step time, each rank's step peak and the disk tier's bytes read and written per step (rank 0)."""
    summary_path = Path(tempfile.mkdtemp()) / "summary.json"
    kills_before = oom_kills()
    (CGROUP / "memory.force_empty").write_text("0")  # the page cache charged by earlier attempts, reclaimed
    (CGROUP / "memory.max_usage_in_bytes").write_text("0")
    start = time.perf_counter()

    def enter_cgroup() -> None:
        (CGROUP / "cgroup.procs").write_text(str(os.getpid()))

    try:
        run = subprocess.run(
            cmd + (["--summary-json", str(summary_path)] if summary else []),
            env={**worker_env(world), "OMP_NUM_THREADS": "1"},
            preexec_fn=enter_cgroup, capture_output=True, text=True, timeout=timeout_s, start_new_session=True,
        )  # fmt: skip
        failure = None if run.returncode == 0 else "error: " + (run.stderr.strip().splitlines() or ["?"])[-1][:200]
    except subprocess.TimeoutExpired:
        kill_cgroup()
        failure = "timeout"
    if failure is not None and oom_kills() > kills_before:
        failure = "out of memory"
    result = {
        "outcome": failure or "trains",
        "seconds": round(time.perf_counter() - start, 1),
        "peak_gib": round(int((CGROUP / "memory.max_usage_in_bytes").read_text()) / 2**30, 2),
        "page_cache_mib_end": round(cgroup_stat("total_cache") / 2**20, 1),  # charged to the cgroup, at the end
    }
    if failure is None and summary_path.exists():
        summary = RunSummary.from_json(summary_path.read_text())
        result["median_step_s"] = round(summary.median_step_time_s, 2)
        result["steps_per_s"] = round(1 / summary.median_step_time_s, 3)
        result["step_peak_mib_per_rank"] = [round(b / 2**20, 1) for b in summary.step_peak_memory_bytes_per_rank]
        if any(any(io) for io in summary.disk_bytes_per_step_per_rank):
            result["disk_read_gib_per_step"], result["disk_written_gib_per_step"] = (
                round(b / 2**30, 3) for b in summary.disk_bytes_per_step_per_rank[0]
            )
    shutil.rmtree(summary_path.parent, ignore_errors=True)
    return result


def limit_cgroup(limit_bytes: int) -> None:
    """The benchmarks' memory cgroup (cgroup v1, made once), its limit set."""
    CGROUP.mkdir(exist_ok=True)
    (CGROUP / "memory.limit_in_bytes").write_text(str(limit_bytes))


def cgroup_stat(field: str) -> int:
    return int(dict(line.split() for line in (CGROUP / "memory.stat").read_text().splitlines())[field])


def oom_kills() -> int:
    fields = dict(line.split() for line in (CGROUP / "memory.oom_control").read_text().splitlines())
    return int(fields.get("oom_kill", 0))


def kill_cgroup() -> None:
    """Kill whatever an attempt left in the cgroup (torchrun's ranks outlive a killed launcher)."""
    for pid in (CGROUP / "cgroup.procs").read_text().split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zeropp bench largest", description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--depths", type=int, nargs="+", default=[8, 12, 16, 20, 24, 28])
    parser.add_argument("--limit-gib", type=float, default=20.0)
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="zeropp's compute dtype")
    parser.add_argument("--max-grad-norm", type=float, default=None, help="zeropp's gradient clipping (default: none)")
    parser.add_argument("--offload-path", type=Path, default=Path("results/offload"), help="the disk tier's folder")
    parser.add_argument(
        "--variants", nargs="+", choices=[*ZEROPP_VARIANTS, *RIVALS], default=[*ZEROPP_VARIANTS, *RIVALS]
    )
    parser.add_argument("--out", type=Path, default=Path("results/bench_largest.json"))
    args = parser.parse_args(argv)
    args.out = output_file(parser, args.out, "bench_largest.json")
    args.offload_path.mkdir(parents=True, exist_ok=True)
    if not Path("/sys/fs/cgroup/memory").is_dir() or os.geteuid() != 0:
        print("zeropp bench largest: error: needs root and the cgroup v1 memory controller", file=sys.stderr)
        return 2
    limit_cgroup(int(args.limit_gib * 2**30))
    rows = []
    for variant in args.variants:
        largest, tried = None, []
        for depth in sorted(args.depths):
            params = gpt_config(
                ModelConfig(n_layer=depth, d_model=args.d_model, block_size=args.block_size)
            ).param_count
            result = {"depth": depth, "params": params, **attempt(variant, args.world, depth, args)}
            tried.append(result)
            disk = (f", disk {result['disk_read_gib_per_step']:.2f} GiB read / {result['disk_written_gib_per_step']:.2f} "
                    "GiB written per step") if "disk_read_gib_per_step" in result else ""  # fmt: skip
            rate = f", {result['steps_per_s']:.3f} steps/s" if "steps_per_s" in result else ""
            print(f"{variant}: depth {depth} ({params / 1e9:.2f}B parameters): {result['outcome']} "
                  f"({result['seconds']:.0f} s, cgroup peak {result['peak_gib']:.2f} GiB, page cache at the end "
                  f"{result['page_cache_mib_end']:.0f} MiB{rate}{disk})", flush=True)  # fmt: skip
            if result["outcome"] != "trains":
                break
            largest = {"depth": depth, "params": params}
        rows.append({"variant": variant, "largest": largest, "attempts": tried})
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"world": args.world, "limit_gib": args.limit_gib, "precision": args.precision,
                                        "max_grad_norm": args.max_grad_norm, "block_size": args.block_size,
                                        "cpu": cpu_model(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                        "rows": rows}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
