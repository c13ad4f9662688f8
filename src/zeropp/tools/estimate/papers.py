"""The papers' tables, computed from the estimator's models: ZeRO Table 1 (model states per device,
also with model parallelism), ZeRO Table 2 and §7-8 (ZeRO with model parallelism: the largest model,
a trillion parameters on 1024 GPUs), ZeRO-R's partitioned activation checkpoints (SC20 §6.1, §8),
ZeRO++ Table 1 (cross-node volume per iteration) and ZeRO++'s hpZ memory example (Fig. 4)."""

from __future__ import annotations

import dataclasses
from decimal import ROUND_FLOOR, ROUND_HALF_UP, Decimal
from typing import Any

from zeropp.config.sections import ZEROPP_SWITCHES, ZeroConfig
from zeropp.costs.memory import BYTES, PAPER_RECOMPUTED_ALL_REDUCES, Activations, analytic_model_state_bytes
from zeropp.costs.volume import PA_GATHER, activation_transfers
from zeropp.index.ranks import Layout
from zeropp.tools.estimate.model import estimate

# ZeRO (Rajbhandari et al. 2020) Table 1: mixed-precision Adam (2Ψ + 2Ψ + KΨ, K = 12), GB = 1e9 bytes
ZERO_TABLE_MODELS = {"7.5B": 7_500_000_000, "128B": 128_000_000_000, "1T": 1_000_000_000_000}
ZERO_TABLE_STAGES = {"Pos": 1, "Pos+g": 2, "Pos+g+p": 3}
ZERO_TABLE_DP = (1, 4, 16, 64, 256, 1024)


def zero_table(mp: int = 1) -> dict[str, dict[str, dict[int, float]]]:
    """{model: {stage name: {DP degree: GB per device}}}, model states only; with model parallelism of
    `mp` each device holds Ψ/mp of the model (ZeRO §7: the savings multiply)."""
    return {
        model: {
            name: {n: model_states_gb(psi, n, mp, stage) for n in ZERO_TABLE_DP}
            for name, stage in ZERO_TABLE_STAGES.items()
        }
        for model, psi in ZERO_TABLE_MODELS.items()
    }


def model_states_gb(psi: int, dp: int, mp: int, stage: int) -> float:
    """GB per device of a Ψ-parameter model with `mp`-way model and `dp`-way ZeRO data parallelism, fp16
    with Adam (K = 12): ZeRO §7's (4Ψ + 12Ψ/N_d)/N_m, (2Ψ + 14Ψ/N_d)/N_m, 16Ψ/(N_d N_m); 16Ψ/N_m at stage 0."""
    return analytic_model_state_bytes(psi / mp, dp, stage, "fp16") / 1e9


# ZeRO Table 2 and §7-8: ZeRO with model parallelism on DGX-2 nodes of 32 GB V100s, 64-way data parallelism
V100_BYTES = 32 * 10**9
ZERO_TABLE_2_MP = (1, 2, 4, 8, 16)
ZERO_TABLE_2_DP = 64
ZERO_TABLE_2_STAGES = {"Baseline": 0, **ZERO_TABLE_STAGES}


def max_model_table(device_bytes: int = V100_BYTES, dp: int = ZERO_TABLE_2_DP) -> dict[int, dict[str, float]]:
    """ZeRO Table 2 (left): {MP degree: {stage name: the largest Ψ whose model states fit one device}} on
    MP x `dp` GPUs: `device_bytes` x N_m over the bytes per parameter at N_d = `dp`."""
    return {
        mp: {
            name: device_bytes * mp / analytic_model_state_bytes(1, dp, stage, "fp16")
            for name, stage in ZERO_TABLE_2_STAGES.items()
        }
        for mp in ZERO_TABLE_2_MP
    }


def mp_example(psi: int = 32 * 10**9, mp: int = 16, dp: int = ZERO_TABLE_2_DP) -> dict[str, float]:
    """ZeRO §7's worked example: {stage name: GB per device} of a 32B model with 16-way model and 64-way
    data parallelism (the paper: 8.4, 4.4 and 0.5 GB with ZeRO, at least 32 GB without)."""
    return {name: model_states_gb(psi, dp, mp, stage) for name, stage in ZERO_TABLE_2_STAGES.items()}


def trillion_example(psi: int = 10**12, mp: int = 16, nodes: int = 64) -> dict[str, Any]:
    """ZeRO §8 (and the abstract): a trillion parameters on 1024 GPUs, 16-way model parallelism inside
    each DGX-2 node and 64-way data parallelism across nodes. Model states per GPU at every stage from
    the estimator (tensor parallel `mp`, Ψ/mp per rank, padded as the engine pads), and whether they fit
    a 32 GB V100."""
    world = mp * nodes
    per_stage = {
        name: estimate(
            psi, world, nodes, ZeroConfig(stage=stage, precision="fp16"), tensor_parallel=mp
        ).model_state_bytes
        for name, stage in ZERO_TABLE_2_STAGES.items()
    }
    return {
        "params": psi,
        "gpus": world,
        "mp": mp,
        "dp": world // mp,
        "bytes_per_gpu": per_stage,
        "fits": {name: b <= V100_BYTES for name, b in per_stage.items()},
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


# ZeRO (SC20) §6.1: a 100B model of Table 4 (80B-170B: hidden 8192; 100B: 125 layers), batch 32,
# sequence 1024, MP 16, one checkpoint per transformer layer, fp16 activations, the whole forward recomputed
ZERO_R_MODEL = Activations(
    layers=125,
    hidden=8192,
    seq=1024,
    batch=32,
    activation_checkpointing=True,
    recomputed_all_reduces=PAPER_RECOMPUTED_ALL_REDUCES,
)
ZERO_R_MP = 16


def pa_example(activations: Activations = ZERO_R_MODEL, mp: int = ZERO_R_MP, precision: str = "fp16") -> dict[str, Any]:
    """ZeRO-R's worked example (SC20 §6.1) and its communication analysis (§8): activation-checkpoint
    bytes per GPU without Pa, with Pa and with Pa+cpu, and Pa's all-gather bytes per step against the
    tensor-parallel all-reduces (Megatron's layout with checkpointing, the paper's recomputation of the
    whole forward), from the estimator's models.
    Elements are reported too: the paper's "about 33 GB" and "about 2 GB" are the element counts."""
    element = BYTES[precision]
    pa = dataclasses.replace(activations, partition_activations=True)
    cpu = dataclasses.replace(pa, cpu_checkpointing=True)
    sent = {"tp": 0, "pa": 0}
    for t in activation_transfers(pa, mp, element, micro=1):
        sent["pa" if t.op == PA_GATHER else "tp"] += t.sent
    return {
        "layers": activations.layers,
        "hidden": activations.hidden,
        "seq": activations.seq,
        "batch": activations.batch,
        "mp": mp,
        "params": 12 * activations.hidden**2 * activations.layers,  # 12 h^2 per block (§8)
        "checkpoint_elements": {
            "without Pa": activations.layers * activations.checkpoint_elements(mp),
            "Pa": pa.layers * pa.checkpoint_elements(mp),
        },
        "checkpoint_bytes": {
            "without Pa": activations.checkpoint_bytes(mp, element),
            "Pa": pa.checkpoint_bytes(mp, element),
            "Pa+cpu": cpu.checkpoint_bytes(mp, element),
            "Pa+cpu host": cpu.checkpoint_bytes(mp, element, "host"),
        },
        "tensor_parallel_bytes_per_step": sent["tp"],
        "pa_bytes_per_step": sent["pa"],
        "pa_over_tensor_parallel": sent["pa"] / sent["tp"],
    }


def paper_params(params: float) -> str:
    """A parameter count in ZeRO Table 2's units: billions to 0.1 (7.6B, 121.6B, 128B), trillions to three
    figures from 1T (2.05T)."""
    if params >= 1e12:
        return f"{params / 1e12:.3g}T"
    return f"{params / 1e9:.1f}".removesuffix(".0") + "B"


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
