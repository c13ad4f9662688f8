"""``zeropp simulate``: one training step of a GPU cluster, simulated (docs/simulate.md).

The estimator's transfers and memory (:mod:`zeropp.tools.estimate`) timed on a fabric of alpha-beta
links with NCCL's ring and tree algorithms (:mod:`zeropp.costs.collectives`), compute from a GPU's
datasheet peak and one achieved efficiency, stage 3's overlap (:mod:`zeropp.costs.step_time`).

Modules: ``gpus`` (the catalogue), ``model`` (:func:`simulate`, :class:`Simulation`, :class:`Assumptions`),
``kernels`` (the quantization passes' bytes and their rate: measured where a GPU was lent, else assumed),
``offload`` (ZeRO-Offload's step on the host, inside backward or after it), ``tensor_parallel`` (Megatron's layout over T GPUs of a
node), ``papers`` (the ZeRO++ paper's evaluation, the calibration, Llama-3 on H100s), ``zero_paper`` (the ZeRO
paper's throughput and memory figures), ``emulated`` (the
``cpu-gloo`` profile against the stored emulated-cluster steps), ``show`` (printing), ``cli``
(``zeropp simulate``'s flags and :func:`main`).
"""

from zeropp.tools.simulate.cli import build_parser, main
from zeropp.tools.simulate.gpus import GPUS, Gpu
from zeropp.tools.simulate.model import VARIANTS, Assumptions, Shape, Simulation, simulate
from zeropp.tools.simulate.papers import CELLS, calibrate, llama_table, paper_table
from zeropp.tools.simulate.zero_paper import zero_paper_table

__all__ = [
    "CELLS",
    "GPUS",
    "VARIANTS",
    "Assumptions",
    "Gpu",
    "Shape",
    "Simulation",
    "build_parser",
    "calibrate",
    "llama_table",
    "main",
    "paper_table",
    "simulate",
    "zero_paper_table",
]
