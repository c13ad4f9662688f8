"""The GPUs ``zeropp simulate`` knows, from NVIDIA's datasheets: dense tensor-core peak in the
precision they train in, memory, memory bandwidth and NVLink bandwidth per GPU (one direction)."""

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


GPUS = {
    # V100 SXM3 32 GB (DGX-2: 16 GPUs on NVSwitch, 6 NVLink2 x 25 GB/s)
    "v100": Gpu("V100", 125e12, "fp16", 32 * 10**9, 900e9, 1200e9, 16),
    # A100 SXM 80 GB (12 NVLink3 x 25 GB/s)
    "a100": Gpu("A100", 312e12, "bf16", 80 * 10**9, 2039e9, 2400e9, 8),
    # H100 SXM 80 GB (18 NVLink4: 450 GB/s each way)
    "h100": Gpu("H100", 989e12, "bf16", 80 * 10**9, 3350e9, 3600e9, 8),
    # H200 SXM 141 GB: the H100's compute and NVLink, more and faster memory
    "h200": Gpu("H200", 989e12, "bf16", 141 * 10**9, 4800e9, 3600e9, 8),
}
