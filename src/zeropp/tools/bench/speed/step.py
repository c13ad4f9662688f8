"""``zeropp bench step``: the training step against plain PyTorch, FSDP2 and DeepSpeed ZeRO-3, at world 1 and 4.

Every variant trains the same embedded GPT (``--n-layer`` x ``--d-model``, ``--block-size`` tokens a
sequence, ``--micro-batch-size`` sequences per rank, fp32, AdamW, the same initial weights and batches)
in its own ``torchrun`` job on this machine (gloo; world 4 = 2 simulated nodes x 2):

- ``pytorch``: the model and the optimizer, nothing else (DDP at world > 1);
- ``zeropp-0`` .. ``zeropp-3``: :class:`~zeropp.ZeroEngine` at that stage, ZeRO++ off;
- ``zeropp++``: stage 3 with qwZ, hpZ over each node and qgZ (``ZEROPP_SWITCHES``);
- ``fsdp2``: ``fully_shard`` per block and on the root;
- ``deepspeed-zero3``: DeepSpeed ZeRO-3 (``DS_ACCELERATOR=cpu``), when it is installed;
- with ``--compile``, ``pytorch-compiled`` and ``zeropp-3-compiled``: every block's forward through
  ``torch.compile`` (inductor), the step otherwise the same;
- ``zeropp-3-md`` (named in ``--variants``): stage 3 with MD (``contiguous_memory_optimization``), so
  the gradient buffers are ranges of one buffer kept across steps instead of fresh allocations;
- the optimizer's paths (named in ``--variants``), against ``zeropp-3`` (AdamW in one group on the
  shards' segments, See [Note: segments]): ``zeropp-3-flat``, the same on one flat tensor per shard
  (``zero.optimizer_path = "flat"``); ``zeropp-3-groups``, AdamW in two groups (matrices decayed, the
  rest not) on the segments, and ``zeropp-3-groups-whole`` the same on whole parameters on owner
  ranks (See [Note: the whole-parameter step]); ``zeropp-3-muon``, Muon for the blocks' matrices with
  AdamW for the rest (whole parameters).

The variants alternate: each repetition runs every variant once (``--steps`` steps), in an order
rotated by one per repetition, so a change in the machine's load reaches every variant alike. Per
variant: the median step time over every repetition's steps after the first ``--warmup`` of each
job, tokens/s from it, and the peak resident memory per rank (``VmHWM`` after a reset once the
variant is built, above the process's resident set before the model existed; glibc's mmap threshold
pinned as in ``zeropp bench memory``). Ratios are to ``pytorch`` at the same world size. The load
average of the machine is recorded before every job. Beside the wall-clock time, the CPU time a
rank spent per step (its process, every thread: ``time.process_time``; the median over the same
steps of the mean over ranks): with more ranks than cores the step time also holds the waits for
the other ranks to be scheduled, which the load of other jobs stretches, while the CPU time is
the work the variant asked of the machine.

    zeropp bench step [--worlds 1 4] [--n-layer 12] [--d-model 512] [--block-size 256] [--steps 6]
                      [--reps 2] [--compile] [--variants ...] [--out results/bench_step.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import torch

from zeropp.app.launch import usable_cpus
from zeropp.tools.bench.runs import output_file

BASE_VARIANTS = ("pytorch", "zeropp-0", "zeropp-1", "zeropp-2", "zeropp-3", "zeropp++", "fsdp2", "deepspeed-zero3")
COMPILED_VARIANTS = ("pytorch-compiled", "zeropp-3-compiled")
MD_VARIANTS = ("zeropp-3-md",)
OPTIMIZER_VARIANTS = ("zeropp-3-flat", "zeropp-3-groups", "zeropp-3-groups-whole", "zeropp-3-muon")
PATHS = {"zeropp-3-flat": "flat", "zeropp-3-groups-whole": "whole"}  # variant -> zero.optimizer_path
RANK_ERROR = re.compile(r"^\[rank\d+\]: [\w.]*(Error|Exception)\b")  # a rank's exception, as torchrun prints it
NODES_AT = {4: 2}  # world size -> simulated nodes (hpZ and qgZ's two hops need more than one)


def build_step(variant: str, gpt: torch.nn.Module, topology: Any, args: argparse.Namespace) -> Callable:
    """`variant`'s training step (forward, backward, optimizer step) on (x, y); returns the loss."""
    from zeropp.config.sections import ZEROPP_SWITCHES, ZeroConfig
    from zeropp.engine import ZeroEngine
    from zeropp.tools.bench.rivals import adamw, engine_step, training_step

    compiled, md = variant.endswith("-compiled"), variant.endswith("-md")
    name = variant.removesuffix("-compiled").removesuffix("-md")
    if name in OPTIMIZER_VARIANTS:
        config = ZeroConfig(stage=3, optimizer_path=PATHS.get(name, "auto"))
        optimizer = user_optimizers(name.removesuffix("-whole"), gpt, args.lr)
        return engine_step(ZeroEngine(gpt, optimizer, None, config, topology, seed=0))
    if name.startswith("zeropp"):
        stage = 3 if name == "zeropp++" else int(name.removeprefix("zeropp-"))
        switches = ZEROPP_SWITCHES if name == "zeropp++" else {}
        config = ZeroConfig(stage=stage, compile=compiled, contiguous_memory_optimization=md, **switches)
        return engine_step(ZeroEngine(gpt, torch.optim.AdamW, adamw(args.lr), config, topology, seed=0))
    from zeropp.zero.grouping import repeated_blocks
    from zeropp.zero.materialize import initialize_model

    initialize_model(gpt, repeated_blocks(gpt), seed=0)  # the weights the zeropp variants start from
    if compiled:
        for block in gpt.blocks:
            block.forward = torch.compile(block.forward)
    rival = "ddp" if name == "pytorch" and topology.world_size > 1 else name
    return training_step(gpt, rival, topology.world_size, topology.ranks_per_node, args.micro_batch_size, args.lr)


def user_optimizers(variant: str, gpt: torch.nn.Module, lr: float) -> list[torch.optim.Optimizer]:
    """The optimizers of an OPTIMIZER_VARIANTS variant, built on the (meta-device) model's parameters."""
    from zeropp.tools.bench.rivals import adamw

    named = list(gpt.named_parameters())
    if variant == "zeropp-3-flat":
        return [torch.optim.AdamW(gpt.parameters(), **adamw(lr))]
    if variant == "zeropp-3-groups":
        matrices, rest = [p for _, p in named if p.dim() == 2], [p for _, p in named if p.dim() != 2]
        decay = adamw(lr)["weight_decay"]
        groups = [{"params": matrices, "weight_decay": decay}, {"params": rest, "weight_decay": 0.0}]
        return [torch.optim.AdamW(groups, **{**adamw(lr), "weight_decay": decay})]
    hidden = [p for n, p in named if n.startswith("blocks") and p.dim() == 2]
    rest = [p for n, p in named if not (n.startswith("blocks") and p.dim() == 2)]
    return [torch.optim.Muon(hidden, lr=20 * lr, momentum=0.95), torch.optim.AdamW(rest, **adamw(lr))]


def worker(args: argparse.Namespace) -> None:
    """One rank of one variant's job; rank 0 writes step times, losses and every rank's peak."""
    from zeropp.app.data.batches import Batches
    from zeropp.app.models.gpt import GPT, gpt_config
    from zeropp.comm.communicator import Communicator
    from zeropp.config.sections import TopologyConfig
    from zeropp.costs.memory import PeakMeter
    from zeropp.topology import init_topology, shutdown

    if args.worker.startswith("deepspeed"):
        import deepspeed  # noqa: F401  (imported before the baseline: the library is not the model's memory)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    topology = init_topology(TopologyConfig(backend="gloo", nodes=NODES_AT.get(world, 1)))
    config = gpt_config(model_config(args))
    meter = PeakMeter(torch.device("cpu"))
    with torch.device("meta"):
        gpt = GPT(config)
    train_step = build_step(args.worker, gpt, topology, args)
    meter.reset_peak()
    batches = Batches("train", config.block_size, args.micro_batch_size, topology.world_size, topology.rank, seed=0)
    times, cpu_times, losses = [], [], []
    for step in range(args.steps):
        x, y = batches.local_batch(step)
        tick, cpu_tick = time.perf_counter(), time.process_time()
        losses.append(train_step(x, y).item())
        times.append(time.perf_counter() - tick)
        cpu_times.append(time.process_time() - cpu_tick)
    peaks = torch.zeros(topology.world_size)
    comm = Communicator(topology)
    comm.all_gather(peaks, torch.tensor([float(meter.peak())]), topology.world, bucket_numel=1)
    cpu = torch.zeros(topology.world_size, args.steps, dtype=torch.float64)
    comm.all_gather(cpu, torch.tensor(cpu_times, dtype=torch.float64), topology.world, bucket_numel=args.steps)
    if topology.rank == 0:
        record = {"times": times, "cpu_times": cpu.mean(0).tolist(), "losses": losses, "peaks": peaks.tolist()}
        Path(args.worker_out).write_text(json.dumps(record))
    shutdown()


def model_config(args: argparse.Namespace) -> Any:
    from zeropp.config.model import ModelConfig

    heads = max(1, args.d_model // 64)
    return ModelConfig(n_layer=args.n_layer, d_model=args.d_model, n_head=heads, block_size=args.block_size)


def threads_per_rank(args: argparse.Namespace, world: int) -> int:
    return args.threads or max(1, usable_cpus() // world)


def run_job(variant: str, world: int, args: argparse.Namespace) -> dict[str, Any]:
    """`variant` at `world` ranks in one torchrun job; its worker's record, or why it failed."""
    size = ["--n-layer", str(args.n_layer), "--d-model", str(args.d_model), "--block-size", str(args.block_size)]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "record.json"
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
            "-m", "zeropp.tools.bench.speed.step", "--worker", variant, "--worker-out", str(out), *size,
            "--steps", str(args.steps), "--micro-batch-size", str(args.micro_batch_size), "--lr", str(args.lr),
        ]  # fmt: skip
        env = {
            **os.environ,
            "OMP_NUM_THREADS": str(threads_per_rank(args, world)),
            "DS_ACCELERATOR": "cpu",
            "MALLOC_MMAP_THRESHOLD_": "131072",
        }
        load = os.getloadavg()[0]
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0 or not out.is_file():
            lines = [line for line in done.stderr.splitlines() if RANK_ERROR.match(line)] or [f"exit {done.returncode}"]
            return {"failed": lines[0].split("]: ", 1)[-1].strip()[:300], "load_1min": load}
        return json.loads(out.read_text()) | {"load_1min": load}


def summarize(records: list[dict[str, Any]], world: int, args: argparse.Namespace) -> dict[str, Any]:
    """One row from a variant's jobs: median step over every job's steps after the warm-up."""
    loads = [r["load_1min"] for r in records]
    failed = [r["failed"] for r in records if "failed" in r]
    if failed:
        return {"failed": failed[0], "load_1min": loads}
    times = [t for r in records for t in r["times"][args.warmup :]]
    median = statistics.median(times)
    return {
        "median_step_time_s": median,
        "median_cpu_time_s_per_rank": statistics.median(t for r in records for t in r["cpu_times"][args.warmup :]),
        "tokens_per_s": args.micro_batch_size * args.block_size * world / median,
        "peak_memory_bytes_per_rank": max(max(r["peaks"]) for r in records),
        "first_loss": records[0]["losses"][0],
        "last_loss": records[0]["losses"][-1],
        "step_times_s": times,
        "load_1min": loads,
    }


def markdown(rows: dict[str, dict[str, Any]], world: int) -> str:
    base = rows.get("pytorch", {})
    lines = [
        f"| world {world} | median step (ms) | tokens/s | vs PyTorch | CPU/rank/step (ms) | peak RSS/rank (MiB) | vs PyTorch | loss 1st → last |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        if "failed" in r:
            lines.append(f"| {name} | failed: {r['failed']} | | | | | | |")
            continue
        step, peak = r["median_step_time_s"], r["peak_memory_bytes_per_rank"]
        vs_time = f"{step / base['median_step_time_s']:.3f}x" if "median_step_time_s" in base else "n/a"
        vs_peak = f"{peak / base['peak_memory_bytes_per_rank']:.2f}x" if "median_step_time_s" in base else "n/a"
        lines.append(
            f"| {name} | {step * 1e3:.1f} | {r['tokens_per_s']:,.0f} | {vs_time} | {r['median_cpu_time_s_per_rank'] * 1e3:.1f} | "
            f"{peak / 2**20:,.0f} | {vs_peak} | "
            f"{r['first_loss']:.4f} → {r['last_loss']:.4f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="zeropp bench step", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 4], choices=[1, 2, 4])
    parser.add_argument("--n-layer", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=6, help="steps per job (each variant runs --reps jobs)")
    parser.add_argument("--warmup", type=int, default=1, help="steps left out of the median at the start of each job")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, help="threads per rank (default: the cores divided by the world size)")
    parser.add_argument("--compile", action="store_true", help="add pytorch-compiled and zeropp-3-compiled (inductor)")
    parser.add_argument(
        "--variants", nargs="+", choices=[*BASE_VARIANTS, *COMPILED_VARIANTS, *MD_VARIANTS, *OPTIMIZER_VARIANTS]
    )
    parser.add_argument("--out", type=Path, default=Path("results/bench_step.json"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one rank of one variant
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    args.out = output_file(parser, args.out, "bench_step.json")
    if args.warmup >= args.steps:
        parser.error(f"--warmup {args.warmup} leaves no step to time; allowed: fewer than --steps ({args.steps})")
    variants = args.variants or [*BASE_VARIANTS, *(COMPILED_VARIANTS if args.compile else ())]
    if find_spec("deepspeed") is None and "deepspeed-zero3" in variants:
        variants.remove("deepspeed-zero3")
        print("deepspeed is not installed: its row is left out")
    records: dict[int, dict[str, list]] = {world: {v: [] for v in variants} for world in args.worlds}
    for rep in range(args.reps):
        for world in args.worlds:
            shift = rep % len(variants)
            for variant in variants[shift:] + variants[:shift]:
                record = run_job(variant, world, args)
                records[world][variant].append(record)
                args.out.write_text(
                    json.dumps({"partial": True, "worlds": records}, indent=2)
                )  # kept if a later job dies
                print(f"rep {rep} world {world} {variant}: {record.get('failed') or record['times']}", flush=True)
    results = {
        "machine": f"{usable_cpus()} CPU cores ({platform.processor() or platform.machine()}), torch {torch.__version__}, gloo",
        "load_note": "other jobs may share the CPU; load_1min is the 1-minute load average before each job",
        "model": {"n_layer": args.n_layer, "d_model": args.d_model, "block_size": args.block_size, "dtype": "fp32"},
        "micro_batch_size": args.micro_batch_size,
        "threads_per_rank": {str(w): threads_per_rank(args, w) for w in args.worlds},
        "steps": args.steps,
        "warmup": args.warmup,
        "reps": args.reps,
        "peak_memory": "VmHWM per rank after a reset once built, above the resident set before the model existed",
        "worlds": {str(w): {v: summarize(rs, w, args) for v, rs in records[w].items()} for w in args.worlds},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(
        f"\n{results['machine']}; {args.n_layer} layers x {args.d_model}, {args.block_size} tokens x {args.micro_batch_size} per rank\n"
    )
    for w in args.worlds:
        print(markdown(results["worlds"][str(w)], w) + "\n")
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
