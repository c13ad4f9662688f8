"""The GPUs ``zeropp simulate`` knows, from NVIDIA's datasheets: dense tensor-core peak in the
precision they train in, memory, memory bandwidth, NVLink and PCIe bandwidth per GPU (one direction),
and their DGX node's host (its CPUs' memory channels at their rated speed, its memory); where one was
measured (``zeropp bench kernels``, docs/gpu.md), the rate its quantization kernels move bytes at; and
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
    pcie_bytes_per_s: float | None = None  # the GPU's link to its host, one direction (None: it is the host)
    host_bytes_per_s: float | None = None  # the node's host memory bandwidth, all channels
    host_memory_bytes: float | None = None  # the node's host memory
    # the quantization kernels' bytes/s as zeropp bench kernels counts them (values, codes and scales, read plus
    # written), measured on this GPU (None: not measured; the simulator assumes a share of hbm_bytes_per_s)
    kernel_bytes_per_s: float | None = None


# the emulated cluster's host (2 cores): the step's achieved FLOP/s and the quantization kernels' effective
# memory rate, both for the whole host, fitted on the unshaped steps stored before the planner's check
# (emulated.calibrate_host), each pass priced at its bytes in fp32 (kernels.pass_bytes_per_element)
CPU_FLOPS, CPU_KERNEL_BYTES_PER_S = 40.3e9, 10.0e9


# the DGX nodes' hosts: their CPUs' memory channels at the rated speed (bytes/s), their memory
DGX2_HOST = {"host_bytes_per_s": 2 * 6 * 21.33e9, "host_memory_bytes": 1536 * 10**9}  # 2 Xeon 8168, DDR4-2666
DGXA100_HOST = {"host_bytes_per_s": 2 * 8 * 25.6e9, "host_memory_bytes": 2048 * 10**9}  # 2 EPYC 7742, DDR4-3200
DGXH100_HOST = {"host_bytes_per_s": 2 * 8 * 38.4e9, "host_memory_bytes": 2048 * 10**9}  # 2 Xeon 8480C, DDR5-4800

# measured quantization kernels (zeropp bench kernels, docs/gpu.md stage e): of the four plain quantize and
# dequantize rows (int8, int4) at the largest buffer measured, 256 MiB, the slowest. H200 ("Latest results: one
# H200, 2026-11-27", table "e: quantization kernel bandwidth"): quantize int4, 2,988 GB/s (73% of its 4,120 GB/s
# copy; dequantize int4 3,846, quantize int8 3,844, dequantize int8 3,928). H100 ("Earlier: one H100",
# 2026-11-26, the same table, the same bench code and Triton kernels): dequantize int4, 2,781 GB/s (94% of its
# 2,947 GB/s copy; quantize int4 2,812, dequantize int8 2,823, quantize int8 2,858). The bench's buffers are fp32
# values; the rate is applied to the simulator's bf16 ones as bytes (docs/simulate.md)
H200_KERNEL_BYTES_PER_S = 2988e9
H100_KERNEL_BYTES_PER_S = 2781e9
H200_NODE = {**DGXH100_HOST, "kernel_bytes_per_s": H200_KERNEL_BYTES_PER_S}  # its DGX host and its kernels
H100_NODE = {**DGXH100_HOST, "kernel_bytes_per_s": H100_KERNEL_BYTES_PER_S}

GPUS = {
    # V100 SXM3 32 GB (DGX-2: 16 GPUs on NVSwitch, 6 NVLink2 x 25 GB/s; PCIe Gen3 x16: 32 GB/s both ways)
    "v100": Gpu("V100", 125e12, "fp16", 32 * 10**9, 900e9, 1200e9, 16, pcie_bytes_per_s=16e9, **DGX2_HOST),
    # A100 SXM 80 GB (12 NVLink3 x 25 GB/s; PCIe Gen4 x16: 64 GB/s both ways; DGX A100 640GB)
    "a100": Gpu("A100", 312e12, "bf16", 80 * 10**9, 2039e9, 2400e9, 8, pcie_bytes_per_s=32e9, **DGXA100_HOST),
    # H100 SXM 80 GB (18 NVLink4: 450 GB/s each way; PCIe Gen5 x16: 128 GB/s both ways; DGX H100); its kernels measured
    "h100": Gpu("H100", 989e12, "bf16", 80 * 10**9, 3350e9, 3600e9, 8, pcie_bytes_per_s=64e9, **H100_NODE),
    # H200 SXM 141 GB: the H100's compute, NVLink, PCIe and DGX host, more and faster memory; its kernels measured
    "h200": Gpu("H200", 989e12, "bf16", 141 * 10**9, 4800e9, 3600e9, 8, pcie_bytes_per_s=64e9, **H200_NODE),
    # the emulated cluster: fp32 CPU ranks on gloo, 2 a node, loopback inside a node (its cost in the
    # compute, as bound.py counts it), 23 GiB of memory for all of them
    "cpu-gloo": Gpu("CPU (gloo)", CPU_FLOPS, "fp32", 23 * 2**30, CPU_KERNEL_BYTES_PER_S, 1e15, 2, "gloo", True),
}
