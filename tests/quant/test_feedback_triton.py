"""qgZ error feedback with the Triton kernels against the torch reference, bit for bit (the residual
update of zeropp.quant.triton.feedback); on CPU under Triton's interpreter (tests/triton_setup.py)."""

from __future__ import annotations

import pytest
import torch
from triton_setup import DEVICE, NEEDS_GPU_OR_INTERPRETER, import_kernels, tk

from zeropp.comm.feedback import ErrorFeedback
from zeropp.quant import reference
from zeropp.quant.backends import backend_of
from zeropp.quant.spec import QuantSpec

feedback_triton = import_kernels("zeropp.quant.triton.feedback")
pytestmark = [pytest.mark.kernels, NEEDS_GPU_OR_INTERPRETER]


def _steps(rows: int, columns: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(columns)
    out = []
    for _ in range(3):
        x = torch.randn(rows, columns, generator=g) * 10.0 ** torch.randint(-3, 2, (rows, 1), generator=g)
        x[1] = 0  # a zero block row: scale 0, everything dropped
        out.append(x.to(dtype))
    return out


@pytest.mark.parametrize("beta", [0.0, 0.8])
@pytest.mark.parametrize(
    ("bits", "block", "dtype"),
    [
        (4, 64, torch.bfloat16),
        (4, 48, torch.float32),
        (4, 49, torch.float32),
        (8, 64, torch.float32),
        (8, 48, torch.bfloat16),
    ],
)
def test_triton_residual_update_is_the_reference_bit_for_bit(bits, block, dtype, beta):
    """Three quantizations of the same slice (columns 37..37+203 of rows 400 wide: strided residual
    rows, a partial last block; block 49 makes int4 bytes straddle blocks): same codes, same scales,
    same residual."""
    assert (
        backend_of(tk).update_residual is feedback_triton.update_residual
        and backend_of(reference).update_residual is None
    )
    spec, start, width = QuantSpec(bits, block), 37, 400
    ours, theirs = ErrorFeedback(beta), ErrorFeedback(beta)
    for values in _steps(5, 203, dtype):
        got = ours.quantize(tk, "inter", values.to(DEVICE), spec, start, width)
        want = theirs.quantize(reference, "inter", values, spec, start, width)
        assert torch.equal(got.data.cpu(), want.data) and torch.equal(got.scales.cpu(), want.scales)
        assert torch.equal(ours.residuals["inter"].cpu(), theirs.residuals["inter"])
    residual = theirs.residuals["inter"]
    assert residual[:, start : start + 203].abs().max() > 0 and residual[:, :start].abs().max() == 0
