"""qgZ additions in one process: LoCo error feedback's residual algebra, the Hadamard rotation, the
options' config keys and aliases (multi-rank behaviour: tests/zero/test_zeropp.py and test_checkpoint.py)."""

from __future__ import annotations

import re

import pytest
import torch

from zeropp.comm.feedback import ErrorFeedback
from zeropp.config.sections import load_config
from zeropp.errors import ConfigError
from zeropp.quant import hadamard
from zeropp.quant.backends import kernels_for
from zeropp.quant.spec import QuantSpec

KERNELS = kernels_for(torch.device("cpu"), "torch")


def _inputs(steps: int, rows: int, width: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(rows, width, generator=g) * torch.logspace(-3, 1, width) for _ in range(steps)]


def _run(beta: float, spec: QuantSpec, inputs: list[torch.Tensor]) -> tuple[list, list, ErrorFeedback]:
    """Quantize every input through one ErrorFeedback: (compensated inputs, transmitted values, feedback)."""
    feedback, compensated, sent = ErrorFeedback(beta), [], []
    rows, width = inputs[0].shape
    for x in inputs:
        before = feedback.residuals.get("intra", torch.zeros(rows, width)).clone()
        compensated.append(x + before)  # the same fp32 addition the feedback does
        sent.append(KERNELS.dequantize(feedback.quantize(KERNELS, "intra", x, spec, 0, width), torch.float32))
    return compensated, sent, feedback


@pytest.mark.parametrize("bits", [4, 8])
def test_plain_error_feedback_delays_what_quantization_drops_and_loses_nothing(bits):
    """beta = 0: every step transmitted + residual == compensated input bit for bit, so over T steps
    sum(transmitted) + final residual == sum(inputs) exactly, up to (and here exactly accounting for)
    the fp32 rounding of each compensation x_t + e_{t-1}."""
    inputs = _inputs(20, 3, 300)
    compensated, sent, feedback = _run(0.0, QuantSpec(bits, 32), inputs)
    residuals = [torch.zeros(3, 300)]
    for c, t in zip(compensated, sent, strict=True):
        residuals.append(c - t)
    assert torch.equal(residuals[-1], feedback.residuals["intra"])
    for c, t, e in zip(compensated, sent, residuals[1:], strict=True):
        assert torch.equal(t + e, c)  # bit for bit in fp32 (Sterbenz: c - t is exact)
    # in fp64 (exact for these sums): the only difference is the roundings of the compensations
    rounding = sum(
        c.double() - (x.double() + e.double()) for c, x, e in zip(compensated, inputs, residuals, strict=False)
    )
    total_sent = sum(t.double() for t in sent) + residuals[-1].double()
    assert torch.equal(total_sent, sum(x.double() for x in inputs) + rounding)
    assert (sum(t for t in sent) - sum(inputs)).abs().max() > 0  # quantization did drop something each step
    assert rounding.abs().max() <= 20 * torch.finfo(torch.float32).eps * max(c.abs().max() for c in compensated)


def test_loco_moving_average_keeps_the_scaled_residual_invariant():
    """LoCo (beta > 0): sum(transmitted) + e_T / (1 - beta) == sum(inputs) (e_0 = 0), within the fp32
    rounding of the T compensations and moving averages."""
    beta, inputs = 0.8, _inputs(30, 2, 257)
    compensated, sent, feedback = _run(beta, QuantSpec(4, 64), inputs)
    lhs = sum(t.double() for t in sent) + feedback.residuals["intra"].double() / (1 - beta)
    rhs = sum(x.double() for x in inputs)
    scale = max(c.abs().max() for c in compensated).item()
    assert (lhs - rhs).abs().max() <= 30 * 8 * torch.finfo(torch.float32).eps * scale / (1 - beta)
    without = sum(t.double() for t in _run(0.0, QuantSpec(4, 64), inputs)[1]) - rhs  # feedback matters
    naive = sum(KERNELS.dequantize(KERNELS.quantize(x, QuantSpec(4, 64)), torch.float32).double() for x in inputs) - rhs
    assert without.abs().max() < naive.abs().max() / 4
    feedback.reset()
    assert feedback.residuals["intra"].abs().max() == 0


def test_freed_residuals_take_no_memory_and_the_next_quantization_starts_from_zero():
    spec, (first, second) = QuantSpec(4, 64), _inputs(2, 2, 256)
    feedback = ErrorFeedback(0.0)
    feedback.quantize(KERNELS, "intra", first, spec, 0, 256)
    assert feedback.numel() == 2 * 256 and feedback.residuals["intra"].abs().max() > 0
    feedback.free()
    assert feedback.numel() == 0 and not feedback.residuals
    again = feedback.quantize(KERNELS, "intra", second, spec, 0, 256)
    plain = KERNELS.quantize(second, spec)
    assert torch.equal(KERNELS.dequantize(again, torch.float32), KERNELS.dequantize(plain, torch.float32))


@pytest.mark.parametrize("block", [2, 16, 256])
def test_hadamard_rotation_is_orthogonal_and_inverts_within_fp32_rounding(block):
    x = torch.randn(5, 3 * block + max(1, block // 2), generator=torch.Generator().manual_seed(block)) * 10
    y = hadamard.rotate(x, block)
    back = hadamard.rotate(y, block, inverse=True)
    full = 3 * block
    assert torch.allclose(back, x, rtol=0, atol=16 * torch.finfo(torch.float32).eps * x.abs().max())
    blocks = lambda t: t[:, :full].reshape(-1, block)  # noqa: E731
    assert torch.allclose(blocks(y).norm(dim=1), blocks(x).norm(dim=1), rtol=1e-5)
    assert torch.equal(y[:, full:], x[:, full:])  # the short trailing block stays as it is
    assert not torch.allclose(y[:, :full], x[:, :full])
    # an outlier spreads over its block: the rotated block's absmax is its L2 norm / sqrt(block) or so
    spike = torch.zeros(1, block)
    spike[0, 1] = 1.0
    assert hadamard.rotate(spike, block).abs().max() == pytest.approx(block**-0.5, rel=1e-6)


@pytest.mark.parametrize("block", [1, 2, 16, 256])
def test_hadamard_butterflies_equal_the_matrix_definition_within_fp32_rounding(block):
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:  # Sylvester's construction
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    h /= block**0.5
    s = hadamard.signs(block, torch.device("cpu")).double()
    x = torch.randn(3, 2 * block + 1, generator=torch.Generator().manual_seed(block)) * 100
    blocks = x[:, : 2 * block].double().reshape(-1, block)
    tolerance = dict(rtol=0, atol=4 * max(1, block.bit_length()) * torch.finfo(torch.float32).eps * x.abs().max())
    forward = ((blocks * s) @ h).reshape(3, 2 * block)
    torch.testing.assert_close(hadamard.rotate(x, block)[:, : 2 * block].double(), forward, **tolerance)
    inverse = (blocks @ h * s).reshape(3, 2 * block)
    torch.testing.assert_close(hadamard.rotate(x, block, inverse=True)[:, : 2 * block].double(), inverse, **tolerance)


def test_qgz_option_keys_validate_and_take_deepspeeds_loco_names():
    zero = load_config({"zero": {"err_beta": 0.5, "reset_T": 64, "gradient_error_feedback": "loco"}}).zero
    assert (zero.qgz.error_beta, zero.qgz.error_reset_steps) == (0.5, 64)
    for key, value, allowed in (
        ("gradient_error_beta", 1.0, "[0, 1)"),
        ("gradient_error_reset_steps", -1, ">= 0"),
        ("quantized_gradients_until", 0.0, "(0, 1]"),
        ("gradient_intra_node_bits", 2, "0, 4, 8"),
        ("gradient_error_feedback", "ef21", "'off', 'loco'"),
    ):
        with pytest.raises(ConfigError, match=re.escape(allowed)):
            load_config({"zero": {key: value}})
    with pytest.raises(ConfigError, match="power of 2 when zero.gradient_hadamard"):
        load_config({"zero": {"gradient_hadamard": True, "gradient_block_size": 96}})
    with pytest.raises(
        ConfigError, match=r"^zero.gradient_hadamard = True .* false when zero.gradient_intra_node_bits is 0"
    ):
        load_config({"zero": {"gradient_hadamard": True, "gradient_intra_node_bits": 0}})


@pytest.mark.parametrize("block", [1, 2, 4, 8])  # odd and even numbers of butterfly stages
def test_hadamard_rotation_of_one_contiguous_row_inverts_and_leaves_its_input_alone(block):
    x = torch.randn(1, 3 * block + 1, generator=torch.Generator().manual_seed(block))
    before = x.clone()
    back = hadamard.rotate(hadamard.rotate(x, block), block, inverse=True)
    assert torch.equal(x, before)
    assert torch.allclose(back, x, rtol=0, atol=16 * torch.finfo(torch.float32).eps * x.abs().max())
