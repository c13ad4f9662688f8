"""``zeropp bench longest``: the longest sequence a Hugging Face Llama trains two steps on within a memory limit per rank, by context-parallel size and tiled logits.

Each variant (Ulysses context parallelism over C of the `--world` ranks, ``--context-parallel``; the
logits whole or in ``--logit-tiles`` tiles) tries ``--lengths`` in increasing order, each a
``zeropp train`` of 2 steps (one sequence per reader, ZeRO-3 without ZeRO++, fp32) inside a memory
cgroup of ``--limit-gib-per-rank`` x world (cgroup v1, root), so that running out of memory kills
the attempt and nothing else; after the first failure, the interval between it and the last length
that trained is halved until it is at most ``--resolution`` of that length (or one step of C x 64
tokens; at most ``--refine`` halvings); the longest length that trains is the answer, each failure's
cause recorded (out of memory, timeout, the error's last line). The model: a Llama of
``--layers`` x ``--hidden`` with grouped-query attention and a ``--vocab`` vocabulary (the logits of
a long sequence are what tiling removes). Then, without a limit, each rank's step peak against the
length (``--growth-lengths``) at C = 1 and the largest C, with tiled logits: the activations a rank
holds grow with its share of the sequence. The CPU model and the date go with the results.

Every run gets ``MALLOC_MMAP_THRESHOLD_=131072``, as ``zeropp bench memory`` and ``bench step`` do:
glibc otherwise raises its mmap threshold as large blocks are freed and keeps freed blocks of that
size resident, which the cgroup and the resident set count as if they were tensors (by different
amounts from run to run, and more at C 4 than at C 1 at the same length). ``--glibc-default``
measures under glibc's own behaviour instead.

    zeropp bench longest [--world 4] [--context-parallel 1 2 4] [--logit-tiles 16]
                         [--lengths 1024 2048 4096 8192 16384 32768] [--limit-gib-per-rank 0.9]
                         [--resolution 0.03] [--refine 6] [--glibc-default] [--out results/bench_longest.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from zeropp.tools.bench.memory.largest import limit_cgroup, run_limited
from zeropp.tools.bench.runs import ZEROPP_OFF_FLAGS, cpu_model, output_file

UNLIMITED_GIB_PER_RANK = 16.0  # the growth runs: a cgroup that never fills
MMAP_THRESHOLD = 128 * 1024  # every run's fixed glibc mmap threshold (see the docstring)


def write_config(folder: Path, args: argparse.Namespace) -> Path:
    """The Llama's config.json, positions for the longest length tried."""
    import transformers

    longest = max(*args.lengths, *args.growth_lengths)
    transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads // 2,
        max_position_embeddings=longest,
    ).save_pretrained(folder)  # fmt: skip
    return folder / "config.json"


def command(config: Path, length: int, cp: int, tiles: int, args: argparse.Namespace) -> list[str]:
    return [sys.executable, "-m", "zeropp.cli", "train", "--hf-config", str(config), "--block-size", str(length),
            "--micro-batch-size", "1", "--steps", "2", "--eval-interval", "3", "--eval-batches", "1",
            "--stage", "3", *ZEROPP_OFF_FLAGS, "--nproc-per-node", str(args.world), "--nodes", "1",
            "--precision", "fp32", "--context-parallel-size", str(cp), "--logit-tiles", str(tiles)]  # fmt: skip


def longest(config: Path, cp: int, tiles: int, args: argparse.Namespace) -> dict[str, Any]:
    """The variant's attempts in increasing length up to its first failure, then halvings of the
    interval between the longest that trained and the shortest that did not (lengths multiples of
    C x 64) until it is within ``--resolution`` of the longest (at most ``--refine`` of them); the
    longest that trained, and the interval's relative width (``bracket``: the true limit lies below
    ``longest`` x (1 + bracket))."""
    best, failed, tried = None, None, []

    def attempt(length: int) -> bool:
        result = {"length": length, **run_limited(command(config, length, cp, tiles, args), args.world, args.timeout_s)}
        tried.append(result)
        print(f"C {cp}, logit tiles {tiles}: {length} tokens: {result['outcome']} ({result['seconds']:.0f} s, "
              f"cgroup peak {result['peak_gib']:.2f} GiB)", flush=True)  # fmt: skip
        return result["outcome"] == "trains"

    for length in sorted(args.lengths):
        if not attempt(length):
            failed = length
            break
        best = length
    step = cp * 64
    for _ in range(args.refine if best is not None and failed is not None else 0):
        if failed - best <= max(step, args.resolution * best):
            break
        middle = (best + failed) // 2 // step * step
        if middle in (best, failed):
            break
        if attempt(middle):
            best = middle
        else:
            failed = middle
    bracket = None if best is None or failed is None else round((failed - best) / best, 4)
    return {"context_parallel": cp, "logit_tiles": tiles, "longest": best, "bracket": bracket, "attempts": tried}


def growth(config: Path, cp: int, args: argparse.Namespace) -> dict[str, Any]:
    """Each rank's step peak (the largest over ranks) at each growth length, without a limit."""
    peaks = {}
    for length in args.growth_lengths:
        result = run_limited(command(config, length, cp, args.logit_tiles, args), args.world, args.timeout_s)
        if result["outcome"] != "trains":
            raise SystemExit(f"zeropp bench longest: error: C {cp} at {length} tokens: {result['outcome']}")
        peaks[length] = max(result["step_peak_mib_per_rank"])
        print(f"growth: C {cp}: {length} tokens: step peak {peaks[length]:.0f} MiB per rank", flush=True)
    first, last = min(peaks), max(peaks)
    return {"context_parallel": cp, "step_peak_mib": peaks, "growth_mib": peaks[last] - peaks[first]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zeropp bench longest", description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--context-parallel", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--logit-tiles", type=int, default=16, help="the tiled variants' tiles")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--growth-lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--limit-gib-per-rank", type=float, default=0.9)
    parser.add_argument(
        "--resolution", type=float, default=0.03,
        help="halve the interval between the longest length that trains and the shortest that does not until it "
        "is at most this fraction of the longest",
    )  # fmt: skip
    parser.add_argument("--refine", type=int, default=6, help="the most halvings of that interval")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    parser.add_argument(
        "--glibc-default", action="store_true",
        help="leave glibc's dynamic mmap threshold (freed memory kept resident) instead of fixing it at 128 KiB",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("results/bench_longest.json"))
    args = parser.parse_args(argv)
    args.out = output_file(parser, args.out, "bench_longest.json")
    if not Path("/sys/fs/cgroup/memory").is_dir() or os.geteuid() != 0:
        print("zeropp bench longest: error: needs root and the cgroup v1 memory controller", file=sys.stderr)
        return 2
    report: dict[str, Any] = {
        "cpu": cpu_model(), "date": datetime.date.today().isoformat(), "world": args.world,
        "limit_gib_per_rank": args.limit_gib_per_rank,
        "mmap_threshold": None if args.glibc_default else MMAP_THRESHOLD,
        "model": {k: getattr(args, k) for k in ("layers", "hidden", "heads", "vocab")}, "rows": [], "growth": [],
    }  # fmt: skip
    if not args.glibc_default:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)  # inherited by every run (see the docstring)
    with tempfile.TemporaryDirectory() as folder:
        config = write_config(Path(folder), args)
        limit_cgroup(int(args.limit_gib_per_rank * args.world * 2**30))
        for cp in args.context_parallel:
            for tiles in (1, args.logit_tiles):
                report["rows"].append(longest(config, cp, tiles, args))
                args.out.write_text(json.dumps(report, indent=2))
        limit_cgroup(int(UNLIMITED_GIB_PER_RANK * args.world * 2**30))
        for cp in sorted({1, max(args.context_parallel)}):
            report["growth"].append(growth(config, cp, args))
            args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
