"""``zeropp estimate``'s command line: flags, checks, and which numbers to compute and print."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from zeropp.app.flags import add_config_flags
from zeropp.config.rates import RateError, parse_bandwidth
from zeropp.config.sections import Config, load_config
from zeropp.context_parallel import check_heads, check_length
from zeropp.costs.memory import Activations
from zeropp.errors import ConfigError
from zeropp.index.ranks import Layout
from zeropp.tools.estimate.gpt import (
    gpt_activations,
    gpt_expert_unit_numels,
    gpt_experts,
    gpt_norm_parameters,
    gpt_unit_numels,
)
from zeropp.tools.estimate.model import estimate
from zeropp.tools.estimate.papers import (
    hpz_example,
    max_model_table,
    mp_example,
    pa_example,
    trillion_example,
    zero_table,
    zeropp_table,
)
from zeropp.tools.estimate.show import (
    print_estimate,
    print_max_model_table,
    print_pa_example,
    print_zero_table,
    print_zeropp_table,
)

ZERO_FLAGS = (
    "stage", "precision", "grad_dtype", "gradient_accumulation_steps", "persistence_threshold", "shard_alignment",
    "reduce_bucket_numel", "quantized_weights", "weight_bits", "weight_block_size", "weight_quantization",
    "hpz_partition_size", "quantized_gradients", "gradient_bits", "gradient_block_size", "qgz_pipeline_chunks", "qgz_pipeline_min_chunk",
    "quantized_nontrainable_weights", "nontrainable_weight_bits", "prefetch", "optimizer_state_dtype", "master_dtype",
    "offload_optimizer", "offload_params", "offload_path", "offload_buffer_count",
    "outer_sync_every", "outer_bits", "outer_block_size", "outer_fragments",
)  # fmt: skip
MODEL_FLAGS = ("preset", "n_layer", "n_head", "d_model", "block_size", "logit_tiles", "n_experts", "top_k")
SHAPE_FLAGS = ("n_layer", "d_model", "block_size")  # a --params model's transformer shape
ZERO_R_FLAGS = ("activation_checkpointing", "partition_activations", "cpu_checkpointing")  # zero.* keys of train
TP_KEY = "topology.tensor_parallel_size"
SP_KEY = "topology.sequence_parallel"
DEFAULT_BANDWIDTH = {"intra": "100gbit", "inter": "200mbit"}  # inter: the emulated cluster's tc limit


class UsageError(Exception):
    """A bad command line, said in one line (the tools' parsers raise it instead of printing usage)."""


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:  # one line, no usage block
        raise UsageError(message)


def bandwidth_argument(text: str) -> float:
    try:
        return parse_bandwidth(text)
    except RateError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def count_argument(text: str) -> int:
    """A whole number >= 1, written as one (8) or in exponent form (7.5e9)."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not (value >= 1 and value.is_integer()):
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; expected a whole number >= 1, e.g. 7.5e9")
    return int(value)


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; expected a number in [0, 1), e.g. 0.99")
    return value


def _nonnegative_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (0 <= value < float("inf")):
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; expected seconds >= 0, e.g. 0.25")
    return value


def _at_least(minimum: int):
    def parse(text: str) -> int:
        if not text.isdigit() or int(text) < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} is not allowed; expected an integer >= {minimum}")
        return int(text)

    return parse


ZERO_R_HELP = {
    "activation_checkpointing": "keep only every block's input from forward to backward (recomputed there)",
    "partition_activations": "Pa (ZeRO-R): each tensor-parallel rank keeps 1/tp of every checkpoint",
    "cpu_checkpointing": "Pa+cpu (ZeRO-R): the checkpoint partitions wait in host memory",
}


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="zeropp estimate",
        description="Per-rank memory of model states, per-step communication (intra-/inter-node bytes) and "
        "predicted communication time of zeropp, computed without running it (models: docs/estimate.md).",
    )
    model = parser.add_argument_group("model (default: the config's, else the embedded GPT 'small')")
    model.add_argument("--params", type=count_argument, metavar="N", help="parameter count Ψ, one flat unit (7.5e9)")
    model.add_argument("--config", type=Path, help="a zeropp TOML/JSON config: its zero, model and topology keys")
    add_config_flags(model, MODEL_FLAGS)
    model.add_argument(
        "--frozen-fraction", type=_fraction, default=0.0, metavar="F",
        help="share of every unit's parameters that is frozen, a LoRA run's base (0.99); no gradient, master or "
        "optimizer state; at stage 3 sharded and gathered per use (--quantized-nontrainable-weights: stored quantized)",
    )  # fmt: skip
    cluster = parser.add_argument_group("cluster")
    cluster.add_argument("--world", type=_at_least(1), metavar="N", help="ranks (GPUs) in all")
    nodes = cluster.add_mutually_exclusive_group()
    nodes.add_argument("--nodes", dest="topology.nodes", type=int, metavar="N", help="nodes (default 1)")
    nodes.add_argument("--ranks-per-node", type=_at_least(1), metavar="N")
    add_config_flags(
        cluster, ("tensor_parallel_size", "sequence_parallel", "context_parallel_size", "expert_parallel_size")
    )
    for link in ("intra", "inter"):
        cluster.add_argument(
            f"--{link}-node-bandwidth",
            type=bandwidth_argument,
            default=parse_bandwidth(DEFAULT_BANDWIDTH[link]),
            metavar="RATE",
            help=f"{'a rank' if link == 'intra' else 'a node'}'s {link}-node bandwidth (default {DEFAULT_BANDWIDTH[link]})",
        )
    cluster.add_argument(
        "--compute-seconds", type=_nonnegative_seconds, metavar="S",
        help="a step's compute alone (measured on a fast link, or from FLOPs): also predict the step, its "
        "communication overlapped as stage 3 pipelines it (docs/estimate.md)",
    )  # fmt: skip
    cluster.add_argument(
        "--backend", choices=("nccl", "gloo"),
        help="the collectives' backend: gloo sends a reduce-scatter as an all-reduce, twice the ring's bytes "
        "(default: the config's topology.backend; auto, as on GPUs: nccl)",
    )  # fmt: skip
    zero = parser.add_argument_group("ZeRO / ZeRO++ (zeropp's config keys; ZeRO++ off unless switched on)")
    add_config_flags(zero, ZERO_FLAGS)
    zero.add_argument(
        "--optimizer-state-bytes", type=_at_least(0), default=8, metavar="N", help="beside the fp32 master (Adam: 8)"
    )
    zero.add_argument(
        "--optimizer-path", choices=("flat", "whole"), default="flat",
        help="flat: element-wise optimizers on the shards (each parameter's piece or one tensor a shard: the "
        "same bytes); whole: whole parameters on owner ranks (Adafactor, Muon): two fp32 exchanges a step and "
        "the owned parameters' whole masters and gradients priced",
    )  # fmt: skip
    acts = parser.add_argument_group(
        "activations (tensor-parallel traffic, ZeRO-R's checkpoints; with --params: give --n-layer, --d-model, --block-size)"
    )
    add_config_flags(acts, ("micro_batch_size",))
    for name in ZERO_R_FLAGS:
        acts.add_argument(f"--{name.replace('_', '-')}", action="store_true", help=ZERO_R_HELP[name])
    out = parser.add_argument_group("output")
    out.add_argument(
        "--zero-table",
        action="store_true",
        help="the ZeRO paper's Table 1 (with --tensor-parallel N: at model parallelism N), Table 2, §7-8's examples",
    )
    out.add_argument("--zero-r-example", action="store_true", help="the ZeRO paper's Pa example (SC20 §6.1, §8)")
    out.add_argument("--zeropp-table", action="store_true", help="the ZeRO++ paper's Table 1 and hpZ example (Fig. 4)")
    out.add_argument("--json", type=Path, metavar="PATH", help="also write the numbers as JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        tables = args.zero_table or args.zeropp_table or args.zero_r_example
        result, shows = _tables(args) if tables else _estimate(args)
    except UsageError as error:
        print(f"zeropp estimate: error: {error}", file=sys.stderr)
        return 2
    except ConfigError as error:
        print(f"zeropp estimate: error: {_flag_names(str(error))}", file=sys.stderr)
        return 2
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    for show in shows:
        show()
    return 0


def _flag_names(message: str) -> str:
    """Config keys in an error message as the flags that set them (zero.stage -> --stage)."""
    flags = {f"zero.{n}" for n in (*ZERO_FLAGS, *ZERO_R_FLAGS)} | {f"model.{n}" for n in MODEL_FLAGS}
    flags |= {"topology.nodes", TP_KEY, SP_KEY}
    return re.sub(
        r"\b(?:zero|model|topology)\.\w+",
        lambda m: "--" + m[0].split(".")[1].replace("_", "-") if m[0] in flags else m[0],
        message,
    )


Shows = list[Callable[[], None]]  # what to print, after the JSON is written


def _estimate(args: argparse.Namespace) -> tuple[dict[str, Any], Shows]:
    if args.world is None:
        raise UsageError("argument --world is required (or ask for --zero-table / --zeropp-table / --zero-r-example)")
    if args.config is not None and not args.config.is_file():
        raise UsageError(f"argument --config: {str(args.config)!r} is not allowed; expected a .toml or .json file")
    overrides = {k: v for k, v in vars(args).items() if "." in k and v is not None}
    nodes = _nodes(args, overrides.get("topology.nodes"))
    if nodes is not None:
        overrides["topology.nodes"] = nodes
    # the estimator prices the method: what training refuses with tensor parallelism for now (a precision)
    # is not refused here, so the tensor-parallel size is applied after the config is read
    tp, sp = overrides.pop(TP_KEY, None), overrides.pop(SP_KEY, None)
    config = load_config(args.config, overrides)
    topology = dataclasses.replace(
        config.topology,
        tensor_parallel_size=tp or config.topology.tensor_parallel_size,
        sequence_parallel=config.topology.sequence_parallel if sp is None else sp,
    )
    topology.validate()
    tp, cp = topology.tensor_parallel_size, topology.context_parallel_size
    activations = _activations(args, config, topology.sequence_parallel, cp)
    if activations is not None and topology.sequence_parallel:
        from zeropp.tensor_parallel.apply import check_sequence_length

        check_sequence_length(activations.seq, tp)  # as zeropp train refuses it
    if cp > 1:
        if activations is None:
            raise UsageError(
                "argument --context-parallel-size: a --params model needs its shape; expected --n-layer, --d-model, --block-size too"
            )
        check_length(activations.seq, cp)  # as zeropp train refuses it
        if args.params is None:
            from zeropp.app.models.gpt import gpt_config

            check_heads(gpt_config(config.model).n_head, cp, "model.n_head", tp)
    model = args.params if args.params is not None else gpt_unit_numels(config.model, tp)
    ep = topology.expert_parallel_size
    experts = None if args.params is not None else gpt_experts(config.model, ep)
    if experts is None and ep > 1:
        raise UsageError(
            f"argument --expert-parallel-size: {ep} needs a mixture of experts; expected --n-experts (the embedded GPT's)"
        )
    if experts is not None and experts.experts % ep:
        raise UsageError(f"argument --expert-parallel-size: {ep} does not divide --n-experts {experts.experts}")
    est = estimate(
        model,
        args.world,
        config.topology.nodes or 1,
        config.zero,
        optimizer_bytes=args.optimizer_state_bytes,
        tensor_parallel=tp,
        activations=activations,
        frozen_fraction=args.frozen_fraction,
        whole_parameters=args.optimizer_path == "whole",
        experts=experts,
        expert_units=gpt_expert_unit_numels(config.model) if experts is not None else (),
    )
    backend = args.backend or ("gloo" if config.topology.backend == "gloo" else "nccl")
    result = est.as_dict(args.intra_node_bandwidth, args.inter_node_bandwidth, args.compute_seconds, backend)
    result["model"] = {"params": args.params} if args.params is not None else dataclasses.asdict(config.model)
    return result, [lambda: print_estimate(est, result)]


def _activations(
    args: argparse.Namespace, config: Config, sequence_parallel: bool, context_parallel: int = 1
) -> Activations | None:
    """The transformer's activations: the embedded GPT's, or a --params model's from --n-layer, --d-model
    and --block-size, with the GPT's layer norms (None without them: its tensor-parallel traffic and
    checkpoints are not priced)."""
    switches = {name: getattr(args, name) for name in ZERO_R_FLAGS}
    micro = config.train.micro_batch_size
    if args.params is None:
        return gpt_activations(
            config.model, micro, sequence_parallel=sequence_parallel, context_parallel=context_parallel, **switches
        )
    shape = {name: getattr(config.model, name) for name in SHAPE_FLAGS}
    missing = [f"--{_dashed(name)}" for name, value in shape.items() if value is None]
    if not missing:
        layers = shape["n_layer"]
        return Activations(
            layers, shape["d_model"], shape["block_size"], micro, sequence_parallel=sequence_parallel,
            norm_parameters=gpt_norm_parameters(layers), context_parallel=context_parallel, **switches,
        )  # fmt: skip
    if len(missing) < len(shape) or any(switches.values()):
        what = "activation checkpoints" if any(switches.values()) else "the activations"
        raise UsageError(
            f"argument --params: {what} of a --params model need its shape; expected {', '.join(missing)} too"
        )
    return None


def _dashed(name: str) -> str:
    return name.replace("_", "-")


def _nodes(args: argparse.Namespace, nodes: int | None) -> int | None:
    """--nodes, or --world / --ranks-per-node."""
    if args.ranks_per_node is None:
        return nodes
    if args.world % args.ranks_per_node:
        raise UsageError(
            f"argument --ranks-per-node: {args.ranks_per_node} is not allowed; expected a divisor of --world {args.world}"
        )
    return args.world // args.ranks_per_node


def _tables(args: argparse.Namespace) -> tuple[dict[str, Any], Shows]:
    result: dict[str, Any] = {}
    shows: Shows = []
    if args.zero_table:
        mp = getattr(args, TP_KEY) or 1
        result["zero_table_1_gb"] = zero_table(mp)
        result["zero_table_1_mp"] = mp
        result["zero_table_2_max_params"] = max_model_table()
        result["zero_section_7_example_gb"] = mp_example()
        result["zero_trillion_example"] = trillion_example()
        shows.append(lambda: print_zero_table(result["zero_table_1_gb"], mp))
        shows.append(lambda: print_max_model_table(result))
    if args.zero_r_example:
        result["zero_r_pa_example"] = pa_example()
        shows.append(lambda: print_pa_example(result["zero_r_pa_example"]))
    if args.zeropp_table:
        nodes, per_node = 64, 8
        if args.world is not None:
            nodes = _nodes(args, getattr(args, "topology.nodes")) or 1
            if nodes < 2:
                raise UsageError(f"argument --nodes: {nodes} is not allowed; expected >= 2 with --zeropp-table")
            per_node = Layout(args.world, nodes).ranks_per_node
        result["zeropp_table_1"] = zeropp_table(nodes, per_node, args.params or 100_000_000_000)
        result["hpz_example"] = hpz_example()
        shows.append(lambda: print_zeropp_table(result["zeropp_table_1"], result["hpz_example"]))
    return result, shows
