"""qgZ's Hadamard rotation on its Triton kernel (zeropp.quant.hadamard_triton) against the torch
butterflies (zeropp.quant.hadamard), bit for bit; on CPU under Triton's interpreter (tests/triton_setup.py)."""

from __future__ import annotations

import pytest
import torch
from triton_setup import DEVICE, NEEDS_GPU_OR_INTERPRETER, import_kernels, tk

from zeropp.quant import hadamard, reference

hadamard_triton = import_kernels("zeropp.quant.hadamard_triton")
pytestmark = NEEDS_GPU_OR_INTERPRETER


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The fp32 bits, every NaN as one (a GPU's NaN payloads are not the CPU's)."""
    t = t.cpu()
    return torch.where(t.isnan(), torch.tensor(float("nan")), t).view(torch.int32)


@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize(
    ("rows", "columns", "block", "dtype"),
    [(3, 70, 16, torch.float32), (2, 600, 256, torch.float32), (5, 9, 2, torch.bfloat16), (4, 33, 1, torch.float16),
     (1, 100, 128, torch.float32), (2, 5, 8, torch.float32)],
)  # fmt: skip
def test_triton_rotation_is_the_torch_butterflies_bit_for_bit(rows, columns, block, dtype, inverse):
    g = torch.Generator().manual_seed(columns)
    x = (torch.randn(rows, columns, generator=g) * 10.0 ** torch.randint(-3, 3, (rows, 1), generator=g)).to(dtype)
    x[0, :3] = torch.tensor([float("inf"), float("nan"), -0.0])  # non-finite values spread as in torch
    expected = hadamard.rotate(x, block, inverse=inverse)
    rotated = hadamard_triton.rotate(x.to(DEVICE), block, inverse=inverse)
    assert rotated.dtype == torch.float32 and rotated.shape == x.shape
    assert torch.equal(_bits(rotated), _bits(expected))


def test_triton_rotation_reads_strided_rows_and_leaves_the_input_alone():
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(1))
    view = x.to(DEVICE)[:, 16:80]  # a column chunk, as qgZ rotates them
    before = view.clone()
    rotated = hadamard_triton.rotate(view, 32)
    assert torch.equal(view, before)
    assert torch.equal(_bits(rotated), _bits(hadamard.rotate(x[:, 16:80], 32)))


def test_rotation_for_picks_the_kernel_of_the_backend():
    assert hadamard.rotation_for(tk) is hadamard_triton.rotate
    assert hadamard.rotation_for(reference) is hadamard.rotate
