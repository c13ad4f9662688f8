"""ZeRO-Offload's optimizer step (``zero.offload_optimizer = "cpu"``) as zeropp runs it, timed.

The fp32 masters and Adam's moments live in the host's (pinned) memory; after backward the step
(:func:`~zeropp.zero.optim.stepping.step_units`) does, with nothing of it overlapping backward (but
for the step inside backward, below):

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

With ``zero.step_in_backward`` and no clipping (:func:`host_step_left_after_backward`), each unit's
gradient copy and host step run on one worker thread as its reduction lands, while backward goes on;
every unit's parameters go back at ``engine.step()``, after backward, with no step left to hide behind
(See [Note: the step inside backward]). With clipping the step waits for the norm, after backward, as
above; fp16 (unscaled in place) the config refuses.

Time: PCIe bytes over the GPU's link (one direction, x ``pcie_efficiency``); host bytes over the
node's memory bandwidth (x ``host_memory_efficiency``), shared by the node's GPUs, each stepping its
own shard at once. Host memory per GPU: the estimator's (the master and moments, 12 Ψ/N with Adam)
plus the step's pinned fp32 gradient copies (4 Ψ/N).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
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
    their seconds, what the GPU waits for after backward (`seconds`: all of the step, or what is left of
    it where it ran `in_backward`) and the host memory it keeps."""

    to_host_bytes: float
    to_device_bytes: float
    host_bytes: float
    to_host_s: float
    host_s: float
    to_device_s: float
    seconds: float
    host_memory_bytes: float
    in_backward: bool = False  # stepped inside backward (zero.step_in_backward, no clipping)

    def as_dict(self) -> dict[str, float | bool]:
        return dataclasses.asdict(self)


def host_step_left_after_backward(unit_s: Sequence[float], backward_s: float) -> float:
    """What is left after backward of the host's steps inside it: `unit_s` are the units' seconds (a
    gradient's copy to the host, then its host step) in the order backward reduces them. Assumes the
    units land evenly over the pass (the k-th of U at k/U of `backward_s`, B, as the flow shop splits it),
    one worker thread (a unit's step starts once it has landed and the one before is done), and that
    neither the copies nor the host slow backward. For U equal units of s seconds: max(s, U s + B/U - B)."""
    done = 0.0
    for k, seconds in enumerate(unit_s, 1):
        done = max(done, k * backward_s / len(unit_s)) + seconds
    return done - backward_s


def offload_step(
    est: Estimate, pcie_bytes_per_s: float, host_bytes_per_s: float, backward_s: float | None = None
) -> OffloadStep:
    """The step of `est` (offload_optimizer = "cpu") on a PCIe link of `pcie_bytes_per_s` each way and
    `host_bytes_per_s` of host memory bandwidth for this GPU (both achieved rates); inside a backward pass of
    `backward_s` where given and `est` steps there (``step_in_backward`` without ``max_grad_norm``)."""
    zero, shard_world = est.zero, est.shard_layout.world_size if est.zero.stage >= 1 else 1
    per_element = HOST_ADAM_BYTES + (HOST_CLIP_BYTES if zero.max_grad_norm else 0)
    per_element += HOST_UNSCALE_BYTES if zero.precision == "fp16" else 0
    shards = est.unit_shard_numels
    piped = [n for n, u in zip(shards, est.units, strict=True) if not u.resident or shard_world == 1]
    whole = sum(shards) - sum(piped)  # blocking: host conversion, compute-dtype copy
    to_host = GRADIENT_BYTES * sum(shards)
    to_device = SHARD_BYTES * sum(piped) + WHOLE_BYTES * whole
    host = per_element * sum(shards) + HOST_CAST_BYTES * whole
    in_backward = backward_s is not None and zero.step_in_backward and not zero.max_grad_norm
    if in_backward:  # each unit's copy and step as it lands; every unit's parameters back at engine.step()
        unit_s = [n * (GRADIENT_BYTES / pcie_bytes_per_s + per_element / host_bytes_per_s) for n in reversed(shards)]
        seconds = host_step_left_after_backward(unit_s, backward_s)
        seconds += to_device / pcie_bytes_per_s + HOST_CAST_BYTES * whole / host_bytes_per_s
    else:  # after backward: all gradients to the host, then the host step beside the parameters back
        piped_s = pass_seconds(
            per_element * sum(piped) / host_bytes_per_s, SHARD_BYTES * sum(piped) / pcie_bytes_per_s, len(piped)
        )
        whole_s = (per_element + HOST_CAST_BYTES) * whole / host_bytes_per_s + WHOLE_BYTES * whole / pcie_bytes_per_s
        seconds = to_host / pcie_bytes_per_s + piped_s + whole_s
    return OffloadStep(
        to_host, to_device, host, to_host / pcie_bytes_per_s, host / host_bytes_per_s, to_device / pcie_bytes_per_s,
        seconds, est.model_state_bytes_on("host") + GRADIENT_BYTES * sum(shards), in_backward,
    )  # fmt: skip
