"""``zeropp simulate``'s command line: flags, one-line refusals, what to print."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence

from zeropp.errors import ConfigError
from zeropp.tools.estimate.cli import OneLineParser, UsageError, bandwidth_argument, count_argument
from zeropp.tools.simulate.gpus import GPUS
from zeropp.tools.simulate.model import VARIANTS, Assumptions, default_assumptions, simulate
from zeropp.tools.simulate.papers import assumptions_dict, llama_table, paper_table, tensor_parallel_table
from zeropp.tools.simulate.show import (
    llama_markdown,
    paper_markdown,
    print_simulation,
    tensor_parallel_markdown,
    zero_paper_markdown,
)
from zeropp.tools.simulate.zero_paper import zero_paper_table

REQUIRED = ("gpu", "gpus", "inter_node_bandwidth", "params", "tokens_per_gpu", "variant")


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; expected a number in [0, 1], e.g. 0.45")
    return value


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """The cluster's flags, as zeropp simulate and zeropp plan take them."""
    cluster = parser.add_argument_group("cluster")
    cluster.add_argument(
        "--gpu",
        choices=tuple(GPUS),
        help="the GPU type (datasheet peak, memory, NVLink); cpu-gloo: the emulated cluster",
    )
    cluster.add_argument("--gpus", type=count_argument, metavar="N", help="GPUs in all")
    cluster.add_argument(
        "--gpus-per-node",
        type=count_argument,
        metavar="G",
        help="GPUs per node (default: the GPU's DGX/HGX node, 16 or 8)",
    )
    cluster.add_argument(
        "--inter-node-bandwidth", type=bandwidth_argument, metavar="RATE",
        help="a node's NICs together, e.g. 100gbit, 3200gbit",
    )  # fmt: skip
    cluster.add_argument(
        "--intra-node-bandwidth", type=bandwidth_argument, metavar="RATE",
        help="a GPU's NVLink, one direction (default: the GPU's)",
    )  # fmt: skip
    cluster.add_argument(
        "--pcie-bandwidth", type=bandwidth_argument, metavar="RATE",
        help="offload: a GPU's PCIe link to its host, one direction, e.g. 64GB/s (default: the GPU's)",
    )  # fmt: skip
    cluster.add_argument(
        "--host-memory-bandwidth", type=bandwidth_argument, metavar="RATE",
        help="offload: a node's host memory, all channels, e.g. 614GB/s (default: the GPU's DGX host)",
    )  # fmt: skip


def add_tensor_parallel_arguments(group: argparse._ArgumentGroup) -> None:
    """Tensor parallelism's flags, named as zeropp train's and zeropp estimate's."""
    group.add_argument(
        "--tensor-parallel-size", type=count_argument, default=1, metavar="T",
        help="GPUs of a node splitting every layer Megatron-style; ZeRO shards over the other GPUs / T (default: 1)",
    )  # fmt: skip
    group.add_argument(
        "--sequence-parallel", action=argparse.BooleanOptionalAction, default=False,
        help="with --tensor-parallel-size > 1, Megatron's sequence parallelism: the activations outside the split "
        "layers split over the sequence too (default: off)",
    )  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="zeropp simulate",
        description="One training step of a GPU cluster, simulated: step time, achieved TFLOPs per GPU, peak "
        "fraction and memory per GPU of ZeRO-3, ZeRO++ (or one of its parts), DDP or HSDP, optionally with "
        "ZeRO-Offload and tensor parallelism (models: docs/simulate.md).",
    )
    add_cluster_arguments(parser)
    model = parser.add_argument_group("model and batch")
    model.add_argument("--params", type=count_argument, metavar="P", help="parameters, e.g. 8e9")
    model.add_argument("--n-layer", type=count_argument, metavar="L", help="blocks (default: from P, d_model = 128 L)")
    model.add_argument(
        "--d-model", type=count_argument, metavar="H", help="width (default: from P and L, P = 12 L H^2)"
    )
    model.add_argument(
        "--n-head",
        type=count_argument,
        metavar="A",
        help="attention heads (optional: --tensor-parallel-size must divide them)",
    )
    model.add_argument(
        "--tokens-per-gpu", type=count_argument, metavar="T",
        help="tokens each GPU trains on per step (a tensor-parallel group: its size times that)",
    )  # fmt: skip
    model.add_argument(
        "--activation-checkpointing", action=argparse.BooleanOptionalAction, default=True,
        help="recompute each block's forward in backward (default: on, as the ZeRO++ paper's runs)",
    )  # fmt: skip
    model.add_argument("--variant", choices=tuple(VARIANTS), help="zero3 (= FSDP2), zeropp, qwz, hpz, qgz, ddp, hsdp")
    model.add_argument(
        "--offload-optimizer", choices=("none", "cpu"), default="none",
        help="cpu: ZeRO-Offload, the fp32 masters and Adam's moments on the host, stepped there (default: none)",
    )  # fmt: skip
    model.add_argument(
        "--step-in-backward", action="store_true",
        help="with --offload-optimizer cpu: each unit's host step as its gradient lands, overlapping backward "
        "(zero.step_in_backward; default: after backward)",
    )  # fmt: skip
    add_tensor_parallel_arguments(model)
    knobs = parser.add_argument_group("assumptions (defaults calibrated on the ZeRO++ paper: docs/simulate.md)")
    knobs.add_argument("--compute-efficiency", type=_fraction, metavar="F", help="achieved matmul share of the peak")
    knobs.add_argument("--nic-efficiency", type=_fraction, metavar="F", help="NCCL's bus bandwidth over the NICs' rate")
    knobs.add_argument(
        "--overlap", type=_fraction, metavar="F", help="share of a pass's communication prefetch hides (1: all it can)"
    )
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the numbers as JSON instead")
    out.add_argument(
        "--paper-table", action="store_true", help="the ZeRO++ paper's evaluation (Fig. 11-13, Table 2) simulated"
    )
    out.add_argument(
        "--zero-paper-table", action="store_true",
        help="the ZeRO paper's throughput and memory figures (v1 Tables 4-8, SC20 §X) simulated",
    )  # fmt: skip
    out.add_argument("--llama-table", action="store_true", help="Llama-3-8B and 70B on 64-1024 H100s")
    out.add_argument(
        "--tensor-parallel-table", action="store_true",
        help="Llama-3-70B on 64 H100s with and without tensor parallelism",
    )  # fmt: skip
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        assumptions = _assumptions(args)
        if args.paper_table or args.zero_paper_table or args.llama_table or args.tensor_parallel_table:
            return _tables(args, assumptions)
        missing = [f"--{name.replace('_', '-')}" for name in REQUIRED if getattr(args, name) is None]
        if missing:
            raise UsageError(
                f"expected {', '.join(missing)} (or --paper-table / --zero-paper-table / --llama-table / "
                "--tensor-parallel-table)"
            )
        per_node = args.gpus_per_node or GPUS[args.gpu].ranks_per_node
        sim = simulate(
            args.gpu, args.gpus, per_node, args.inter_node_bandwidth, args.params, args.tokens_per_gpu, args.variant,
            intra_bits_per_s=args.intra_node_bandwidth, n_layer=args.n_layer, d_model=args.d_model,
            activation_checkpointing=args.activation_checkpointing, assumptions=assumptions,
            zero=_zero_keys(args),
            pcie_bits_per_s=args.pcie_bandwidth, host_bits_per_s=args.host_memory_bandwidth,
            tensor_parallel=args.tensor_parallel_size, sequence_parallel=args.sequence_parallel, heads=args.n_head,
        )  # fmt: skip
    except (UsageError, ConfigError) as error:
        print(f"zeropp simulate: error: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(sim.as_dict(), indent=2))
    else:
        intra = args.intra_node_bandwidth or sim.gpu.nvlink_bits_per_s
        print_simulation(sim, args.inter_node_bandwidth, intra)
    return 0


def _zero_keys(args: argparse.Namespace) -> dict[str, object]:
    """The ZeRO keys the offload flags set over the variant's."""
    keys: dict[str, object] = {"offload_optimizer": "cpu"} if args.offload_optimizer == "cpu" else {}
    return {**keys, "step_in_backward": True} if args.step_in_backward else keys


def _assumptions(args: argparse.Namespace) -> Assumptions:
    given = {
        k: getattr(args, k) for k in ("compute_efficiency", "nic_efficiency", "overlap") if getattr(args, k) is not None
    }
    return dataclasses.replace(default_assumptions(args.gpu) if args.gpu else Assumptions(), **given)


def _tables(args: argparse.Namespace, assumptions: Assumptions) -> int:
    result = {"assumptions": assumptions_dict(assumptions)}
    if args.paper_table:
        result["zeropp_paper"] = paper_table(assumptions)
    if args.zero_paper_table:
        result["zero_paper"] = zero_paper_table(assumptions)
    if args.llama_table:
        result["llama3_h100"] = llama_table(assumptions)
    if args.tensor_parallel_table:
        result["llama3_70b_tensor_parallel"] = tensor_parallel_table(assumptions)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print("assumptions: " + ", ".join(f"{k} {v:g}" for k, v in result["assumptions"].items()))
    if args.paper_table:
        print(
            f"\nZeRO++ paper (V100, DGX-2, TFLOPs per GPU; ratio = simulated / paper):\n{paper_markdown(result['zeropp_paper'])}"
        )
    if args.zero_paper_table:
        print(
            "\nZeRO paper (V100, DGX-2 nodes of 16, 800 Gbit/s a node; ratio = simulated / paper):\n"
            + zero_paper_markdown(result["zero_paper"])
        )
    if args.llama_table:
        print(
            f"\nLlama-3 on H100 (8 per node; TFLOPs per GPU (peak fraction), memory per GPU):\n{llama_markdown(result['llama3_h100'])}"
        )
    if args.tensor_parallel_table:
        print(
            "\nLlama-3-70B on 64 H100 (8 per node), 8192 tokens per GPU, with tensor parallelism T:\n"
            + tensor_parallel_markdown(result["llama3_70b_tensor_parallel"])
        )
    return 0
