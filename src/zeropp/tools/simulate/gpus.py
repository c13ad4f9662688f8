"""The GPUs ``zeropp simulate`` knows, from NVIDIA's datasheets: dense tensor-core peak in the
precision they train in, memory, memory bandwidth and NVLink bandwidth per GPU (one direction); and
``cpu-gloo``, the emulated cluster's "GPU" (``zeropp bench cluster``: CPU ranks on gloo sharing one
host), calibrated on its stored unshaped steps (:mod:`zeropp.tools.simulate.emulated`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Gpu:
    name: str
    peak_flops: float  # dense tensor-core FLOP/s in `precision`
    precision: str  # what a run trains in: fp16 (V100 has no bf16), else bf16
    memory_bytes: int
    hbm_bytes_per_s: float
    nvlink_bits_per_s: float  # one direction, per GPU (NVSwitch: to any other GPU of the node)
    ranks_per_node: int  # the usual node (DGX / HGX)
    backend: str = "nccl"
    shared_host: bool = False  # every rank on one host: its FLOP/s, memory bandwidth and memory shared by all


# the emulated cluster's host (2 cores): the step's achieved FLOP/s and the quantization kernels' effective
# memory rate, both for the whole host, fitted on the unshaped steps stored before the planner's check
# (emulated.calibrate_host)
CPU_FLOPS, CPU_KERNEL_BYTES_PER_S = 42.6e9, 5.13e9


GPUS = {
    # V100 SXM3 32 GB (DGX-2: 16 GPUs on NVSwitch, 6 NVLink2 x 25 GB/s)
    "v100": Gpu("V100", 125e12, "fp16", 32 * 10**9, 900e9, 1200e9, 16),
    # A100 SXM 80 GB (12 NVLink3 x 25 GB/s)
    "a100": Gpu("A100", 312e12, "bf16", 80 * 10**9, 2039e9, 2400e9, 8),
    # H100 SXM 80 GB (18 NVLink4: 450 GB/s each way)
    "h100": Gpu("H100", 989e12, "bf16", 80 * 10**9, 3350e9, 3600e9, 8),
    # H200 SXM 141 GB: the H100's compute and NVLink, more and faster memory
    "h200": Gpu("H200", 989e12, "bf16", 141 * 10**9, 4800e9, 3600e9, 8),
    # the emulated cluster: fp32 CPU ranks on gloo, 2 a node, loopback inside a node (its cost in the
    # compute, as bound.py counts it), 23 GiB of memory for all of them
    "cpu-gloo": Gpu("CPU (gloo)", CPU_FLOPS, "fp32", 23 * 2**30, CPU_KERNEL_BYTES_PER_S, 1e15, 2, "gloo", True),
}
