"""``zeropp bench checkpoints``: the largest micro-batch whose activation checkpoints fit a per-rank budget, without Pa, with Pa and with Pa+cpu.

ZeRO-R's argument for Pa: the checkpoints shrink by the tensor-parallel degree, so the micro-batch
can grow by it and the data-parallel traffic per sample falls by it. For each variant (checkpointing
alone, + Pa, + Pa+cpu) ``zeropp train`` runs the embedded GPT at dp 2 x tp 2 (4 ranks on one node)
with micro-batches doubling from 1; a micro-batch fits when the checkpoint bytes its rank 0 held on
the compute device (``activation_checkpoint_bytes_per_rank``: the exact bytes of the stored
tensors, peak over the last step; with Pa+cpu the pieces fetched back in backward) are within
``--budget-kib``. The first micro-batch over the budget ends the variant. Only checkpoints count
against the budget: weights, gradients and the recomputed block's activations are the same for
every variant. Data-parallel bytes per sample: the ledger's bytes per step outside ``tp.*`` and
``pa.*``, over the micro-batch.

    zeropp bench checkpoints [--preset tiny] [--n-layer 8] [--budget-kib 512] [--max-micro-batch 64]
                             [--out results/bench_checkpoints.json]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from zeropp.app.launch import usable_cpus
from zeropp.tools.bench.runs import ZEROPP_OFF_FLAGS, output_file, train_summary

VARIANTS = {
    "checkpointing": ["--activation-checkpointing"],
    "+ Pa": ["--activation-checkpointing", "--partition-activations"],
    "+ Pa+cpu": ["--activation-checkpointing", "--partition-activations", "--cpu-checkpointing"],
}


def measure(flags: list[str], micro: int, preset: str, layers: int) -> dict[str, Any]:
    s = train_summary([
        "--preset", preset, "--n-layer", str(layers), "--micro-batch-size", str(micro), "--steps", "2", "--eval-interval", "3",
        "--eval-batches", "1", "--stage", "3", *ZEROPP_OFF_FLAGS, "--init", "eager", "--nproc-per-node", "4",
        "--nodes", "1", "--tensor-parallel", "2", *flags,
    ])  # fmt: skip
    data_parallel = sum(
        sum(links.values())
        for op, phases in s.ledger.items()
        if not op.startswith(("tp.", "pa."))
        for links in phases.values()
    )
    pa = sum(sum(links.values()) for links in s.ledger.get("pa.all_gather", {}).values())
    return {
        "micro_batch": micro,
        "device_bytes": s.activation_checkpoint_bytes_per_rank,
        "host_bytes": s.activation_checkpoint_host_bytes_per_rank,
        "data_parallel_bytes_per_sample": data_parallel / micro,
        "pa_bytes_per_step": pa,
        "tensor_parallel_bytes_per_step": s.tensor_parallel_bytes_per_step,
    }


def largest(flags: list[str], budget: int, max_micro: int, preset: str, layers: int) -> dict[str, Any]:
    """Every micro-batch tried (doubling from 1) and the largest within `budget`."""
    tried, best, micro = [], None, 1
    while micro <= max_micro:
        row = measure(flags, micro, preset, layers)
        tried.append(row)
        if row["device_bytes"] > budget:
            break
        best, micro = row, micro * 2
    return {"largest": best, "tried": tried}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="zeropp bench checkpoints", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--n-layer", type=int, default=8, help="blocks (checkpointed units)")
    parser.add_argument("--budget-kib", type=int, default=512)
    parser.add_argument("--max-micro-batch", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("results/bench_checkpoints.json"))
    args = parser.parse_args(argv)
    args.out = output_file(parser, args.out, "bench_checkpoints.json")

    budget = args.budget_kib * 1024
    results = {
        "machine": f"{usable_cpus()} CPU cores, torch {torch.__version__}, gloo",
        "preset": args.preset,
        "n_layer": args.n_layer,
        "budget_bytes": budget,
        "variants": {
            name: largest(flags, budget, args.max_micro_batch, args.preset, args.n_layer)
            for name, flags in VARIANTS.items()
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(
        f"## The largest micro-batch within {args.budget_kib} KiB of activation checkpoints per rank "
        f"(embedded GPT {args.preset}, {args.n_layer} blocks, dp 2 x tp 2, {results['machine']})\n"
    )
    print(
        "| variant | largest micro-batch | checkpoints on the device | on the host | data-parallel bytes / sample | Pa bytes / step |"
    )
    print("|---|---|---|---|---|---|")
    for name, result in results["variants"].items():
        r = result["largest"]
        if r is None:
            print(f"| {name} | none (1 is over the budget) | | | | |")
            continue
        capped = " (the cap)" if r["micro_batch"] == args.max_micro_batch else ""
        print(
            f"| {name} | {r['micro_batch']}{capped} | {r['device_bytes'] / 1024:.0f} KiB | {r['host_bytes'] / 1024:.0f} KiB | "
            f"{r['data_parallel_bytes_per_sample'] / 1024:.1f} KiB | {r['pa_bytes_per_step'] / 1024:.0f} KiB |"
        )
    return 0
