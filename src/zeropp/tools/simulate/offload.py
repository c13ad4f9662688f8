"""ZeRO-Offload's optimizer step (``zero.offload_optimizer = "cpu"``) as zeropp runs it, timed.

The fp32 masters and Adam's moments live in the host's (pinned) memory; after backward the step
(:func:`~zeropp.zero.optim.stepping.step_units`) does, with nothing of it overlapping backward:

1. **gradients to the host**: every unit's reduced gradient shard copied with ``.to(cpu, fp32,
   non_blocking=True)``: a non-blocking copy converts on the GPU, so 4 bytes an element cross PCIe;
   all copies are issued, then one blocking wait;
2. **the host step**, unit by unit (torch's AdamW steps one unit's master per call): the fused AdamW
   reads the master, the gradient and two moments and writes three back (28 bytes an element), the
   gradient clipped (``max_grad_norm``: 8 more) and unscaled (fp16's loss scaler: 8 more) first;
3. **parameters back**, each unit right after its step (``publish_master``): a stage-3 shard is
   ``copy_(master, non_blocking=True)`` from pinned memory, fp32 over PCIe (converted on the GPU), so
   the copy of unit k runs while the host steps unit k+1: a two-stage flow shop over the units
   (:func:`~zeropp.costs.step_time.pass_seconds`); a unit kept whole (stages 1-2, stage 3's resident
   ones) is converted on the host (6 bytes an element more) and sent in the compute dtype by a
   blocking copy, so its step and its copy add up. (Stage 0's whole master: non-blocking, fp32.)

Time: PCIe bytes over the GPU's link (one direction, x ``pcie_efficiency``); host bytes over the
node's memory bandwidth (x ``host_memory_efficiency``), shared by the node's GPUs, each stepping its
own shard at once. Host memory per GPU: the estimator's (the master and moments, 12 Ψ/N with Adam)
plus the step's pinned fp32 gradient copies (4 Ψ/N).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from zeropp.costs.step_time import pass_seconds
from zeropp.tools.estimate.model import Estimate

GRADIENT_BYTES = 4  # a gradient element sent to the host: converted to fp32 on the GPU first
SHARD_BYTES = 4  # a stage-3 shard's element sent back: the fp32 master, converted on the GPU
WHOLE_BYTES = 2  # a whole unit's element sent back: converted on the host to the compute dtype
HOST_ADAM_BYTES = 28  # torch's fused AdamW: read master, gradient, two moments; write master, two moments
HOST_CLIP_BYTES = 8  # grad.mul_(coefficient): read and write the fp32 gradient
HOST_UNSCALE_BYTES = 8  # grad.div_(scale), fp16's loss scaler
HOST_CAST_BYTES = 6  # a whole unit's fp32 master read, its compute-dtype copy written


@dataclass(frozen=True)
class OffloadStep:
    """One GPU's offloaded optimizer step: bytes over PCIe each way and through the host's memory,
    their seconds, the step's makespan and the host memory it keeps."""

    to_host_bytes: float
    to_device_bytes: float
    host_bytes: float
    to_host_s: float
    host_s: float
    to_device_s: float
    seconds: float
    host_memory_bytes: float

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


def offload_step(est: Estimate, pcie_bytes_per_s: float, host_bytes_per_s: float) -> OffloadStep:
    """The step of `est` (offload_optimizer = "cpu") on a PCIe link of `pcie_bytes_per_s` each way and
    `host_bytes_per_s` of host memory bandwidth for this GPU (both achieved rates)."""
    zero, shard_world = est.zero, est.shard_layout.world_size if est.zero.stage >= 1 else 1
    per_element = HOST_ADAM_BYTES + (HOST_CLIP_BYTES if zero.max_grad_norm else 0)
    per_element += HOST_UNSCALE_BYTES if zero.precision == "fp16" else 0
    shards = est.unit_shard_numels
    piped = [n for n, u in zip(shards, est.units, strict=True) if not u.resident or shard_world == 1]
    whole = sum(shards) - sum(piped)  # blocking: host conversion, compute-dtype copy
    to_host = GRADIENT_BYTES * sum(shards)
    to_device = SHARD_BYTES * sum(piped) + WHOLE_BYTES * whole
    host = per_element * sum(shards) + HOST_CAST_BYTES * whole
    piped_s = pass_seconds(
        per_element * sum(piped) / host_bytes_per_s, SHARD_BYTES * sum(piped) / pcie_bytes_per_s, len(piped)
    )
    whole_s = (per_element + HOST_CAST_BYTES) * whole / host_bytes_per_s + WHOLE_BYTES * whole / pcie_bytes_per_s
    return OffloadStep(
        to_host, to_device, host, to_host / pcie_bytes_per_s, host / host_bytes_per_s, to_device / pcie_bytes_per_s,
        to_host / pcie_bytes_per_s + piped_s + whole_s,
        est.model_state_bytes_on("host") + GRADIENT_BYTES * sum(shards),
    )  # fmt: skip
