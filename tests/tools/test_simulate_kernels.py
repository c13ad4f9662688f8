"""zeropp simulate's quantization kernels: the bytes a pass moves per element against the closed form (and
against what ``zeropp bench kernels`` counts), and their seconds per phase at the H200's and the H100's measured
rates and, on a GPU nobody measured, at the assumed share of its memory bandwidth (docs/simulate.md)."""

from __future__ import annotations

import pytest
import torch

from zeropp.config.sections import ZeroConfig
from zeropp.tools.bench.gpu import kernels as bench
from zeropp.tools.simulate import GPUS, Assumptions, simulate
from zeropp.tools.simulate.kernels import kernel_bytes_per_s, pass_bytes_per_element

pytestmark = pytest.mark.unit

A = Assumptions()
EIGHT_B = dict(n_layer=32, d_model=4096)
INT8, INT4 = 2 + 1 + 4 / 256, 2 + 1 / 2 + 4 / 256  # bf16 values, the code, one fp32 scale per 256


def _sim(gpu="h200", variant="zeropp", zero=None, assumptions=None):
    return simulate(gpu, 64, 8, 100e9, 8 * 10**9, 8192, variant, zero=zero, assumptions=assumptions, **EIGHT_B)


def _psi(sim):
    return sum(u.padded for u in sim.estimate.gathered_per_use)


def test_bytes_per_element_at_the_default_bits_and_blocks():
    zero = ZeroConfig()
    assert (zero.qwz.bits, zero.qwz.block_size, zero.qgz.bits, zero.qgz.block_size) == (8, 256, 4, 256)
    assert pass_bytes_per_element(8, 2, 256) == INT8 == 3.015625
    assert pass_bytes_per_element(4, 2, 256) == INT4 == 2.515625
    assert pass_bytes_per_element(4, 4, 256) == 4.515625  # fp32 values (the emulated cluster's)
    assert pass_bytes_per_element(8, 2, None) == 3  # one scale per shard: nothing per element


@pytest.mark.parametrize("bits", [8, 4])
def test_the_bytes_are_the_ones_the_bench_counts(bits):
    """The bench's GB/s count fp32 values, codes and scales, read plus written: the same bytes per element."""
    elements, cpu = 4 * bench.ROW, torch.device("cpu")
    for case in (bench._quantize(None, bits, elements, cpu), bench._dequantize(None, bits, elements, cpu)):
        assert case.moved / elements == pass_bytes_per_element(bits, 4, bench.BLOCK)


def test_the_h200_runs_at_its_measured_rate():
    """docs/gpu.md stage e: the slowest quantize / dequantize row at 256 MiB (quantize int4, 2,988 GB/s);
    ZeRO++ with hpZ: qwZ's int8 dequantization forward only, qgZ's int4 hops over Ψ and Ψ/8 backward."""
    assert GPUS["h200"].kernel_bytes_per_s == 2988e9
    sim = _sim()
    psi, rate = _psi(sim), 2988e9
    assert sim.kernel_s["forward"] == pytest.approx(psi * INT8 / rate)
    assert sim.kernel_s["backward"] == pytest.approx(2 * psi * (1 + 1 / 8) * INT4 / rate)
    # the assumption does not touch a measured GPU
    assert _sim(assumptions=Assumptions(kernel_efficiency=0.25)).kernel_s == sim.kernel_s


def test_the_h100_runs_at_its_measured_rate():
    """docs/gpu.md, "Earlier: one H100", stage e: the slowest quantize / dequantize row at 256 MiB (dequantize
    int4, 2,781 GB/s), above the 1,675 GB/s half of its memory bandwidth that it was priced at before."""
    assert GPUS["h100"].kernel_bytes_per_s == 2781e9
    assert kernel_bytes_per_s(GPUS["h100"], A) == 2781e9 > 3350e9 * A.kernel_efficiency
    sim = _sim("h100")
    psi, rate = _psi(sim), 2781e9
    assert sim.kernel_s["forward"] == pytest.approx(psi * INT8 / rate)
    assert sim.kernel_s["backward"] == pytest.approx(2 * psi * (1 + 1 / 8) * INT4 / rate)
    assert _sim("h100", assumptions=Assumptions(kernel_efficiency=0.25)).kernel_s == sim.kernel_s


def test_an_unmeasured_gpu_runs_at_the_assumed_share_of_its_memory_bandwidth():
    assert GPUS["a100"].kernel_bytes_per_s is None
    assert kernel_bytes_per_s(GPUS["a100"], A) == 2039e9 * A.kernel_efficiency == 1019.5e9
    sim = _sim("a100")
    psi, rate = _psi(sim), 2039e9 * 0.5
    assert sim.kernel_s["forward"] == pytest.approx(psi * INT8 / rate)
    assert sim.kernel_s["backward"] == pytest.approx(2 * psi * (1 + 1 / 8) * INT4 / rate)
    half = _sim("a100", assumptions=Assumptions(kernel_efficiency=0.25))
    assert half.kernel_s["backward"] == pytest.approx(2 * sim.kernel_s["backward"])


def test_each_pass_at_its_own_bits():
    """qwZ without hpZ dequantizes in backward too, at the weight bits; qgZ's intra-node hop at
    intra_node_bits (0: no pass), its inter-node one at the gradient bits."""
    rate = 2988e9
    qwz = _sim(variant="qwz", zero={"weight_bits": 4})
    psi = _psi(qwz)
    assert qwz.kernel_s["forward"] == qwz.kernel_s["backward"] == pytest.approx(psi * INT4 / rate)
    two_level = _sim(variant="qgz", zero={"gradient_intra_node_bits": 8})
    psi = _psi(two_level)  # without qwZ, whose blocks pad every shard
    assert two_level.kernel_s["forward"] == 0
    assert two_level.kernel_s["backward"] == pytest.approx(2 * psi * (INT8 + INT4 / 8) / rate)
    unquantized_hop = _sim(variant="qgz", zero={"gradient_intra_node_bits": 0})
    assert unquantized_hop.kernel_s["backward"] == pytest.approx(2 * psi / 8 * INT4 / rate)
    assert sum(_sim(variant="zero3").kernel_s.values()) == 0


def test_the_emulated_cluster_prices_fp32_values_at_its_fitted_rate():
    """cpu-gloo: fp32 values, the host's calibrated rate shared by the world's ranks."""
    gpu, world = GPUS["cpu-gloo"], 4
    sim = simulate("cpu-gloo", world, 2, 1e15, 10**6, 128, "qwz", activation_checkpointing=False)
    psi = _psi(sim)
    assert sim.kernel_s["forward"] == pytest.approx(psi * (4 + 1 + 4 / 256) / gpu.hbm_bytes_per_s * world)
