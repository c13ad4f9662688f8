"""``zeropp bench memory``: peak memory per rank while constructing and training a large GPT, against the formulas.

For each world size, a GPT of ``--n-layer`` x ``--d-model`` (12 x 1024: 151M parameters) is built and
trained for ``--steps`` steps (fp32, AdamW, ZeRO-3 without ZeRO++, one sequence per rank) by:

- zeropp, model built on the meta device (``zeropp train``'s default);
- zeropp, model built whole on every rank (``--init eager``: what every run did before meta-device
  construction);
- zeropp with ``--offload-optimizer cpu`` (on a CPU-only machine host and device are one memory);
- FSDP2 (``fully_shard`` per block, the model built on the meta device, ``to_empty`` + init) and
  DeepSpeed ZeRO-3 with ``zero.Init`` when ``deepspeed`` is installed (:mod:`zeropp.tools.bench.memory.rivals`).

Peaks are :class:`zeropp.costs.memory.PeakMeter`'s, above each process's memory before the model was
built: ``init`` covers construction and set-up, ``step`` the training steps. The bounds:
init <= 1.1 x (this rank's fp32 master shards 4Ψ/N + the largest unit in fp32) and
step <= 1.1 x (16Ψ/N + two gathered units in fp32 + activations), with activations the bytes autograd
saves for backward in one micro-batch (measured here, in this process, with saved-tensor hooks).
Every run gets ``MALLOC_MMAP_THRESHOLD_=131072``: glibc otherwise raises its mmap threshold as large
blocks are freed and then keeps freed blocks of that size resident, which the resident set would
count as if they were tensors. Each variant is also run on a GPT of one layer of width 64 (the *floor*: what the process itself
touches while constructing and stepping, such as libraries loaded on first use and thread pools); the
bounds are compared with the peaks above that floor.

    zeropp bench memory [--worlds 4 8] [--n-layer 12] [--d-model 1024] [--block-size 256] [--steps 2]
                        [--out results/bench_memory.json]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from zeropp.app.models.gpt import GPT, gpt_config
from zeropp.config.model import ModelConfig
from zeropp.tools.bench.memory.rivals import RIVALS, run_rival
from zeropp.tools.bench.runs import ZEROPP_OFF_FLAGS, output_file, train_summary
from zeropp.zero.grouping import group_parameters, repeated_blocks

VARIANTS = {
    "zeropp meta": [],
    "zeropp eager": ["--init", "eager"],
    "zeropp meta + offload": ["--offload-optimizer", "cpu"],
}


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(
        n_layer=args.n_layer, d_model=args.d_model, n_head=args.d_model // 64, block_size=args.block_size
    )


def formulas(args: argparse.Namespace, world: int) -> dict[str, float]:
    """Ψ, the largest unit, activations of one micro-batch, and the two bounds (bytes per rank)."""
    with torch.device("meta"):
        gpt = GPT(gpt_config(model_config(args)))
    units = [sum(p.numel() for _, p in params) for _, params in group_parameters(gpt, repeated_blocks(gpt))]
    psi, largest = sum(units), max(units)
    activations = activation_bytes(gpt_config(model_config(args)))
    return {
        "psi": psi,
        "largest_unit_fp32": 4 * largest,
        "activations": activations,
        "init_bound": 1.1 * (4 * psi / world + 4 * largest),
        "step_bound": 1.1 * (16 * psi / world + 2 * 4 * largest + activations),
    }


def activation_bytes(config: Any) -> int:
    """Bytes autograd saves for backward in one sequence's forward (parameters excluded)."""
    torch.manual_seed(0)
    model = GPT(config)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    x = torch.randint(0, config.vocab_size, (1, config.block_size))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, x)
    return sum(saved.values())


def _measure(args: argparse.Namespace, world: int, variant: str) -> dict[str, Any]:
    if variant in RIVALS:
        size = ["--n-layer", str(args.n_layer), "--d-model", str(args.d_model), "--block-size", str(args.block_size)]
        with tempfile.TemporaryDirectory() as tmp:
            return run_rival(variant, world, size, args.steps, Path(tmp) / "peaks.json")
    return run_zeropp(args, world, VARIANTS[variant])


def run_zeropp(args: argparse.Namespace, world: int, flags: list[str]) -> dict[str, Any]:
    m = model_config(args)
    size = ["--n-layer", str(m.n_layer), "--d-model", str(m.d_model), "--n-head", str(m.n_head)]
    summary = train_summary(
        [*size, "--block-size", str(m.block_size), "--micro-batch-size", "1", "--steps", str(args.steps),
         "--eval-interval", str(args.steps + 1), "--eval-batches", "1", "--stage", "3", *ZEROPP_OFF_FLAGS,
         "--nproc-per-node", str(world), "--nodes", "1", *flags]
    )  # fmt: skip
    return {"init": max(summary.init_peak_memory_bytes_per_rank), "step": max(summary.step_peak_memory_bytes_per_rank)}


def markdown(rows: list[dict[str, Any]]) -> str:
    """Peaks, floors and bounds in MiB; 'above floor / bound' is the ratio the goals are about."""
    lines = [
        "| world | variant | init peak | floor | init above floor / bound | step peak | floor | step above floor / bound |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        cells = [str(r["world"]), r["variant"]]
        for kind in ("init", "step"):
            above = r[kind] - r[f"{kind}_floor"]
            bound = r[f"{kind}_bound"]
            cells += [_mib(r[kind]), _mib(r[f"{kind}_floor"]), f"{_mib(above)} / {_mib(bound)} ({above / bound:.2f}x)"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zeropp bench memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--n-layer", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--variants", nargs="+", choices=[*VARIANTS, *RIVALS], default=[*VARIANTS, *RIVALS])
    parser.add_argument("--out", type=Path, default=Path("results/bench_memory.json"))
    args = parser.parse_args(argv)
    args.out = output_file(parser, args.out, "bench_memory.json")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)  # inherited by every run (see the docstring)
    floor_args = argparse.Namespace(**{**vars(args), "n_layer": 1, "d_model": 64})
    rows = []
    for world in args.worlds:
        bounds = formulas(args, world)
        for name in args.variants:
            peaks, floor = (_measure(a, world, name) for a in (args, floor_args))
            rows.append(
                {"world": world, "variant": name, **peaks, **{f"{k}_floor": v for k, v in floor.items()}, **bounds}
            )
            print(markdown(rows[-1:]).splitlines()[-1], flush=True)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(rows, indent=2))  # after every row: a failure later keeps these
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
