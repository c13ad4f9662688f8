"""The ZeRO++ paper's evaluation (its §5: Figures 11-13, Table 2) simulated, the assumptions calibrated
once for the whole table, and the same model at Llama-3's scale on H100s.

The cells are what the paper's *text* reports (the figures and the table are images): its peak
percentages of 120 TFLOPs (its V100 peak) as TFLOPs per GPU, and its speedups of ZeRO++ (or one
part of it) over ZeRO-3. Where the text reports one figure for several configurations ("up to",
"over ... on all models") the cell is the simulated maximum or minimum over them; how each figure is
read is the cell's `reading`. The cluster: DGX-2 nodes of 16 V100s, 100 Gbit/s per InfiniBand link.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from zeropp.tools.simulate.model import Assumptions, simulate

PAPER_PEAK_TFLOPS = 120  # the paper's V100 max_TFLOPs (its eq. 3)
DGX2 = 16
IB_BITS_PER_S = 100e9
B18, B138 = 18 * 10**9, 138 * 10**9  # the two model sizes the text names (Table 2: "18B-138B")
K1, K2 = 1024, 2048


@dataclass(frozen=True)
class Run:
    params: int
    gpus: int
    ib: int  # InfiniBand links per node
    tokens: int


@dataclass(frozen=True)
class Cell:
    """One figure of the text: TFLOPs per GPU of `variant`, or with `baseline` its speedup over it,
    at `runs` (reduced by `pick` where there are several)."""

    source: str
    label: str
    paper: float
    variant: str | tuple[str, ...]
    runs: tuple[Run, ...]
    baseline: str | None = None
    pick: Callable[[Iterable[float]], float] = max
    reading: str = ""

    @property
    def unit(self) -> str:
        return "x" if self.baseline else "TFLOPs"


def _pct(p: float) -> float:
    return p * PAPER_PEAK_TFLOPS / 100


def _runs(params: Iterable[int], gpus: Iterable[int], ib: Iterable[int], tokens: Iterable[int]) -> tuple[Run, ...]:
    return tuple(Run(*r) for r in itertools.product(params, gpus, ib, tokens))


FIG11_GPUS = tuple(range(64, 385, 64))  # "from 64 to 384 GPUs": the steps between are our reading
PARTS = ("qwz", "hpz", "qgz")
FIG13_1IB, FIG13_8IB = (_runs([B18], [128], [ib], [K1, K2]) for ib in (1, 8))  # the text gives no tokens per GPU
FIG13_MAX = "highest over 1K and 2K tokens"
FIG13_PARTS = "over qwZ, hpZ, qgZ alone and 1K, 2K tokens"
ALL_MODELS = "lowest over the table's models (18B and 138B: the sizes the text names)"

CELLS: tuple[Cell, ...] = (
    Cell("Fig. 11", "ZeRO++, 1 IB, 1K tokens", _pct(30), "zeropp", _runs([B18], [384], [1], [K1])),
    Cell("Fig. 11", "ZeRO-3, 1 IB, 1K tokens", _pct(12.5), "zero3", _runs([B18], [384], [1], [K1])),
    Cell("Fig. 11", "ZeRO++, 1 IB, 2K tokens", _pct(38.3), "zeropp", _runs([B18], [384], [1], [K2])),
    Cell("Fig. 11", "ZeRO-3, 1 IB, 2K tokens", _pct(21.6), "zero3", _runs([B18], [384], [1], [K2])),
    Cell("Fig. 11", "ZeRO++, 8 IB, up to", _pct(45), "zeropp", _runs([B18], [384], [8], [K1, K2]),
         reading="highest over 1K and 2K tokens"),
    Cell("Fig. 11", "speedup, 1 IB, up to", 2.4, "zeropp", _runs([B18], [384], [1], [K1, K2]), "zero3",
         reading="highest over 1K and 2K tokens at 384 GPUs"),
    Cell("Fig. 11", "speedup, 8 IB, up to", 1.29, "zeropp", _runs([B18], FIG11_GPUS, [8], [K1, K2]), "zero3",
         reading="highest over 64, 128, ..., 384 GPUs and 1K, 2K tokens"),
    Cell("Table 2", "ZeRO++, 1 IB, 2K, over", _pct(31.5), "zeropp", _runs([B18, B138], [384], [1], [K2]), pick=min, reading=ALL_MODELS),
    Cell("Table 2", "ZeRO++, 1 IB, 1K, over", _pct(18.1), "zeropp", _runs([B18, B138], [384], [1], [K1]), pick=min, reading=ALL_MODELS),
    Cell("Table 2", "ZeRO-3, 1 IB, 2K", _pct(16.6), "zero3", _runs([B18, B138], [384], [1], [K2]), pick=min, reading=ALL_MODELS),
    Cell("Table 2", "ZeRO-3, 1 IB, 1K", _pct(9.3), "zero3", _runs([B18, B138], [384], [1], [K1]), pick=min, reading=ALL_MODELS),
    Cell("Table 2", "speedup, 1 IB, up to", 2.16, "zeropp", _runs([B18, B138], [384], [1], [K1, K2]), "zero3",
         reading="highest over the models and tokens"),
    Cell("Table 2", "ZeRO++, 8 IB, 2K", _pct(44.7), "zeropp", _runs([B18, B138], [384], [8], [K2]), pick=min, reading=ALL_MODELS),
    Cell("Table 2", "ZeRO++, 8 IB, 1K", _pct(31.5), "zeropp", _runs([B18, B138], [384], [8], [K1]), pick=min, reading=ALL_MODELS),
    Cell("Table 2", "ZeRO-3, 8 IB, 2K", _pct(31.5), "zero3", _runs([B18, B138], [384], [8], [K2]), pick=min, reading=ALL_MODELS),
    Cell("Table 2", "ZeRO-3, 8 IB, 1K", _pct(26.0), "zero3", _runs([B18, B138], [384], [8], [K1]), pick=min, reading=ALL_MODELS),
    Cell("Table 2", "speedup, 8 IB", 1.3, "zeropp", _runs([B18, B138], [384], [8], [K1, K2]), "zero3",
         reading="highest over the models and tokens"),
    Cell("Fig. 12", "18B ZeRO++, 2 IB", _pct(41.6), "zeropp", _runs([B18], [384], [2], [K2]), reading="384 GPUs, 2K tokens"),
    Cell("Fig. 12", "18B ZeRO-3, 8 IB", _pct(39.1), "zero3", _runs([B18], [384], [8], [K2]), reading="384 GPUs, 2K tokens"),
    Cell("Fig. 12", "138B ZeRO++, 2 IB", _pct(40), "zeropp", _runs([B138], [384], [2], [K2]), reading="384 GPUs, 2K tokens"),
    Cell("Fig. 12", "138B ZeRO-3, 8 IB", _pct(40), "zero3", _runs([B138], [384], [8], [K2]), reading="384 GPUs, 2K tokens"),
    Cell("Fig. 13", "speedup ZeRO++, 1 IB, up to", 2.26, "zeropp", FIG13_1IB, "zero3", reading=FIG13_MAX),
    Cell("Fig. 13", "speedup of one part, 1 IB, lowest", 1.3, PARTS, FIG13_1IB, "zero3", min, FIG13_PARTS),
    Cell("Fig. 13", "speedup of one part, 1 IB, highest", 1.4, PARTS, FIG13_1IB, "zero3", max, FIG13_PARTS),
    Cell("Fig. 13", "speedup ZeRO++, 8 IB, up to", 1.3, "zeropp", FIG13_8IB, "zero3", reading=FIG13_MAX),
    Cell("Fig. 13", "speedup of one part, 8 IB, lowest", 1.13, PARTS, FIG13_8IB, "zero3", min, FIG13_PARTS),
    Cell("Fig. 13", "speedup of one part, 8 IB, highest", 1.16, PARTS, FIG13_8IB, "zero3", max, FIG13_PARTS),
)  # fmt: skip


def run_tflops(run: Run, variant: str, assumptions: Assumptions) -> float:
    sim = simulate(
        "v100", run.gpus, DGX2, run.ib * IB_BITS_PER_S, run.params, run.tokens, variant, assumptions=assumptions
    )
    return sim.flops / sim.step_s / 1e12  # the paper's TFLOPs (recomputation counted)


def cell_value(cell: Cell, assumptions: Assumptions) -> float:
    variants = cell.variant if isinstance(cell.variant, tuple) else (cell.variant,)
    values = []
    for run, variant in itertools.product(cell.runs, variants):
        value = run_tflops(run, variant, assumptions)
        values.append(value / run_tflops(run, cell.baseline, assumptions) if cell.baseline else value)
    return cell.pick(values)


def paper_table(assumptions: Assumptions | None = None) -> list[dict[str, Any]]:
    """Every cell: the paper's figure, the simulated one, their ratio (simulated / paper)."""
    a = assumptions or Assumptions()
    rows = []
    for cell in CELLS:
        simulated = cell_value(cell, a)
        rows.append({
            "source": cell.source, "label": cell.label, "unit": cell.unit, "paper": cell.paper,
            "simulated": simulated, "ratio": simulated / cell.paper, "reading": cell.reading,
        })  # fmt: skip
    return rows


def worst_log_ratio(assumptions: Assumptions) -> float:
    return max(abs(math.log(row["ratio"])) for row in paper_table(assumptions))


def calibrate(
    compute: Iterable[float] = tuple(x / 100 for x in range(30, 61, 2)),
    nic: Iterable[float] = tuple(x / 10 for x in range(4, 11)),
    overlap: Iterable[float] = tuple(x / 10 for x in range(0, 11)),
) -> Assumptions:
    """The compute efficiency, NIC efficiency and overlap that bring the worst cell of the whole table
    closest to the paper (max |log ratio|), on a grid; the rest as :class:`Assumptions` sets it. The
    defaults were chosen with it, once (docs/simulate.md; a minute of CPU)."""
    grid = itertools.product(compute, nic, overlap)
    candidates = (Assumptions(compute_efficiency=c, nic_efficiency=n, overlap=o) for c, n, o in grid)
    return min(candidates, key=worst_log_ratio)


# -- Llama-3 on H100s ----------------------------------------------------------------------------------

LLAMA3 = {"Llama-3-8B": (8_030_000_000, 32, 4096), "Llama-3-70B": (70_550_000_000, 80, 8192)}
LLAMA_GPUS = (64, 128, 256, 512, 1024)
LLAMA_BANDWIDTHS = (100e9, 400e9)  # per node
LLAMA_VARIANTS = ("zero3", "zeropp", "hsdp")
LLAMA_TOKENS = 8192  # one sequence of Llama-3's context per GPU and step


def llama_table(assumptions: Assumptions | None = None) -> list[dict[str, Any]]:
    """Llama-3-8B and 70B on 64-1024 H100s (8 per node) at 100 and 400 Gbit/s per node: TFLOPs per GPU,
    peak fraction, step time and memory per GPU of each variant, and ZeRO++ at 100 over ZeRO-3 at 400."""
    a = assumptions or Assumptions()
    rows = []
    for (name, (params, layers, width)), gpus in itertools.product(LLAMA3.items(), LLAMA_GPUS):
        row: dict[str, Any] = {"model": name, "gpus": gpus}
        for variant, bits in itertools.product(LLAMA_VARIANTS, LLAMA_BANDWIDTHS):
            sim = simulate(
                "h100", gpus, 8, bits, params, LLAMA_TOKENS, variant, n_layer=layers, d_model=width, assumptions=a
            )
            row[f"{variant}@{bits / 1e9:g}"] = {
                "tflops": sim.tflops_per_gpu, "peak_fraction": sim.peak_fraction, "step_s": sim.step_s,
                "memory_gb": sim.memory_bytes / 1e9, "fits": sim.memory_bytes <= sim.gpu.memory_bytes,
            }  # fmt: skip
        row["zeropp@100 / zero3@400"] = row["zeropp@100"]["tflops"] / row["zero3@400"]["tflops"]
        rows.append(row)
    return rows


# Llama-3-70B on 64 H100s with tensor parallelism: (label, variant, ZeRO keys, T, sequence parallelism)
TENSOR_PARALLEL_ROWS = (
    ("ZeRO-3", "zero3", None, 1, False),
    ("ZeRO++", "zeropp", None, 1, False),
    ("ZeRO++, T 2", "zeropp", None, 2, False),
    ("ZeRO-3, T 8 + SP", "zero3", None, 8, True),
    ("ZeRO++, T 8 + SP", "zeropp", None, 8, True),
    ("ZeRO-2, T 8 + SP", "zero3", {"stage": 2}, 8, True),
    ("ZeRO-2, T 8", "zero3", {"stage": 2}, 8, False),
)
TENSOR_PARALLEL_GPUS = 64


def tensor_parallel_table(assumptions: Assumptions | None = None) -> list[dict[str, Any]]:
    """Llama-3-70B on 64 H100s (8 per node), 8192 tokens per GPU, at 100 and 400 Gbit/s per node, with and
    without tensor parallelism: TFLOPs per GPU, peak fraction, step time, the tensor-parallel collectives'
    seconds and memory per GPU of each row of :data:`TENSOR_PARALLEL_ROWS`."""
    a = assumptions or Assumptions()
    params, layers, width = LLAMA3["Llama-3-70B"]
    rows = []
    for label, variant, zero, tp, sequence in TENSOR_PARALLEL_ROWS:
        row: dict[str, Any] = {"configuration": label, "tensor_parallel": tp, "sequence_parallel": sequence}
        for bits in LLAMA_BANDWIDTHS:
            sim = simulate(
                "h100", TENSOR_PARALLEL_GPUS, 8, bits, params, LLAMA_TOKENS, variant, n_layer=layers, d_model=width,
                assumptions=a, zero=zero, tensor_parallel=tp, sequence_parallel=sequence,
            )  # fmt: skip
            row[f"{bits / 1e9:g}"] = {
                "tflops": sim.tflops_per_gpu, "peak_fraction": sim.peak_fraction, "step_s": sim.step_s,
                "tensor_parallel_s": sum(sim.tensor_parallel_s.values()),
            }  # fmt: skip
        row.update(memory_gb=sim.memory_bytes / 1e9, fits=sim.fits)
        rows.append(row)
    return rows


def assumptions_dict(a: Assumptions | None = None) -> dict[str, float]:
    return dataclasses.asdict(a or Assumptions())
