"""``zeropp bench optimizer``: the host optimizer step of ZeRO-Offload, nanoseconds per parameter per step.

ZeRO-Offload runs AdamW on each rank's fp32 master shard in host memory, so its step time adds to
every training step. Timed on flat fp32 shards (what zeropp's units hand the optimizer), one shard
per unit: torch's AdamW with ``foreach`` (its default on CPU), ``fused=True`` (a fused CPU kernel),
single-tensor ``foreach=False``, a ``torch.compile``d step, and DeepSpeed's ``DeepSpeedCPUAdam``
where DeepSpeed is installed and its op builds. Median of ``--repeats`` steps after a warm-up, with
``--threads`` intra-op threads.

Against the machine's memory bandwidth: AdamW reads a parameter, its gradient and two moments and
writes the parameter and the moments back, 28 bytes a parameter in fp32; each step's bytes over its
time are set beside a plain copy's (``dst.copy_(src)`` over the same number of fp32 elements, read
and write counted), the bound a step that only streams its operands would meet.

    zeropp bench optimizer [--params 50e6] [--units 16] [--repeats 5] [--threads N] [--only NAME ...]
                           [--out results/bench_optimizer.json]

With ``--in-backward`` it times the step inside backward instead: the share of the host step hidden
behind backward and a timeline of one step (:mod:`zeropp.tools.bench.speed.host_overlap`).

    zeropp bench optimizer --in-backward [--n-layer 12] [--d-model 512] [--steps 6] [--offload cpu|nvme]
                           [--offload-path DIR] [--out results/bench_optimizer_in_backward.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from zeropp.tools.bench.runs import cpu_model, output_file
from zeropp.tools.bench.speed import host_overlap

LR = dict(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
ADAMW_BYTES = 28  # read p, g, exp_avg, exp_avg_sq; write p, exp_avg, exp_avg_sq: 7 fp32 values a parameter


def _shards(params: int, units: int) -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    shards = [torch.nn.Parameter(torch.randn(params // units)) for _ in range(units)]
    for p in shards:
        p.grad = torch.randn_like(p)
    return shards


def candidates() -> dict[str, Callable[[list[torch.nn.Parameter]], Callable[[], None]]]:
    """{name: build(params) -> step()} for every optimizer that can run here."""

    def torch_adamw(**kwargs):
        def build(params):
            return torch.optim.AdamW(params, **LR, **kwargs).step

        return build

    def compiled(params):
        optimizer = torch.optim.AdamW(params, **LR, foreach=True)
        return torch.compile(optimizer.step)

    found = {
        "torch AdamW foreach": torch_adamw(foreach=True),
        "torch AdamW fused": torch_adamw(fused=True),
        "torch AdamW single-tensor": torch_adamw(foreach=False),
        "torch AdamW compiled": compiled,
    }
    if importlib.util.find_spec("deepspeed") is not None:  # imported (and its op built) only when timed
        found["DeepSpeedCPUAdam"] = _deepspeed_cpu_adam
    return found


def _deepspeed_cpu_adam(params: list[torch.nn.Parameter]) -> Callable[[], None]:
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.ops.adam import DeepSpeedCPUAdam  # its C++ op builds here at first use, or fails

    return DeepSpeedCPUAdam(params, **LR, adamw_mode=True).step


def time_step(step: Callable[[], None], repeats: int) -> float:
    step()  # warm-up: state allocation, compilation
    times = []
    for _ in range(repeats):
        tick = time.perf_counter()
        step()
        times.append(time.perf_counter() - tick)
    return statistics.median(times)


def copy_bandwidth(numel: int, repeats: int) -> float:
    """Bytes per second of ``dst.copy_(src)`` over `numel` fp32 elements (a read and a write each)."""
    src, dst = torch.randn(numel), torch.empty(numel)
    return 2 * 4 * numel / time_step(lambda: dst.copy_(src), repeats)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zeropp bench optimizer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=50e6)
    parser.add_argument("--units", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--only", nargs="+", metavar="NAME", help="these optimizers alone (names as printed)")
    parser.add_argument("--out", type=Path, default=None, help="default: results/bench_optimizer[_in_backward].json")
    host_overlap.add_arguments(parser)
    args = parser.parse_args(argv)
    name = "bench_optimizer_in_backward.json" if args.in_backward else "bench_optimizer.json"
    args.out = output_file(parser, args.out or Path("results") / name, name)
    torch.set_num_threads(args.threads)
    if args.in_backward:
        if args.offload == "nvme" and args.offload_path is None:
            parser.error("--offload nvme needs --offload-path DIR (the disk tier's folder)")
        return _in_backward(args)
    found = candidates()
    unknown = sorted(set(args.only or ()) - set(found))
    if unknown:
        parser.error(f"--only {unknown[0]!r} is not an optimizer that runs here; expected one of {sorted(found)}")
    rows = []
    copy = copy_bandwidth(int(args.params), args.repeats)
    print(
        f"{int(args.params):,} fp32 parameters in {args.units} shards, {args.threads} threads; copy {copy / 1e9:.2f} GB/s"
    )
    print("| optimizer | median step (s) | ns per parameter | GB/s moved (28 B a parameter) | of copy |")
    print("| --- | --- | --- | --- | --- |")
    for name, build in found.items():
        if args.only and name not in args.only:
            continue
        try:
            seconds = time_step(build(_shards(int(args.params), args.units)), args.repeats)
        except Exception as error:  # e.g. no C++ compiler for torch.compile
            print(f"| {name} | failed: {str(error).splitlines()[0][:80]} | | | |")
            continue
        moved = ADAMW_BYTES * args.params / seconds
        row = {"optimizer": name, "seconds": seconds, "ns_per_param": seconds / args.params * 1e9,
               "bytes_per_s": moved, "of_copy": moved / copy}  # fmt: skip
        rows.append(row)
        print(
            f"| {name} | {seconds:.4f} | {row['ns_per_param']:.2f} | {moved / 1e9:.2f} | {row['of_copy']:.2f} |",
            flush=True,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "params": args.params,
        "units": args.units,
        "threads": args.threads,
        "copy_bytes_per_s": copy,
        "rows": rows,
    }
    args.out.write_text(json.dumps(record))
    return 0


def _in_backward(args: argparse.Namespace) -> int:
    result = host_overlap.measure(args)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(
        f"{cpu_model()}, {args.threads} threads, {when}; GPT {args.n_layer} x {args.d_model}, stage 3, offload {args.offload}"
    )
    host_overlap.report(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    setup = {k: getattr(args, k) for k in ("n_layer", "d_model", "block_size", "steps", "offload", "threads")}
    args.out.write_text(json.dumps({"cpu": cpu_model(), "date": when, **setup, **result}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
