"""The quantization kernels of a simulated step: the bytes each pass moves and the rate it moves them at.

qwZ dequantizes every gathered unit (in backward too unless hpZ gathers there); qgZ quantizes and
dequantizes the gradient at its intra-node hop and its 1/G again at the inter-node one. A pass over
an element moves its value in the compute dtype (read by a quantize, written by a dequantize), its
b-bit code and its share of the block's fp32 scale (:func:`pass_bytes_per_element`), at the rate
:func:`kernel_bytes_per_s` gives: the GPU's measured one (``Gpu.kernel_bytes_per_s``, ``zeropp bench
kernels``) where it has one, else its memory bandwidth x ``Assumptions.kernel_efficiency``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zeropp.costs.memory import BYTES
from zeropp.costs.volume import SCALE_BYTES, STEP_PHASES

if TYPE_CHECKING:
    from zeropp.tools.estimate.model import Estimate
    from zeropp.tools.simulate.gpus import Gpu
    from zeropp.tools.simulate.model import Assumptions


def pass_bytes_per_element(bits: int, value_bytes: float, block: int | None) -> float:
    """Bytes one quantize or dequantize pass moves per element (what ``zeropp bench kernels`` counts:
    read plus written): the value in the compute dtype (`value_bytes`: 2 for bf16 / fp16, 4 for fp32), its
    `bits`-bit code (bits / 8) and one fp32 scale per `block` elements (``zeropp.quant.spec.QuantSpec``;
    None: one scale per row or shard, nothing per element). bf16 at qwZ's default int8, block 256:
    2 + 1 + 4/256 = 3.016; at qgZ's default int4: 2 + 1/2 + 4/256 = 2.516."""
    return value_bytes + bits / 8 + (SCALE_BYTES / block if block else 0.0)


def kernel_bytes_per_s(gpu: Gpu, a: Assumptions) -> float:
    """The rate the kernels move their bytes at: the GPU's measured one, else its memory bandwidth x
    `a.kernel_efficiency` (the assumption, for GPUs nobody measured)."""
    if gpu.kernel_bytes_per_s is not None:
        return gpu.kernel_bytes_per_s
    return gpu.hbm_bytes_per_s * a.kernel_efficiency


def kernel_bytes(est: Estimate) -> dict[str, float]:
    """Bytes the quantization kernels move per phase: qwZ's dequantization of every gathered unit at the
    weight bits (backward too unless hpZ gathers there); qgZ's quantize and dequantize of the whole
    gradient at the intra-node hop's bits (``intra_node_bits``, unset: the gradient bits; 0: no pass,
    the gradients go as they are) and of its 1/G at the gradient bits across nodes."""
    zero, per_node = est.zero, est.data_parallel.ranks_per_node
    psi = sum(u.padded for u in est.gathered_per_use)
    moved = dict.fromkeys(STEP_PHASES, 0.0)
    if zero.qwz.enabled:
        weight = psi * pass_bytes_per_element(zero.qwz.bits, BYTES[zero.precision], zero.qwz.block)
        moved["forward"] += weight
        moved["backward"] += weight if est.hpz_group_size == 1 else 0
    if zero.qgz.enabled:
        qgz, value = zero.qgz, BYTES[zero.grad_dtype or zero.precision]
        intra = qgz.bits if qgz.intra_node_bits is None else qgz.intra_node_bits
        if intra:
            moved["backward"] += 2 * psi * pass_bytes_per_element(intra, value, qgz.block_size)
        moved["backward"] += 2 * psi / per_node * pass_bytes_per_element(qgz.bits, value, qgz.block_size)
    return moved


def kernel_seconds(est: Estimate, gpu: Gpu, a: Assumptions) -> dict[str, float]:
    """The quantization kernels per phase: :func:`kernel_bytes` at :func:`kernel_bytes_per_s`."""
    rate = kernel_bytes_per_s(gpu, a)
    return {p: b / rate for p, b in kernel_bytes(est).items()}
