"""``zeropp plan``'s command line: flags, one-line refusals, the ranked table or JSON."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from zeropp.errors import ConfigError
from zeropp.tools.estimate.cli import OneLineParser, UsageError, count_argument
from zeropp.tools.plan.model import TENSOR_PARALLEL_SIZES, Model, Planned, hf_model, plan, preset_model
from zeropp.tools.simulate.cli import add_cluster_arguments
from zeropp.tools.simulate.gpus import GPUS

PRESETS = ("tiny", "small", "medium")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="zeropp plan",
        description="The configurations of a training run (ZeRO stage, hpZ, qwZ/qgZ bits, tensor-parallel size, "
        "micro-batch, activation checkpointing; sequence parallelism and ZeRO-Offload where a configuration fits "
        "only with them) simulated on a cluster (zeropp simulate), ranked by predicted tokens/s among those that fit "
        "the GPU's memory, with the zeropp train flags to run each (docs/simulate.md).",
    )
    add_cluster_arguments(parser)
    model = parser.add_argument_group("model (one of --preset, --params, --hf-config)")
    model.add_argument("--preset", choices=PRESETS, help="the embedded GPT (zeropp train --preset)")
    model.add_argument("--params", type=count_argument, metavar="P", help="parameters, e.g. 8e9")
    model.add_argument("--n-layer", type=count_argument, metavar="L", help="with --params: blocks")
    model.add_argument("--d-model", type=count_argument, metavar="H", help="with --params: width")
    model.add_argument(
        "--n-head", type=count_argument, metavar="A", help="with --params: attention heads (T must divide them)"
    )
    model.add_argument("--hf-config", type=Path, metavar="PATH", help="a Hugging Face config.json")
    batch = parser.add_argument_group("batch (--tokens-per-gpu, or micro-batch sizes x --sequence-length)")
    batch.add_argument("--sequence-length", type=count_argument, metavar="S", help="default: the preset's")
    batch.add_argument(
        "--micro-batch-sizes",
        type=count_argument,
        nargs="+",
        metavar="B",
        default=[1, 2, 4, 8],
        help="default: 1 2 4 8",
    )
    batch.add_argument("--tokens-per-gpu", type=count_argument, metavar="T", help="tokens per GPU and step, fixed")
    batch.add_argument(
        "--tensor-parallel-sizes", type=count_argument, nargs="+", metavar="T",
        help=f"tensor-parallel sizes tried (default: those of {' '.join(map(str, TENSOR_PARALLEL_SIZES))} dividing a "
        "node's GPUs and the heads; 1 on cpu-gloo)",
    )  # fmt: skip
    batch.add_argument(
        "--activation-checkpointing", action=argparse.BooleanOptionalAction, default=None,
        help="only with (or without) it (default: both)",
    )  # fmt: skip
    out = parser.add_argument_group("output")
    out.add_argument("--top", type=count_argument, default=5, metavar="K", help="configurations shown (default 5)")
    out.add_argument("--verbose", action="store_true", help="also the dropped configurations and why")
    out.add_argument("--json", action="store_true", help="print JSON: the inputs, the top K and the dropped")
    return parser


def _model(args: argparse.Namespace) -> Model:
    given = [f for f in ("preset", "params", "hf_config") if getattr(args, f) is not None]
    if len(given) != 1:
        raise UsageError("expected exactly one of --preset, --params, --hf-config")
    if (args.n_layer or args.d_model or args.n_head) and not args.params:
        raise UsageError("--n-layer, --d-model and --n-head go with --params")
    if args.preset:
        return preset_model(args.preset)
    if args.hf_config:
        return hf_model(args.hf_config)
    return Model(f"{args.params:.3g} parameters", args.params, args.n_layer, args.d_model, heads=args.n_head)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        missing = [
            f"--{n.replace('_', '-')}" for n in ("gpu", "gpus", "inter_node_bandwidth") if getattr(args, n) is None
        ]
        if missing:
            raise UsageError(f"expected {', '.join(missing)}")
        if args.tokens_per_gpu and args.sequence_length:
            raise UsageError("--tokens-per-gpu and --sequence-length exclude each other")
        model, per_node = _model(args), args.gpus_per_node or GPUS[args.gpu].ranks_per_node
        checkpointing = (False, True) if args.activation_checkpointing is None else (args.activation_checkpointing,)
        ranked, dropped = plan(
            args.gpu, args.gpus, per_node, args.inter_node_bandwidth, model, sequence=args.sequence_length,
            micro_batches=args.micro_batch_sizes, tokens_per_gpu=args.tokens_per_gpu, checkpointing=checkpointing,
            intra_bits_per_s=args.intra_node_bandwidth, pcie_bits_per_s=args.pcie_bandwidth,
            host_bits_per_s=args.host_memory_bandwidth, tensor_parallel=args.tensor_parallel_sizes,
        )  # fmt: skip
    except (UsageError, ConfigError) as error:
        print(f"zeropp plan: error: {error}", file=sys.stderr)
        return 2
    precision = GPUS[args.gpu].precision
    inputs = {
        "gpu": args.gpu, "gpus": args.gpus, "gpus_per_node": per_node, "inter_node_bits_per_s": args.inter_node_bandwidth,
        "model": model.name, "params": model.params, "candidates": len(ranked) + len(dropped), "fit": len(ranked),
        "tensor_parallel_sizes": sorted({p.candidate.tensor_parallel for p in (*ranked, *dropped)}),
    }  # fmt: skip
    if args.json:
        result: dict[str, Any] = {"inputs": inputs, "ranked": [p.as_dict(precision) for p in ranked[: args.top]]}
        result["dropped"] = [p.as_dict(precision) for p in dropped]
        print(json.dumps(result, indent=2))
        return 0
    _print(inputs, ranked[: args.top], dropped if args.verbose else [], precision)
    return 0


def _print(inputs: dict[str, Any], top: list[Planned], dropped: list[Planned], precision: str) -> None:
    print(
        f"zeropp plan: {inputs['model']} ({inputs['params'] / 1e9:.3g}B) on {inputs['gpus']} {inputs['gpu']} "
        f"({inputs['gpus_per_node']} a node), {inputs['inter_node_bits_per_s'] / 1e9:g} Gbit/s a node; "
        f"{inputs['fit']} of {inputs['candidates']} configurations fit, the fastest {len(top)}:"
    )
    print("| # | configuration | TP | micro-batch | act. ckpt | step (s) | tokens/s | TFLOPs/GPU | memory/GPU (GB) |")
    print("| ---: | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    for i, p in enumerate(top, 1):
        sim, c = p.simulation, p.candidate
        assert sim is not None
        print(
            f"| {i} | {c.name} | {c.tensor_parallel} | {c.micro_batch} | "
            f"{'on' if c.activation_checkpointing else 'off'} | {sim.step_s:.3g} | "
            f"{p.tokens_per_s:,.0f} | {sim.tflops_per_gpu:.3g} | {sim.memory_bytes / 1e9:.3g} |"
        )
    for i, p in enumerate(top, 1):
        print(f"  {i}: zeropp train {shlex.join(p.candidate.flags(precision))}")
    for p in dropped:
        c = p.candidate
        print(f"  dropped: {c.name}, micro-batch {c.micro_batch}, act. ckpt {c.activation_checkpointing}: {p.dropped}")
