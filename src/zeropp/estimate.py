"""``zeropp estimate``: per-rank memory of model states and per-step communication, without running anything.

Three models (derivations, paper references and the reproduced tables: docs/estimate.md):

- **Memory** of model states per rank: :func:`zeropp.memory.analytic_model_state_bytes` (ZeRO Table 1,
  hpZ's secondary copy), per unit, on the padded unit sizes the engine allocates.
- **Communication**: every collective the engine issues in one optimizer step, priced with the ledger's
  byte model (comm/ledger.py), so the estimate is what the ledger records: exactly, unit for unit. The
  model is given as Ψ (one flat unit) or as the numel of every unit; padding follows
  :class:`~zeropp.partition.FlatLayout`. Left out: the one-off broadcast of the initial weights,
  evaluation, and fp16 steps skipped for overflow (they gather no updated weights).
- **Time**: intra-node bytes of the busiest rank / intra-node bandwidth + bytes leaving one node /
  inter-node bandwidth, summed over the step's collectives with no overlap (neither between collectives
  nor between the two kinds of link). The inter-node bandwidth is a node's (its ranks share it), the
  intra-node one a rank's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from decimal import ROUND_FLOOR, ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any

from zeropp.comm.ledger import Ledger, ring_bytes
from zeropp.comm.volume import zero3_step_bytes
from zeropp.config import ConfigError, ModelConfig, ZeroConfig, load_config
from zeropp.memory import BYTES, analytic_model_state_bytes
from zeropp.partition import FlatLayout, column_chunks
from zeropp.quant import QuantSpec
from zeropp.topology import Layout

STEP_PHASES = ("forward", "backward", "step")
SCALE_BYTES = 4  # one fp32 scale per quantization block

# -- communication model -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Transfer:
    """One collective call as one rank sees it: `sent` bytes under the ledger's byte model.

    `crossing` is the share of ranks whose bytes leave their node. A ring over consecutive ranks
    crosses at the last rank of each node it spans (the node's *edge* rank): (nodes spanned) / (group
    size), or 0 inside one node. An all-to-all hop is 0 (inside a node) or 1 (between nodes).
    """

    op: str
    phase: str
    sent: int
    crossing: float

    def crosses(self, rank: int, ranks_per_node: int) -> bool:
        return self.crossing == 1 or (self.crossing > 0 and rank % ranks_per_node == ranks_per_node - 1)


def ring_crossing(group_size: int, ranks_per_node: int) -> float:
    """Share of a ring's ranks (consecutive, node-major) whose successor lives on another node."""
    spanned = group_size // ranks_per_node if group_size > ranks_per_node else 1
    return spanned / group_size if spanned > 1 else 0.0


@dataclass(frozen=True)
class Unit:
    numel: int
    padded: int
    resident: bool  # not gathered per use: stages 0-2, or at most zero.persistence_threshold elements


@dataclass(frozen=True)
class Estimate:
    """One optimizer step of a model on a cluster under a ZeroConfig (built by :func:`estimate`)."""

    units: tuple[Unit, ...]
    layout: Layout
    zero: ZeroConfig
    hpz_group_size: int
    optimizer_bytes: int
    transfers: tuple[Transfer, ...]

    @property
    def psi(self) -> int:
        return sum(u.numel for u in self.units)

    @property
    def padded_psi(self) -> int:
        return sum(u.padded for u in self.units)

    @property
    def model_state_bytes(self) -> float:
        """Per rank. A resident unit at stage 3 keeps whole weights and no secondary copy: stage 2's formula."""
        zero, world = self.zero, self.layout.world_size
        return sum(
            analytic_model_state_bytes(
                u.padded,
                world,
                2 if zero.stage == 3 and u.resident else zero.stage,
                zero.precision,
                zero.grad_dtype,
                self.optimizer_bytes,
                1 if u.resident else self.hpz_group_size,
            )
            for u in self.units
        )

    def ledger(self, rank: int | None = None) -> Ledger:
        """Bytes per optimizer step as the engine's ledger records them: `rank`'s, or the mean over ranks."""
        ledger, per_node = Ledger(steps=1), self.layout.ranks_per_node
        for t in self.transfers:
            with ledger.in_phase(t.phase):
                if rank is None:
                    ledger.record(t.op, t.sent * (1 - t.crossing), t.sent * t.crossing)
                elif t.crosses(rank, per_node):
                    ledger.record(t.op, 0, t.sent)
                else:
                    ledger.record(t.op, t.sent, 0)
        return ledger

    def node_inter_bytes(self) -> float:
        """Bytes leaving one node per step (every node sends the same)."""
        return self.layout.ranks_per_node * self.ledger().total(link="inter")

    def busiest_intra_bytes(self) -> int:
        """Intra-node bytes per step of the rank that sends the most inside its node."""
        per_node = self.layout.ranks_per_node
        return max(self.ledger(rank).total(link="intra") for rank in {0, per_node - 1})

    def seconds(self, intra_bits_per_s: float, inter_bits_per_s: float) -> dict[str, float]:
        intra = 8 * self.busiest_intra_bytes() / intra_bits_per_s
        inter = 8 * self.node_inter_bytes() / inter_bits_per_s
        return {"intra": intra, "inter": inter, "total": intra + inter}

    def zero3_bytes(self) -> dict[str, dict[str, float]]:
        """What plain ZeRO-3 would send on the same units ({phase: {link: mean bytes per rank}})."""
        zero = self.zero
        return zero3_step_bytes(
            [(u.padded, u.resident) for u in self.units],
            self.layout,
            compute_bytes=BYTES[zero.precision],
            grad_bytes=BYTES[zero.grad_dtype or zero.precision],
            accumulation=zero.gradient_accumulation_steps,
        )

    def as_dict(self, intra_bits_per_s: float, inter_bits_per_s: float) -> dict[str, Any]:
        mean, zero3 = self.ledger(), self.zero3_bytes()
        return {
            "params": self.psi,
            "padded_params": self.padded_psi,
            "unit_numels": [u.numel for u in self.units],
            "world_size": self.layout.world_size,
            "nodes": self.layout.nodes,
            "ranks_per_node": self.layout.ranks_per_node,
            "zero": dataclasses.asdict(self.zero),
            "hpz_group_size": self.hpz_group_size,
            "optimizer_state_bytes": self.optimizer_bytes,
            "model_state_bytes_per_rank": self.model_state_bytes,
            "bytes_per_step": {
                phase: {link: mean.total(phase=phase, link=link) for link in ("intra", "inter")}
                for phase in STEP_PHASES
            },
            "intra_node_bytes_per_step": mean.total(link="intra"),
            "inter_node_bytes_per_step": mean.total(link="inter"),
            "ledger": mean.as_dict(),
            "node_inter_node_bytes_per_step": self.node_inter_bytes(),
            "busiest_rank_intra_node_bytes_per_step": self.busiest_intra_bytes(),
            "zero3_inter_node_bytes_per_step": sum(zero3[p]["inter"] for p in STEP_PHASES),
            "bandwidth_bits_per_s": {"intra": intra_bits_per_s, "inter": inter_bits_per_s},
            "predicted_comm_seconds_per_step": self.seconds(intra_bits_per_s, inter_bits_per_s),
        }


def estimate(
    model: int | Sequence[int],
    world: int,
    nodes: int = 1,
    zero: ZeroConfig | None = None,
    *,
    optimizer_bytes: int = 8,
) -> Estimate:
    """Estimate one optimizer step of `model` (Ψ as one flat unit, or every unit's numel) on `world`
    ranks over `nodes` nodes under `zero` (ZeroConfig's defaults when None). `optimizer_bytes`: optimizer
    state per parameter beside the fp32 master (Adam: 8). Raises ConfigError for a bad combination."""
    zero = zero or ZeroConfig()
    zero.validate()
    layout = Layout(world, nodes)
    hpz = zero.hpz_group_size(world, layout.ranks_per_node)
    numels = [model] if isinstance(model, int) else list(model)
    shard_world = world if zero.stage >= 1 else 1
    units = tuple(
        Unit(n, FlatLayout(((n,),), shard_world, zero.shard_alignment).padded_numel, _resident(n, zero)) for n in numels
    )
    return Estimate(units, layout, zero, hpz, optimizer_bytes, tuple(_transfers(units, layout, zero, hpz)))


def _resident(numel: int, zero: ZeroConfig) -> bool:
    return zero.stage < 3 or numel <= zero.persistence_threshold


def _transfers(units: Sequence[Unit], layout: Layout, zero: ZeroConfig, hpz: int) -> Iterator[Transfer]:
    """The engine's collectives in one step (engine.py, units.py): per unit, then the step's scalars.

    Stage 0 all-reduces gradients once per step; stage 1 reduce-scatters them once per step and stage 2
    and 3 every micro-batch; resident units all-gather the updated weights in the step. A sharded unit
    gathers in forward and backward of every micro-batch: over the world (qwZ: quantized), or, with hpZ,
    inside its secondary group in the compute dtype once the step's first forward has cut the copy.
    """
    world, per_node = layout.world_size, layout.ranks_per_node
    compute, grad = BYTES[zero.precision], BYTES[zero.grad_dtype or zero.precision]
    micro = zero.gradient_accumulation_steps
    across_world = ring_crossing(world, per_node)
    for unit in units:
        if zero.stage == 0:
            yield Transfer("all_reduce", "backward", ring_bytes(unit.padded * grad, world, 2), across_world)
            continue
        for _ in range(micro if zero.stage >= 2 else 1):
            yield from _reduce_gradients(unit.padded, grad, layout, zero)
        if unit.resident:
            yield Transfer("all_gather", "step", ring_bytes(unit.padded * compute, world), across_world)
            continue
        for index in range(micro):
            for phase in ("forward", "backward"):
                if hpz > 1 and (index, phase) != (0, "forward"):
                    yield Transfer(
                        "all_gather", phase, ring_bytes(unit.padded * compute, hpz), ring_crossing(hpz, per_node)
                    )
                else:
                    yield from _gather_weights(unit.padded, compute, phase, world, across_world, zero)
    if zero.stage >= 1:  # the gradient norm over the shards (and fp16's overflow check): one fp32 each
        for _ in range(2 if zero.precision == "fp16" else 1):
            yield Transfer("all_reduce", "step", ring_bytes(4, world, 2), across_world)


def _gather_weights(
    padded: int, compute: int, phase: str, world: int, crossing: float, zero: ZeroConfig
) -> Iterator[Transfer]:
    """All-gather of a unit's weights over the world; qwZ gathers int8/int4 data and fp32 scales, each
    rank's shard quantized as one row."""
    if not zero.quantized_weights:
        yield Transfer("all_gather", phase, ring_bytes(padded * compute, world), crossing)
        return
    block = zero.weight_block_size if zero.weight_quantization == "block" else None
    spec, shard = QuantSpec(zero.weight_bits, block), padded // world
    for row in (spec.row_bytes(shard), SCALE_BYTES * spec.blocks(shard)):
        yield Transfer("all_gather", phase, ring_bytes(world * row, world), crossing)


def _reduce_gradients(padded: int, grad: int, layout: Layout, zero: ZeroConfig) -> Iterator[Transfer]:
    """Reduce-scatter of a unit's gradients: a ring over the world, or qgZ's two all-to-all hops.

    qgZ (comm/quantized.py) cuts the shard's columns into chunks; per chunk of c columns, hop 1 sends
    (X-1)/X of the W quantized rows inside the node and hop 2 sends (Y-1)/Y of the Y re-quantized
    partial sums to the other nodes (X ranks per node, Y nodes, W = XY); data and scales separately.
    """
    world, per_node, nodes = layout.world_size, layout.ranks_per_node, layout.nodes
    if not zero.quantized_gradients:
        yield Transfer("reduce_scatter", "backward", ring_bytes(padded * grad, world), ring_crossing(world, per_node))
        return
    spec, shard = QuantSpec(zero.gradient_bits, zero.gradient_block_size), padded // world
    pieces = math.ceil(shard / zero.reduce_bucket_numel) * zero.qgz_pipeline_stages
    for start, stop in column_chunks(shard, pieces):
        for row in (spec.row_bytes(stop - start), SCALE_BYTES * spec.blocks(stop - start)):
            if per_node > 1:
                yield Transfer("all_to_all", "backward", (per_node - 1) * nodes * row, 0.0)
            if nodes > 1:
                yield Transfer("all_to_all", "backward", (nodes - 1) * row, 1.0)


def gpt_unit_numels(model: ModelConfig) -> list[int]:
    """The numel of every unit the engine makes of the embedded GPT (its blocks, then the root)."""
    import torch

    from zeropp.models.gpt import GPT, PRESETS
    from zeropp.units import group_parameters, repeated_blocks

    overrides = {k: v for k, v in dataclasses.asdict(model).items() if k != "preset" and v is not None}
    with torch.device("meta"):
        gpt = GPT(dataclasses.replace(PRESETS[model.preset], **overrides))
    return [sum(p.numel() for _, p in params) for _, params in group_parameters(gpt, repeated_blocks(gpt))]


# -- the papers' tables -----------------------------------------------------------------------------------

# ZeRO (Rajbhandari et al. 2020) Table 1: mixed-precision Adam (2Ψ + 2Ψ + KΨ, K = 12), GB = 1e9 bytes
ZERO_TABLE_MODELS = {"7.5B": 7_500_000_000, "128B": 128_000_000_000, "1T": 1_000_000_000_000}
ZERO_TABLE_STAGES = {"Pos": 1, "Pos+g": 2, "Pos+g+p": 3}
ZERO_TABLE_DP = (1, 4, 16, 64, 256, 1024)


def zero_table() -> dict[str, dict[str, dict[int, float]]]:
    """{model: {stage name: {DP degree: GB per device}}}, model states only."""
    return {
        model: {
            name: {n: analytic_model_state_bytes(psi, n, stage, "fp16") / 1e9 for n in ZERO_TABLE_DP}
            for name, stage in ZERO_TABLE_STAGES.items()
        }
        for model, psi in ZERO_TABLE_MODELS.items()
    }


def paper_gb(gb: float) -> str:
    """A GB figure the way the ZeRO paper's Table 1 prints it: whole GB cut down (not rounded) from 100
    on (513.5 -> 513, 4187.5 -> 4187), else half-up to 1 decimal from 10 on and 2 below, trailing zeros
    dropped (41.25 -> 41.3, 1.875 -> 1.88, 7.50 -> 7.5)."""
    value = Decimal(gb)
    if value >= 100:
        text = str(value.quantize(Decimal(1), rounding=ROUND_FLOOR))
    else:
        text = str(value.quantize(Decimal("0.1" if value >= 10 else "0.01"), rounding=ROUND_HALF_UP))
    return text.rstrip("0").rstrip(".") if "." in text else text


# ZeRO++ (Wang et al. 2023) Table 1: cross-node volume per iteration in M (the model's fp16 bytes)
ZEROPP_TABLE_COLUMNS = {  # column: the ledger's (ops, phase)
    "forward all-gather": (("all_gather",), "forward"),
    "backward all-gather": (("all_gather",), "backward"),
    "backward reduce-scatter": (("reduce_scatter", "all_to_all"), "backward"),  # qgZ: two all-to-alls
}
ZEROPP_TABLE_PUBLISHED = {"ZeRO-3": (1.0, 1.0, 1.0), "ZeRO++": (0.5, 0.0, 0.25)}
ZEROPP_SWITCHES = dict(quantized_weights=True, hpz_partition_size=0, quantized_gradients=True)


def zeropp_table(nodes: int = 64, ranks_per_node: int = 8, psi: int = 100_000_000_000) -> dict[str, Any]:
    """ZeRO++ Table 1 from our model: cross-node bytes per node per step, in M = 2Ψ bytes, ZeRO-3 vs ZeRO++
    (qwZ int8, hpZ over each node, qgZ int4, blocks of 256), fp16. Also the intra-node bytes the paper
    leaves out. The default cluster is the paper's section 3.2.1 example (64 nodes x 8 GPUs)."""
    world, rows = nodes * ranks_per_node, {}
    for name, switches in (("ZeRO-3", {}), ("ZeRO++", ZEROPP_SWITCHES)):
        est = estimate(psi, world, nodes, ZeroConfig(stage=3, precision="fp16", **switches))
        mean, m = est.ledger(), 2 * est.padded_psi
        per_node = [
            ranks_per_node * sum(mean.total(op=op, phase=phase, link="inter") for op in ops) / m
            for ops, phase in ZEROPP_TABLE_COLUMNS.values()
        ]
        rows[name] = {"inter": per_node, "intra": ranks_per_node * mean.total(link="intra") / m}
    ratios = [zpp / z3 for zpp, z3 in zip(rows["ZeRO++"]["inter"], rows["ZeRO-3"]["inter"], strict=True)]
    total_ratio = sum(rows["ZeRO++"]["inter"]) / sum(rows["ZeRO-3"]["inter"])
    return {
        "nodes": nodes,
        "ranks_per_node": ranks_per_node,
        "params": psi,
        "rows": rows,
        "ratios": ratios + [total_ratio],
    }


def hpz_example(psi: int = 100_000_000_000, nodes: int = 64, ranks_per_node: int = 16) -> dict[str, float]:
    """ZeRO++ Fig. 4: per-device model states of DP, ZeRO-3 and hpZ (secondary group = one node) for a
    100B model on 1024 V100s (64 DGX-2 nodes x 16), fp16 with Adam (K = 12), and their ratios."""
    world = nodes * ranks_per_node
    group = ZeroConfig(stage=3, hpz_partition_size=0).hpz_group_size(world, ranks_per_node)
    dp, zero3 = (analytic_model_state_bytes(psi, world, stage, "fp16") for stage in (0, 3))
    hpz = analytic_model_state_bytes(psi, world, 3, "fp16", hpz_group_size=group)
    return {
        "dp_bytes": dp,
        "zero3_bytes": zero3,
        "hpz_bytes": hpz,
        "hpz_group_size": group,
        "hpz_over_zero3": hpz / zero3,
        "dp_over_hpz": dp / hpz,
    }


# -- command line -----------------------------------------------------------------------------------------

ZERO_FLAGS = (
    "stage", "precision", "grad_dtype", "gradient_accumulation_steps", "persistence_threshold", "shard_alignment",
    "reduce_bucket_numel", "quantized_weights", "weight_bits", "weight_block_size", "weight_quantization",
    "hpz_partition_size", "quantized_gradients", "gradient_bits", "gradient_block_size", "qgz_pipeline_stages",
)  # fmt: skip
MODEL_FLAGS = ("preset", "n_layer", "n_head", "d_model", "block_size")
RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
RATE_UNITS |= {"b": 8, "kb": 8e3, "mb": 8e6, "gb": 8e9, "tb": 8e12}  # bytes per second
DEFAULT_BANDWIDTH = {"intra": "100gbit", "inter": "200mbit"}  # inter: the emulated cluster's tc limit


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:  # one line, no usage block
        raise _UsageError(message)


def parse_bandwidth(text: str) -> float:
    """Bits per second from '200mbit', '100gbit', '25GB' (bytes/s), ...; decimal prefixes, as tc reads them."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?(?:e[+-]?\d+)?)\s*([a-z]+)(?:/s)?\s*", text.lower())
    if not match or match[2] not in RATE_UNITS or float(match[1]) <= 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not allowed; expected a rate > 0 with a unit: bit, kbit, mbit, gbit, tbit (bits/s) "
            "or B, KB, MB, GB, TB (bytes/s), e.g. 200mbit"
        )
    return float(match[1]) * RATE_UNITS[match[2]]


def _param_count(text: str) -> int:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not (value >= 1 and value.is_integer()):
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; expected a whole number >= 1, e.g. 7.5e9")
    return int(value)


def _at_least(minimum: int):
    def parse(text: str) -> int:
        if not text.isdigit() or int(text) < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} is not allowed; expected an integer >= {minimum}")
        return int(text)

    return parse


def _config_flags(group: argparse._ArgumentGroup, section: type, prefix: str, names: Sequence[str]) -> None:
    """One flag per config key, as `zeropp train` names them (--stage, --quantized-weights, ...)."""
    hints = typing.get_type_hints(section)
    for name in names:
        flag, dest, hint = "--" + name.replace("_", "-"), f"{prefix}.{name}", hints[name]
        if typing.get_origin(hint) in (typing.Union, types.UnionType):
            hint = next(a for a in typing.get_args(hint) if a is not type(None))
        if typing.get_origin(hint) is typing.Literal:
            choices = typing.get_args(hint)
            group.add_argument(flag, dest=dest, choices=choices, type=type(choices[0]))
        elif hint is bool:
            group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction)
        else:
            group.add_argument(flag, dest=dest, type=hint, metavar=hint.__name__.upper())


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="zeropp estimate",
        description="Per-rank memory of model states, per-step communication (intra-/inter-node bytes) and "
        "predicted communication time of zeropp, computed without running it (models: docs/estimate.md).",
    )
    model = parser.add_argument_group("model (default: the config's, else the embedded GPT 'small')")
    model.add_argument("--params", type=_param_count, metavar="N", help="parameter count Ψ, one flat unit (7.5e9)")
    model.add_argument("--config", type=Path, help="a zeropp TOML/JSON config: its zero, model and topology keys")
    _config_flags(model, ModelConfig, "model", MODEL_FLAGS)
    cluster = parser.add_argument_group("cluster")
    cluster.add_argument("--world", type=_at_least(1), metavar="N", help="ranks (GPUs) in all")
    nodes = cluster.add_mutually_exclusive_group()
    nodes.add_argument("--nodes", dest="topology.nodes", type=int, metavar="N", help="nodes (default 1)")
    nodes.add_argument("--ranks-per-node", type=_at_least(1), metavar="N")
    for link in ("intra", "inter"):
        cluster.add_argument(
            f"--{link}-node-bandwidth",
            type=parse_bandwidth,
            default=parse_bandwidth(DEFAULT_BANDWIDTH[link]),
            metavar="RATE",
            help=f"{'a rank' if link == 'intra' else 'a node'}'s {link}-node bandwidth (default {DEFAULT_BANDWIDTH[link]})",
        )
    zero = parser.add_argument_group("ZeRO / ZeRO++ (zeropp's config keys; ZeRO++ off unless switched on)")
    _config_flags(zero, ZeroConfig, "zero", ZERO_FLAGS)
    zero.add_argument(
        "--optimizer-state-bytes", type=_at_least(0), default=8, metavar="N", help="beside the fp32 master (Adam: 8)"
    )
    out = parser.add_argument_group("output")
    out.add_argument("--zero-table", action="store_true", help="the ZeRO paper's Table 1, computed")
    out.add_argument("--zeropp-table", action="store_true", help="the ZeRO++ paper's Table 1 and hpZ example (Fig. 4)")
    out.add_argument("--json", type=Path, metavar="PATH", help="also write the numbers as JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        result, shows = _tables(args) if args.zero_table or args.zeropp_table else _estimate(args)
    except _UsageError as error:
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
    flags = {f"zero.{n}" for n in ZERO_FLAGS} | {f"model.{n}" for n in MODEL_FLAGS} | {"topology.nodes"}
    return re.sub(
        r"\b(?:zero|model|topology)\.\w+",
        lambda m: "--" + m[0].split(".")[1].replace("_", "-") if m[0] in flags else m[0],
        message,
    )


Shows = list[Callable[[], None]]  # what to print, after the JSON is written


def _estimate(args: argparse.Namespace) -> tuple[dict[str, Any], Shows]:
    if args.world is None:
        raise _UsageError("argument --world is required (or ask for --zero-table / --zeropp-table)")
    if args.config is not None and not args.config.is_file():
        raise _UsageError(f"argument --config: {str(args.config)!r} is not allowed; expected a .toml or .json file")
    overrides = {k: v for k, v in vars(args).items() if "." in k and v is not None}
    nodes = _nodes(args, overrides.get("topology.nodes"))
    if nodes is not None:
        overrides["topology.nodes"] = nodes
    config = load_config(args.config, overrides)
    model = args.params if args.params is not None else gpt_unit_numels(config.model)
    est = estimate(
        model, args.world, config.topology.nodes or 1, config.zero, optimizer_bytes=args.optimizer_state_bytes
    )
    result = est.as_dict(args.intra_node_bandwidth, args.inter_node_bandwidth)
    result["model"] = {"params": args.params} if args.params is not None else dataclasses.asdict(config.model)
    return result, [lambda: _print_estimate(est, result)]


def _nodes(args: argparse.Namespace, nodes: int | None) -> int | None:
    """--nodes, or --world / --ranks-per-node."""
    if args.ranks_per_node is None:
        return nodes
    if args.world % args.ranks_per_node:
        raise _UsageError(
            f"argument --ranks-per-node: {args.ranks_per_node} is not allowed; expected a divisor of --world {args.world}"
        )
    return args.world // args.ranks_per_node


def _tables(args: argparse.Namespace) -> tuple[dict[str, Any], Shows]:
    result: dict[str, Any] = {}
    shows: Shows = []
    if args.zero_table:
        result["zero_table_1_gb"] = zero_table()
        shows.append(lambda: _print_zero_table(result["zero_table_1_gb"]))
    if args.zeropp_table:
        nodes, per_node = 64, 8
        if args.world is not None:
            nodes = _nodes(args, getattr(args, "topology.nodes")) or 1
            if nodes < 2:
                raise _UsageError(f"argument --nodes: {nodes} is not allowed; expected >= 2 with --zeropp-table")
            per_node = Layout(args.world, nodes).ranks_per_node
        result["zeropp_table_1"] = zeropp_table(nodes, per_node, args.params or 100_000_000_000)
        result["hpz_example"] = hpz_example()
        shows.append(lambda: _print_zeropp_table(result["zeropp_table_1"], result["hpz_example"]))
    return result, shows


# -- printing ---------------------------------------------------------------------------------------------


def _si(n: float, unit: str = "B") -> str:
    """3 significant digits with a decimal prefix (GB = 1e9 bytes, as the papers count)."""
    for prefix in ("", "k", "M", "G", "T", "P"):
        if abs(n) < 999.5 or prefix == "P":
            return f"{n:.3g} {prefix}{unit}" if prefix or unit != "B" else f"{n:,.0f} B"
        n /= 1000
    raise AssertionError


def _seconds(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def _console():
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        console.width = 120
    return console


def _print_estimate(est: Estimate, result: dict[str, Any]) -> None:
    from rich.table import Table

    zero, layout = est.zero, est.layout
    head = Table(title="zeropp estimate", show_header=False)
    head.add_row("parameters", f"{est.psi:,} in {len(est.units)} unit(s), {est.padded_psi:,} padded")
    head.add_row("world / nodes", f"{layout.world_size} ranks on {layout.nodes} node(s) of {layout.ranks_per_node}")
    head.add_row(
        "stage / precision",
        f"{zero.stage} / {zero.precision} (gradients {zero.grad_dtype or zero.precision}), "
        f"{zero.gradient_accumulation_steps} micro-batch(es) per step",
    )
    switches = [f"qwZ int{zero.weight_bits}"] if zero.quantized_weights else []
    switches += [f"hpZ (groups of {est.hpz_group_size})"] if est.hpz_group_size > 1 else []
    switches += [f"qgZ int{zero.gradient_bits}"] if zero.quantized_gradients else []
    head.add_row("ZeRO++", ", ".join(switches) or "off")
    head.add_row("model states per rank", _si(est.model_state_bytes))
    mean = est.ledger()
    head.add_row(
        "sent per rank per step",
        f"intra-node {_si(mean.total(link='intra'))}, inter-node {_si(mean.total(link='inter'))} (mean over ranks)",
    )
    zero3, inter = result["zero3_inter_node_bytes_per_step"], mean.total(link="inter")
    if zero.stage == 3 and zero3:
        head.add_row("inter-node vs ZeRO-3", f"{_si(inter)} vs {_si(zero3)} ({inter / zero3:.3f}x)")
    seconds, bw = result["predicted_comm_seconds_per_step"], result["bandwidth_bits_per_s"]
    head.add_row(
        "predicted comm time",
        f"{_seconds(seconds['total'])} per step = {_si(est.busiest_intra_bytes())} at {_si(bw['intra'], 'bit/s')} "
        f"+ {_si(est.node_inter_bytes())} per node at {_si(bw['inter'], 'bit/s')} (no overlap)",
    )
    console = _console()
    console.print(head)
    table = Table(title="bytes sent per rank per step (mean over ranks)")
    for column in ("collective", "phase", "intra-node", "inter-node"):
        table.add_column(column, justify="right" if "node" in column else "left")
    for op, phases in mean.as_dict().items():
        for phase, links in phases.items():
            table.add_row(op, phase, _si(links["intra"]), _si(links["inter"]))
    console.print(table)


def _print_zero_table(table: dict[str, dict[str, dict[int, float]]]) -> None:
    from rich.table import Table

    out = Table(
        title="ZeRO Table 1: model states per device (GB)",
        caption="fp16 parameters and gradients, Adam (K = 12); GB = 1e9 bytes, rounded as the paper does",
    )
    out.add_column("DP")
    for model, stages in table.items():
        for name in stages:
            out.add_column(f"{model}\n{name}", justify="right")
    for n in ZERO_TABLE_DP:
        out.add_row(str(n), *(paper_gb(stages[name][n]) for stages in table.values() for name in stages))
    _console().print(out)


def _print_zeropp_table(table: dict[str, Any], hpz: dict[str, float]) -> None:
    from rich.table import Table

    nodes, per_node = table["nodes"], table["ranks_per_node"]
    out = Table(
        title="ZeRO++ Table 1: cross-node volume per node per iteration",
        caption=f"M = the model's fp16 bytes (2Ψ); ours: {nodes} nodes x {per_node} ranks, qwZ int8, hpZ per node, "
        "qgZ int4, blocks of 256 with fp32 scales",
    )
    out.add_column("")
    for column in (*ZEROPP_TABLE_COLUMNS, "total", "intra-node (paper: left out)"):
        out.add_column(column, justify="right")
    for name, published in ZEROPP_TABLE_PUBLISHED.items():
        out.add_row(f"{name} (paper)", *(f"{v:g}M" if v else "0" for v in (*published, sum(published))), "")
    for name, row in table["rows"].items():
        out.add_row(
            f"{name} (ours)", *(f"{v:.4f}M" for v in (*row["inter"], sum(row["inter"]))), f"{row['intra']:.3f}M"
        )
    out.add_row("ZeRO++ / ZeRO-3 (ours)", *(f"{r:.4f}" for r in table["ratios"]), "")
    console = _console()
    console.print(out)
    fig = Table(title="ZeRO++ Fig. 4: 100B parameters on 64 nodes x 16 (fp16, Adam: K = 12)", show_header=False)
    fig.add_row("DP: (2+2+K)M", _si(hpz["dp_bytes"]))
    fig.add_row("ZeRO-3: (2+2+K)M/P", _si(hpz["zero3_bytes"]))
    fig.add_row(f"hpZ: (2+2+K)M/P + 2M/{hpz['hpz_group_size']}", _si(hpz["hpz_bytes"]))
    fig.add_row("hpZ / ZeRO-3", f"{hpz['hpz_over_zero3']:.2f}x (paper: 8.9x)")
    fig.add_row("DP / hpZ", f"{hpz['dp_over_hpz']:.1f}x (paper: 114x)")
    console.print(fig)


if __name__ == "__main__":
    sys.exit(main())
