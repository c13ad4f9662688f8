"""The ZeRO paper's throughput and memory figures simulated (``zeropp simulate --zero-paper-table``).

Two versions of the paper report them, both on DGX-2 nodes (16 V100-SXM3-32GB on NVSwitch, 8 x 100 Gbit/s
InfiniBand a node), GPT-2-like models, sequences of 1024 tokens:

- **v1** (arXiv 1910.02054v1, "ZeRO: Memory Optimization Towards Training A Trillion Parameter Models",
  ../shared/seeds/001): ZeRO-OS, stage 1 (P_os) combined with Megatron-LM's model parallelism, against
  Megatron alone; its Tables 4-8 give every configuration (MP x DP, batch, layers, hidden).
- **SC20** ("ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", §X; ../shared/seeds/002
  summarises it): ZeRO-100B, stage 2 (P_os+g) plus ZeRO-R (Pa where MP > 1), against Megatron-LM alone and
  torch's DDP; its text gives a few figures, its Artifact Description appendix (AE Tables 1, 2, 6) the
  configurations of Figures 2, 3 and 8 (the appendix numbers them Figures 2, 3, 7).

A cell is one figure of the text or a table with its configuration; the simulated one is computed with
the simulator's models (:func:`~zeropp.tools.simulate.model.simulate`: ZeRO stage 1 or 2 over the
data-parallel ranks, Megatron's layout as ``tensor_parallel``, the Megatron baseline as stage 0 with it),
under ONE set of :class:`~zeropp.tools.simulate.model.Assumptions` for the whole table (the ZeRO++ table's
calibration, also V100s on DGX-2 nodes). Where the simulator cannot represent a cell (model parallelism
across nodes, a cluster other than the DGX-2s, a run whose configuration the paper does not give) the cell
says why and nothing is simulated. Batch sizes are samples per data-parallel rank (per model-parallel
group) and step: the AE tables' "total batch size" is that times GPUs / MP.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from zeropp.tools.simulate.model import Assumptions, Simulation, simulate

SEQ = 1024  # v1 Tables 4, 5: "seq-length=1024"; the SC20 AE tables give none (assumed the same)
DGX2 = 16
NODE_BITS_PER_S = 8 * 100e9  # SC20 §X.A b) and AE appendix: "8x 100Gb/s InfiniBand ... (ConnectX-5)" a node
V100_GB = 32

# -- the paper's numbers, each with where it is (nothing else in this module states one) -------------------
PAPER: dict[str, tuple[float | str, str]] = {
    # SC20 (arXiv 1910.02054v3)
    "sc20.zero100b_8b_100b_pflops": (15.0, "§X.B: 'sustained throughput of 15 PetaFlops (over 30% of the peak) on average for models with 8B to 100B parameters'"),
    "sc20.zero100b_speedup_up_to": (10.0, "§X.B: 'ZeRO-100B achieves up to 10x speedup over baseline' (abstract: '10x increase in achievable performance')"),
    "sc20.megatron_40b_two_nodes": (5.0, "§I: 'a 40B parameter model using Megatron-LM across two DGX-2 nodes ... about 5Tflops per V100 GPU'"),
    "sc20.megatron_within_node": (30.0, "§I: 'compared to near 30Tflops for models that can be trained within a node'"),
    "sc20.superlinear_60b": (1.0, "§X.C: 'super-linear scalability ... for a 60B parameter model going from 64 to 400 GPUs' (Fig. 3; no number)"),
    "sc20.no_mp_13b_avg": (40.0, "§X.D: 'up to 13B parameters without MP on 128 GPUs, achieving throughput over 40TFlops per GPU on average'"),
    "sc20.ddp_1_4b": (20.0, "§X.D: 'the largest trainable model with DP alone has 1.4B parameters with throughput less than 20TFlops per GPU'"),
    "sc20.turing_nlg": (41.4, "§X.F: 'ZeRO-100B achieves a sustained throughput of 41.4TFlops/GPU' for Turing-NLG 17B"),
    # v1 (arXiv 1910.02054v1), Table 5: TFlops per GPU
    "v1.t5.zero_os_8b": (38.0, "Table 5, ZeRO-OS 8B: '38 TFlops per GPU', 4x100, bsz=24"),
    "v1.t5.zero_os_20b": (27.0, "Table 5, ZeRO-OS 20B: '27 TFlops per GPU', 4x100, bsz=8"),
    "v1.t5.zero_os_40b": (29.0, "Table 5, ZeRO-OS 40B: '29 TFlops per GPU', 8x48, bsz=8"),
    "v1.t5.zero_os_60b": (20.0, "Table 5, ZeRO-OS 60B: '20 TFlops per GPU', 16x24, bsz=8"),
    "v1.t5.zero_os_80b": (17.0, "Table 5, ZeRO-OS 80B: '17 TFlops per GPU', 16x25, bsz=8"),
    "v1.t5.zero_os_100b": (7.0, "Table 5, ZeRO-OS 100B: '7 TFlops per GPU', 16x25, bsz=4"),
    "v1.t5.megatron_8b": (23.0, "Table 5, Megatron 8B: '23 TFlops per GPU', 8x50, bsz=8"),
    "v1.t5.megatron_20b": (9.0, "Table 5, Megatron 20B: '9 TFlops per GPU', 16x25, bsz=4"),
    "v1.t5.megatron_40b_oom": ("OOM", "Table 5, Megatron 40B: 'OOM' at 16x24, bsz=1"),
    "v1.t5.across_nodes_40b": (4.92, "Table 5, Megatron across nodes 40B: '4.92 TFlops per GPU' (Table 6: 32x12, bsz=4)"),
    "v1.t5.across_nodes_60b": (6.34, "Table 5, Megatron across nodes 60B: '6.34 TFlops per GPU'"),
    "v1.t5.across_nodes_80b": (4.03, "Table 5, Megatron across nodes 80B: '4.03 TFlops per GPU'"),
    "v1.t5.across_nodes_100b": (2.49, "Table 5, Megatron across nodes 100B: '2.49 TFlops per GPU'"),
    # v1 Table 6: samples/s and the boost, 384-400 GPUs
    "v1.t6.zero_os_8b": (210.8, "Table 6, 8B ZeRO-OS 4x100, bsz=24: 210.8 samples/s"),
    "v1.t6.megatron_8b": (129.2, "Table 6, 8B Megatron 8x50, bsz=8: 129.2 samples/s"),
    "v1.t6.boost_8b": (1.63, "Table 6, 8B: '1.63X'"),
    "v1.t6.zero_os_20b": (62.8, "Table 6, 20B ZeRO-OS 4x100, bsz=8: 62.8 samples/s"),
    "v1.t6.megatron_20b": (21.4, "Table 6, 20B Megatron 16x25, bsz=4: 21.4 samples/s"),
    "v1.t6.boost_20b": (2.93, "Table 6, 20B: '2.93X'"),
    "v1.t6.zero_os_40b": (31.77, "Table 6, 40B ZeRO-OS 8x48, bsz=8: 31.77 samples/s"),
    "v1.t6.boost_40b": (5.9, "Table 6, 40B: '5.9X' over Megatron 32x12, bsz=4 (5.38 samples/s)"),
    # v1 Table 7 (Azure) and Table 8 (fewer GPUs)
    "v1.t7.boost_1_5b": (3.75, "Table 7, 1.5B GPT2 on 32 Azure V100s (16GB, PCIe, 40Gbps IB): '3.75X'"),
    "v1.t8.zero_os_8b_240": (129.9, "Table 8, 8B ZeRO-OS on 240 GPUs, 4x60, bsz=24: 129.9 samples/s"),
    "v1.t8.zero_os_20b_128": (24.72, "Table 8, 20B ZeRO-OS on 128 GPUs, 4x32, bsz=8: 24.72 samples/s"),
    # v1 Table 4: the largest models data parallelism alone runs on 32 GPUs (2 DGX-2)
    "v1.t4.ddp_1_2b": ("fits", "Table 4, without ZeRO-OS: 1.2B (bsz=8), layers=40, hidden=1536"),
    "v1.t4.ddp_1_5b": ("OOM", "Table 4, without ZeRO-OS: 1.5B 'Out of memory with bsz=1', layers=48, hidden=1600"),
    "v1.t4.zero_os_4b": ("fits", "Table 4, with ZeRO-OS: 4B (bsz=16), layers=64, hidden=2304"),
    "v1.t4.zero_os_5_9b": ("fits", "Table 4, with ZeRO-OS: 5.9B (bsz=4), layers=72, hidden=2592"),
}  # fmt: skip


@dataclass(frozen=True)
class Run:
    """One configuration: a GPT-2-like model of `layers` x `hidden` (12 L H² parameters: the papers'
    labels, 1.47B for 48 x 1600 ... 171B for 212 x 8192) on `gpus` V100s, model parallelism `mp`,
    `batch` samples of 1024 tokens per data-parallel rank, under `system`."""

    layers: int
    hidden: int
    gpus: int
    mp: int
    batch: int
    system: str  # "zero-os" (stage 1), "zero-100b" (stage 2, Pa where mp > 1), "megatron" (stage 0 + MP), "ddp"

    @property
    def params(self) -> int:
        return 12 * self.layers * self.hidden**2

    @property
    def samples(self) -> int:
        return self.gpus // self.mp * self.batch

    def describe(self) -> str:
        return f"{self.params / 1e9:.3g}B ({self.layers}x{self.hidden}), {self.mp}x{self.gpus // self.mp}, bsz {self.batch}"


SYSTEMS: dict[str, tuple[str, dict[str, Any] | None, bool]] = {  # variant, ZeRO keys, Pa where mp > 1
    "zero-os": ("zero3", {"stage": 1}, False),  # v1: P_os, before ZeRO-R
    "zero-100b": ("zero3", {"stage": 2}, True),  # SC20: P_os+g + ZeRO-R (C4 of its Table III: CB+MD+Pa)
    "megatron": ("ddp", None, False),  # Megatron-LM: data parallel all-reduce, tensor parallel within a node
    "ddp": ("ddp", None, False),
}


def simulate_run(run: Run, assumptions: Assumptions) -> Simulation:
    variant, zero, pa = SYSTEMS[run.system]
    return simulate(
        "v100", run.gpus, DGX2, NODE_BITS_PER_S, run.params, run.batch * SEQ // run.mp, variant,
        n_layer=run.layers, d_model=run.hidden, assumptions=assumptions, zero=zero, tensor_parallel=run.mp,
        partition_activations=pa and run.mp > 1,
    )  # fmt: skip


def tflops(sim: Simulation) -> float:
    return sim.tflops_per_gpu


def pflops(sim: Simulation) -> float:
    return sim.tflops_per_gpu * sim.gpus / 1e3


def samples_per_s(sim: Simulation) -> float:
    return sim.gpus // sim.tensor_parallel * sim.tokens_per_gpu * sim.tensor_parallel / SEQ / sim.step_s


QUANTITIES: dict[str, tuple[Callable[[Simulation], float], str]] = {
    "tflops": (tflops, "TFLOPs/GPU"),
    "pflops": (pflops, "PFLOPs"),
    "samples": (samples_per_s, "samples/s"),
}


@dataclass(frozen=True)
class Cell:
    """One figure: `quantity` of `runs` (their mean where several), or with `baseline` the ratio of the runs'
    samples/s to the baselines' (pairwise, the highest), or with `over` the ratio of the last run's TFLOPs
    per GPU to the first's; `quantity` "memory": whether the runs fit 32 GB. `bound`: "=" the paper's figure,
    ">" the text's "over", "<" its "less than". `unrepresentable`: why nothing is simulated."""

    key: str  # into PAPER
    label: str
    quantity: str
    runs: tuple[Run, ...] = ()
    baseline: tuple[Run, ...] = ()
    bound: str = "="
    reading: str = ""
    unrepresentable: str = ""
    over: bool = False
    pick: str = "mean"  # over several runs: "mean" (the text's "on average") or "max"

    @property
    def source(self) -> str:
        version = "SC20" if self.key.startswith("sc20.") else "v1"
        return f"{version} {PAPER[self.key][1].split(':')[0].split(',')[0]}"

    @property
    def paper(self) -> float | str:
        return PAPER[self.key][0]


def _r(layers: int, hidden: int, gpus: int, mp: int, batch: int, system: str) -> Run:
    return Run(layers, hidden, gpus, mp, batch, system)


# SC20 AE Table 1 (Figure 2), ZeRO-100B on 400 GPUs: the 8B-100B models
FIG2_ZERO_8B_100B = (
    _r(72, 3072, 400, 4, 64, "zero-100b"), _r(98, 4096, 400, 4, 32, "zero-100b"), _r(88, 6144, 400, 4, 12, "zero-100b"),
    _r(132, 6144, 400, 16, 64, "zero-100b"), _r(100, 8192, 400, 16, 32, "zero-100b"), _r(125, 8192, 400, 16, 32, "zero-100b"),
)  # fmt: skip
# ... and its baselines that stay inside a node (MP <= 16): 1.5B, 8B, 20B
FIG2_MEGATRON_IN_NODE = (
    _r(48, 1600, 400, 2, 16, "megatron"), _r(72, 3072, 400, 8, 8, "megatron"), _r(98, 4096, 400, 16, 4, "megatron"),
)  # fmt: skip
# SC20 AE Table 6 (Figure 8), ZeRO-100B without MP on 128 GPUs: 1.5B ... 13B
FIG8_ZERO = tuple(
    _r(layers, hidden, 128, 1, batch, "zero-100b")
    for layers, hidden, batch in (
        (34, 1920, 24), (54, 1920, 24), (64, 2304, 16), (52, 3072, 12), (72, 3072, 8),
        (50, 4096, 6), (54, 4096, 4), (58, 4096, 4), (62, 4096, 2),
    )
)  # fmt: skip
ACROSS_NODES = (
    "Megatron's model parallelism across nodes (MP > 16): the simulator keeps a tensor-parallel group in one node"
)
V1_ZERO_OS_8B = _r(72, 3072, 400, 4, 24, "zero-os")
V1_ZERO_OS_20B = _r(111, 3808, 400, 4, 8, "zero-os")
V1_ZERO_OS_40B = _r(88, 6144, 384, 8, 8, "zero-os")
V1_MEGATRON_8B = _r(72, 3072, 400, 8, 8, "megatron")
V1_MEGATRON_20B = _r(111, 3808, 400, 16, 4, "megatron")

CELLS: tuple[Cell, ...] = (
    # SC20
    Cell("sc20.zero100b_8b_100b_pflops", "ZeRO-100B, 8B-100B, 400 GPUs, average", "pflops", FIG2_ZERO_8B_100B,
         reading="mean over Fig. 2's 8B, 20B, 40B, 60B, 80B, 100B (AE Table 1)"),
    Cell("sc20.zero100b_speedup_up_to", "ZeRO-100B over Megatron, up to", "speedup",
         unrepresentable="the 10x is at 40B-170B, whose baselines run Megatron's model parallelism across nodes (MP 32-256)"),
    Cell("sc20.megatron_40b_two_nodes", "Megatron 40B across two nodes", "tflops", unrepresentable=ACROSS_NODES),
    Cell("sc20.megatron_within_node", "Megatron within a node, near", "tflops", FIG2_MEGATRON_IN_NODE, pick="max",
         reading="highest of Fig. 2's baselines with MP <= 16 (1.5B MP 2, 8B MP 8, 20B MP 16; AE Table 1)"),
    Cell("sc20.superlinear_60b", "60B, 400 over 64 GPUs, per GPU", "tflops",
         (_r(75, 8192, 64, 16, 16, "zero-100b"), _r(75, 8192, 400, 16, 64, "zero-100b")), bound=">", over=True,
         reading="TFLOPs per GPU at 400 GPUs (bsz 64) over at 64 (bsz 16), AE Table 2; > 1 is super-linear"),
    Cell("sc20.no_mp_13b_avg", "ZeRO-100B without MP, 1.5B-13B, 128 GPUs", "tflops", FIG8_ZERO, bound=">",
         reading="mean over AE Table 6's nine models"),
    Cell("sc20.ddp_1_4b", "DDP, largest model (1.38B), 128 GPUs", "tflops", (_r(40, 1536, 128, 1, 1, "ddp"),),
         bound="<", reading="AE Table 6's '1p38B' baseline, bsz 1 (its 40 x 1536 is 1.13B by 12 L H², v1 Table 4's 1.2B)"),
    Cell("sc20.turing_nlg", "Turing-NLG 17B", "tflops",
         unrepresentable="the paper gives no configuration for it (GPUs, MP, batch)"),
    # v1 Table 5
    Cell("v1.t5.zero_os_8b", "ZeRO-OS 8B", "tflops", (V1_ZERO_OS_8B,)),
    Cell("v1.t5.zero_os_20b", "ZeRO-OS 20B", "tflops", (V1_ZERO_OS_20B,)),
    Cell("v1.t5.zero_os_40b", "ZeRO-OS 40B", "tflops", (V1_ZERO_OS_40B,)),
    Cell("v1.t5.zero_os_60b", "ZeRO-OS 60B", "tflops", (_r(132, 6144, 384, 16, 8, "zero-os"),)),
    Cell("v1.t5.zero_os_80b", "ZeRO-OS 80B", "tflops", (_r(173, 6144, 400, 16, 8, "zero-os"),),
         reading="the MP 16 model (173 x 6144)"),
    Cell("v1.t5.zero_os_100b", "ZeRO-OS 100B", "tflops", (_r(317, 5120, 400, 16, 4, "zero-os"),)),
    Cell("v1.t5.megatron_8b", "Megatron 8B", "tflops", (V1_MEGATRON_8B,)),
    Cell("v1.t5.megatron_20b", "Megatron 20B", "tflops", (V1_MEGATRON_20B,)),
    Cell("v1.t5.megatron_40b_oom", "Megatron 40B, MP 16", "memory", (_r(88, 6144, 384, 16, 1, "megatron"),)),
    Cell("v1.t5.across_nodes_40b", "Megatron 40B across nodes", "tflops", unrepresentable=ACROSS_NODES),
    Cell("v1.t5.across_nodes_60b", "Megatron 60B across nodes", "tflops", unrepresentable=ACROSS_NODES),
    Cell("v1.t5.across_nodes_80b", "Megatron 80B across nodes", "tflops", unrepresentable=ACROSS_NODES),
    Cell("v1.t5.across_nodes_100b", "Megatron 100B across nodes", "tflops", unrepresentable=ACROSS_NODES),
    # v1 Table 6
    Cell("v1.t6.zero_os_8b", "ZeRO-OS 8B", "samples", (V1_ZERO_OS_8B,)),
    Cell("v1.t6.megatron_8b", "Megatron 8B", "samples", (V1_MEGATRON_8B,)),
    Cell("v1.t6.boost_8b", "8B, ZeRO-OS over Megatron", "speedup", (V1_ZERO_OS_8B,), (V1_MEGATRON_8B,)),
    Cell("v1.t6.zero_os_20b", "ZeRO-OS 20B", "samples", (V1_ZERO_OS_20B,)),
    Cell("v1.t6.megatron_20b", "Megatron 20B", "samples", (V1_MEGATRON_20B,)),
    Cell("v1.t6.boost_20b", "20B, ZeRO-OS over Megatron", "speedup", (V1_ZERO_OS_20B,), (V1_MEGATRON_20B,)),
    Cell("v1.t6.zero_os_40b", "ZeRO-OS 40B", "samples", (V1_ZERO_OS_40B,)),
    Cell("v1.t6.boost_40b", "40B, ZeRO-OS over Megatron", "speedup", unrepresentable=ACROSS_NODES + " (32x12)"),
    # v1 Tables 7, 8
    Cell("v1.t7.boost_1_5b", "1.5B, ZeRO-OS over Megatron, Azure", "speedup",
         unrepresentable="4 PCIe V100s of 16 GB a node, 40 Gbit/s: not the DGX-2 cluster this table models"),
    Cell("v1.t8.zero_os_8b_240", "ZeRO-OS 8B, 240 GPUs", "samples", (_r(72, 3072, 240, 4, 24, "zero-os"),)),
    Cell("v1.t8.zero_os_20b_128", "ZeRO-OS 20B, 128 GPUs", "samples", (_r(111, 3808, 128, 4, 8, "zero-os"),)),
    # v1 Table 4: memory, 32 GPUs
    Cell("v1.t4.ddp_1_2b", "DDP 1.2B, bsz 8, 32 GPUs", "memory", (_r(40, 1536, 32, 1, 8, "ddp"),)),
    Cell("v1.t4.ddp_1_5b", "DDP 1.5B, bsz 1, 32 GPUs", "memory", (_r(48, 1600, 32, 1, 1, "ddp"),)),
    Cell("v1.t4.zero_os_4b", "ZeRO-OS 4B, bsz 16, 32 GPUs", "memory", (_r(64, 2304, 32, 1, 16, "zero-os"),)),
    Cell("v1.t4.zero_os_5_9b", "ZeRO-OS 5.9B, bsz 4, 32 GPUs", "memory", (_r(72, 2592, 32, 1, 4, "zero-os"),)),
)  # fmt: skip


def cell_value(cell: Cell, assumptions: Assumptions) -> tuple[float | None, float]:
    """The simulated figure (None for a memory cell) and the largest memory per GPU (GB) of its runs."""
    sims = [simulate_run(run, assumptions) for run in cell.runs]
    memory = max(s.memory_bytes for s in sims) / 1e9
    if cell.quantity == "memory":
        return None, memory
    if cell.baseline:
        bases = [simulate_run(run, assumptions) for run in cell.baseline]
        return max(samples_per_s(s) / samples_per_s(b) for s, b in zip(sims, bases, strict=True)), memory
    if cell.over:
        return tflops(sims[-1]) / tflops(sims[0]), memory
    values = [QUANTITIES[cell.quantity][0](s) for s in sims]
    return (max(values) if cell.pick == "max" else statistics.fmean(values)), memory


def agrees(cell: Cell, simulated: float | None, memory: float) -> bool | None:
    """For a bound or a memory cell whether the simulation is on the paper's side (None for "=")."""
    if cell.quantity == "memory":
        return (memory <= V100_GB) == (cell.paper == "fits")
    if cell.bound == ">":
        return simulated is not None and simulated > float(cell.paper)
    if cell.bound == "<":
        return simulated is not None and simulated < float(cell.paper)
    return None


def zero_paper_table(assumptions: Assumptions | None = None) -> list[dict[str, Any]]:
    """Every cell: the paper's figure and where it is, its configuration, the simulated figure, the ratio
    (simulated / paper), the memory per GPU; a cell the simulator cannot represent says why."""
    a = assumptions or Assumptions()
    rows = []
    for cell in CELLS:
        unit = "x" if cell.quantity == "speedup" or cell.over else QUANTITIES.get(cell.quantity, (None, ""))[1]
        row: dict[str, Any] = {
            "key": cell.key, "source": cell.source, "label": cell.label, "quantity": cell.quantity, "unit": unit,
            "bound": cell.bound, "paper": cell.paper, "quote": PAPER[cell.key][1], "reading": cell.reading,
            "configuration": "; ".join(r.describe() for r in cell.runs[:1])
            + (f" ... ({len(cell.runs)} runs)" if len(cell.runs) > 1 else ""),
            "simulated": None, "ratio": None, "memory_gb": None, "agrees": None,
            "unrepresentable": cell.unrepresentable,
        }  # fmt: skip
        if not cell.unrepresentable:
            simulated, memory = cell_value(cell, a)
            ratio = simulated / float(cell.paper) if simulated is not None else None
            row.update(simulated=simulated, ratio=ratio, memory_gb=memory, agrees=agrees(cell, simulated, memory))
        rows.append(row)
    return rows
