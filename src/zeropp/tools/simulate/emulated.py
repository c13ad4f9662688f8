"""``zeropp simulate`` against the emulated cluster (``zeropp bench cluster``: CPU ranks on gloo, nodes
joined by tc-shaped links): the ``cpu-gloo`` profile's calibration on the stored unshaped steps, and
the simulated step of every stored shaped one (docs/simulate.md, "Against the emulated cluster").

The simulator prices these steps as :mod:`zeropp.tools.bench.cluster.bound` predicts them (the same
bytes, gloo's reduce-scatter as an all-reduce, the link's nominal rate, stage 3's flow shop): given
the step's measured compute instead of the profile's (:func:`with_measured_compute`), it gives
bound.py's prediction. The profile replaces that measurement by the host's rate.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
from collections.abc import Iterator
from typing import Any

from zeropp.config.model import ModelConfig
from zeropp.config.rates import parse_bandwidth
from zeropp.config.sections import ZEROPP_SWITCHES
from zeropp.costs.step_time import BACKWARD_COMPUTE_SHARE
from zeropp.tools.bench.cluster.bound import UNSHAPED
from zeropp.tools.bench.cluster.compare import ZEROPP_KEYS
from zeropp.tools.simulate.gpus import GPUS
from zeropp.tools.simulate.model import Simulation, simulate

PROFILE = "cpu-gloo"
LOOPBACK_BITS_PER_S = 1e15  # an unshaped link: its cost is in the compute, as the bound counts it
# the bench's configurations, and a variant only stored results name
CONFIGS = {**ZEROPP_KEYS, "zeropp ZeRO++ one qgZ chunk": {"stage": 3, **ZEROPP_SWITCHES, "qgz_pipeline_chunks": 1}}
LAYOUT = {"nodes": 2, "ranks_per_node": 2}  # rows that do not say: the 2 x 2 the files' runs used


def stored_rows(data: Any, configs: dict[str, dict[str, Any]] | None = None) -> Iterator[dict[str, Any]]:
    """Every measured zeropp row of a stored results file, whatever its layout (one run's ``rows``,
    several runs', the paired runs' lists by link; a plan's runs, their ZeRO keys the plan's), each
    with its ZeRO keys as ``zero``, without the DiLoCo rows (not priced)."""
    configs = configs or CONFIGS
    if isinstance(data, dict) and "ranked" in data.get("plan", {}):
        ranked = enumerate(data["plan"]["ranked"], 1)
        configs = configs | {f"plan {i}: {entry['name']}": entry["zero"] for i, entry in ranked}
    if isinstance(data, dict):
        if "median_step_time_s" in data and "name" in data:
            zero = configs.get(data["name"])
            if zero is not None and "error" not in data and not zero.get("outer_sync_every"):
                yield LAYOUT | data | {"zero": zero}
            return
        data = [v for k, v in data.items() if k != "plan"]
    if isinstance(data, list):
        for item in data:
            yield from stored_rows(item, configs)


@functools.lru_cache(maxsize=4)
def _units(preset: str) -> tuple[tuple[int, ...], ...]:
    from zeropp.tools.estimate.gpt import gpt_unit_numels

    return tuple(tuple(u) for u in gpt_unit_numels(ModelConfig(preset=preset)))


def simulate_row(row: dict[str, Any], preset: str = "small") -> Simulation:
    """The step of a stored row simulated: its configuration, nodes and link on the bench's GPT (fp32, one
    sequence per rank, no activation checkpointing)."""
    from zeropp.app.models.gpt import gpt_config

    gpt, units = gpt_config(ModelConfig(preset=preset)), _units(preset)
    rate = parse_bandwidth(row["bandwidth"]) if row["bandwidth"] != UNSHAPED else LOOPBACK_BITS_PER_S
    return simulate(
        PROFILE, row["nodes"] * row["ranks_per_node"], row["ranks_per_node"], rate, sum(map(sum, units)),
        gpt.block_size, "zero3", n_layer=gpt.n_layer, d_model=gpt.d_model, activation_checkpointing=False,
        zero=row["zero"], units=units,
    )  # fmt: skip


def with_measured_compute(sim: Simulation, compute_s: float) -> Simulation:
    """The same step with a measured compute (kernels and optimizer in it) split 1 : 2, as bound.py's."""
    backward = BACKWARD_COMPUTE_SHARE * compute_s
    zero = dict.fromkeys(sim.kernel_s, 0.0)
    return dataclasses.replace(
        sim, compute_s={"forward": compute_s - backward, "backward": backward}, kernel_s=zero, optimizer_s=0.0
    )


def on_host(sim: Simulation, flops: float, kernel_bytes_per_s: float) -> Simulation:
    """The same step on a host of `flops` and `kernel_bytes_per_s` instead of the profile's."""
    gpu = GPUS[PROFILE]
    speed, moved = gpu.peak_flops / flops, gpu.hbm_bytes_per_s / kernel_bytes_per_s
    return dataclasses.replace(
        sim, compute_s={p: s * speed for p, s in sim.compute_s.items()},
        kernel_s={p: s * moved for p, s in sim.kernel_s.items()}, optimizer_s=sim.optimizer_s * moved,
    )  # fmt: skip


def calibrate_host(rows: list[dict[str, Any]]) -> tuple[float, float]:
    """The host's FLOP/s and its kernels' memory rate (quantization, optimizer) that fit the unshaped
    steps best (least squares of the relative error: step = FLOPs / F + bytes / K over the world)."""
    gpu, terms = GPUS[PROFILE], []
    for row in rows:
        if row["bandwidth"] == UNSHAPED:
            sim = simulate_row(row)
            flops = sum(sim.compute_s.values()) * gpu.peak_flops
            moved = (sum(sim.kernel_s.values()) + sim.optimizer_s) * gpu.hbm_bytes_per_s
            terms.append((flops / row["median_step_time_s"], moved / row["median_step_time_s"]))
    aa, ab, bb = (sum(a * a for a, _ in terms), sum(a * b for a, b in terms), sum(b * b for _, b in terms))
    a1, b1 = sum(a for a, _ in terms), sum(b for _, b in terms)
    det = aa * bb - ab * ab
    x, y = (a1 * bb - b1 * ab) / det, (aa * b1 - ab * a1) / det
    return 1 / x, 1 / y


def compare(rows: list[dict[str, Any]], host: tuple[float, float] | None = None) -> list[dict[str, Any]]:
    """Every shaped row: measured median step, simulated (on the profile's host, or on `host`: FLOP/s and
    kernel bytes/s), their ratio, and where bound.py scored the row its prediction beside the simulator's
    with the same measured compute (the two models agreeing)."""
    out = []
    for row in rows:
        if row["bandwidth"] == UNSHAPED:
            continue
        sim = simulate_row(row)
        sim = on_host(sim, *host) if host else sim
        entry = {
            "name": row["name"], "nodes": row["nodes"], "bandwidth": row["bandwidth"],
            "measured_s": row["median_step_time_s"], "simulated_s": sim.step_s,
            "ratio": sim.step_s / row["median_step_time_s"],
        }  # fmt: skip
        if "estimated_phase_inter_bytes" in row and "predicted_s" in row:  # scored by bound.py as it is now
            measured = with_measured_compute(sim, row["compute_s"])
            entry.update(bound_predicted_s=row["predicted_s"], simulated_with_measured_compute_s=measured.step_s)
        out.append(entry)
    return out


def summary(compared: list[dict[str, Any]], bound: float = 0.15) -> dict[str, Any]:
    ratios = [c["ratio"] for c in compared]
    return {
        "rows": len(ratios),
        "within": sum(abs(r - 1) <= bound for r in ratios),
        "median_ratio": statistics.median(ratios),
        "min_ratio": min(ratios),
        "max_ratio": max(ratios),
    }
