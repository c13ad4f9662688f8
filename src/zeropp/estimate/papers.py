"""The papers' tables, computed from the estimator's models: ZeRO Table 1 (model states per device),
ZeRO++ Table 1 (cross-node volume per iteration) and ZeRO++'s hpZ memory example (Fig. 4)."""

from __future__ import annotations

from decimal import ROUND_FLOOR, ROUND_HALF_UP, Decimal
from typing import Any

from zeropp.config import ZEROPP_SWITCHES, ZeroConfig
from zeropp.estimate.model import estimate
from zeropp.memory import analytic_model_state_bytes
from zeropp.topology import Layout

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
    group = Layout(world, nodes).hpz_group_size(0)
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
