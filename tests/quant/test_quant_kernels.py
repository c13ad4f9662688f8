"""The Triton quantization kernels against the torch reference, bit for bit.

The reference always runs on the CPU: on CUDA, torch divides by a Python scalar through its
reciprocal (``absmax / qmax``, ``total / divisor``), which is not the rounding rule.

With a GPU the kernels run compiled on it, without one under Triton's CPU interpreter
(tests/triton_setup.py).
"""

from __future__ import annotations

import sys

import pytest
import torch
from test_quant import assert_implements_quant_kernels
from triton_setup import DEVICE, NEEDS_GPU_OR_INTERPRETER, tk

import zeropp.quant.triton
from zeropp.quant import backends, reference
from zeropp.quant.backends import kernels_for
from zeropp.quant.spec import Quantized, QuantSpec

pytestmark = [
    pytest.mark.kernels,
    NEEDS_GPU_OR_INTERPRETER,
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),  # numpy, in the interpreter
]

FLOATS = [torch.float32, torch.bfloat16, torch.float16]
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
BLOCKS = [64, 48, 49, None]  # divides 256, divides neither 256 nor 203, odd (int4 bytes straddle blocks), per row


def sample(shape: tuple[int, ...], dtype: torch.dtype, qmax: int, seed: int = 0) -> torch.Tensor:
    """Random rows of several magnitudes, plus rows that probe the rounding rule (at least 6 rows).

    Row 0 starts with qmax and halves (scale 1: exact ties for round-half-even), row 1 is zero
    (scale 0), row 2 holds an inf and row 3 a NaN (non-finite scales), row 4 is subnormal in fp32
    (subnormal scales; fp16 flushes it to 0).
    """
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator)
    rows = x.view(-1, shape[-1])
    rows.mul_(10.0 ** torch.randint(-2, 3, (rows.shape[0], 1), generator=generator))
    ties = torch.tensor([qmax, 2.5, -2.5, 0.5, -0.5, 1.5, -1.5, 3.5, -3.5])
    rows[0] = torch.randn(shape[-1], generator=generator).clamp(-qmax, qmax)
    rows[0, : ties.numel()] = ties[: shape[-1]]
    rows[1] = 0
    rows[2, 3 % shape[-1]] = float("inf")
    rows[3, 5 % shape[-1]] = float("nan")
    rows[4] *= 1e-39
    return x.to(dtype)


def on_device(value):
    """A CPU tensor or Quantized, copied to the device the kernels run on."""
    if isinstance(value, Quantized):
        return Quantized(value.data.to(DEVICE), value.scales.to(DEVICE), value.n, value.spec)
    return value.to(DEVICE)


def assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Same dtype, shape and bits (any NaN matches any NaN); `actual` may be on the device."""
    actual = actual.cpu()
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (actual.dtype, actual.shape)
    if not expected.is_floating_point():
        assert torch.equal(actual, expected)
        return
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(actual), nan)
    as_int = INT_VIEW[expected.dtype]
    assert torch.equal(actual.masked_fill(nan, 0).view(as_int), expected.masked_fill(nan, 0).view(as_int))


def assert_same_quantized(actual: Quantized, expected: Quantized) -> None:
    assert (actual.n, actual.spec) == (expected.n, expected.spec)
    assert_same(actual.data, expected.data)
    assert_same(actual.scales, expected.scales)


def quantized_sources(sources: int, rows: int, n: int, spec: QuantSpec, seed: int) -> Quantized:
    """`sources` quantized copies of [rows, n] values, stacked: [sources, rows, ...]."""
    parts = [reference.quantize(sample((rows, n), torch.float32, spec.qmax, seed + s), spec) for s in range(sources)]
    return Quantized(
        torch.stack([p.data for p in parts]), torch.stack([p.scales for p in parts]), n, spec
    )  # fmt: skip


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("n", [256, 203])
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("bits", [8, 4])
def test_quantize(bits, block, n, dtype):
    spec = QuantSpec(bits, block)
    x = sample((2, 3, n), dtype, spec.qmax)
    assert_same_quantized(tk.quantize(on_device(x), spec), reference.quantize(x, spec))


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_row_order_strided_into_out(bits):
    """qgZ's slice reordering: rows of a column slice of a [W, S] view, read in another order."""
    spec = QuantSpec(bits, 32)
    full = sample((8, 160), torch.bfloat16, spec.qmax).view(-1)
    order = torch.tensor([5, 0, 7, 2, 2, 6, 1, 3])

    def columns(flat: torch.Tensor) -> torch.Tensor:
        return flat.view(8, 160)[:, 40:141]  # 101 columns, row stride 160

    out = tk.quantize(torch.zeros(8, 101, device=DEVICE), spec)  # a buffer to write into
    result = tk.quantize(columns(on_device(full)), spec, row_order=on_device(order), out=out)
    assert result is out
    assert_same_quantized(result, reference.quantize(columns(full), spec, row_order=order))


def test_quantize_into_non_contiguous_out():
    spec = QuantSpec(8, 16)
    x = sample((6, 40), torch.float32, spec.qmax)
    out = Quantized(
        torch.zeros(40, 6, dtype=torch.int8, device=DEVICE).t(), torch.zeros(3, 6, device=DEVICE).t(), 40, spec
    )
    assert tk.quantize(on_device(x), spec, out=out) is out
    assert_same_quantized(out, reference.quantize(x, spec))


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("bits", [8, 4])
def test_dequantize(bits, block, dtype):
    spec = QuantSpec(bits, block)
    q = reference.quantize(sample((2, 3, 203), torch.float32, spec.qmax), spec)
    assert_same(tk.dequantize(on_device(q), dtype), reference.dequantize(q, dtype))


def test_dequantize_into_out():
    spec = QuantSpec(4, 64)
    q = reference.quantize(sample((6, 203), torch.float32, spec.qmax), spec)
    q_device = on_device(q)
    out = torch.empty(6, 203, dtype=torch.float16, device=DEVICE)
    assert tk.dequantize(q_device, torch.float16, out=out) is out
    assert_same(out, reference.dequantize(q, torch.float16))
    strided = torch.empty(6, 300, device=DEVICE)[:, 50:253]  # written in place through its row stride
    assert tk.dequantize(q_device, torch.float32, out=strided) is strided
    assert_same(strided, reference.dequantize(q, torch.float32))
    cast = torch.empty(6, 203, device=DEVICE)  # fp32 out of a bf16 result: rounded to bf16 first
    tk.dequantize(q_device, torch.bfloat16, out=cast)
    assert_same(cast, reference.dequantize(q, torch.bfloat16, out=torch.empty(6, 203)))


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize(("sources", "divisor"), [(1, 1), (3, 1), (4, 6)])
@pytest.mark.parametrize(("bits", "block"), [(8, 64), (4, 48), (4, 49), (8, None)])
def test_dequantize_reduce(bits, block, sources, divisor, dtype):
    q = quantized_sources(sources, 6, 203, QuantSpec(bits, block), seed=sources)
    expected = reference.dequantize_reduce(q, dtype, divisor=divisor)
    assert_same(tk.dequantize_reduce(on_device(q), dtype, divisor=divisor), expected)
    out = torch.empty(6, 260, dtype=dtype, device=DEVICE)[:, :203]
    assert tk.dequantize_reduce(on_device(q), dtype, divisor=divisor, out=out) is out
    assert_same(out, expected)


@pytest.mark.parametrize(
    ("source", "target"),
    [
        (QuantSpec(8, 64), QuantSpec(8, 64)),
        (QuantSpec(4, 64), QuantSpec(4, 64)),
        (QuantSpec(8, 48), QuantSpec(4, 48)),
        (QuantSpec(4, 48), QuantSpec(8, 48)),
        (QuantSpec(8, 49), QuantSpec(8, 49)),
        (QuantSpec(4, 49), QuantSpec(4, 49)),
        (QuantSpec(8, None), QuantSpec(4, None)),
        (QuantSpec(8, 64), QuantSpec(8, 32)),  # other blocks: not fused
    ],
    ids=str,
)
@pytest.mark.parametrize("sources", [1, 4])
def test_dequantize_reduce_quantize(source, target, sources):
    q = quantized_sources(sources, 6, 203, source, seed=10 + sources)
    q = q.reshape(sources, 2, 3)  # sources x two leading dims
    expected = reference.dequantize_reduce_quantize(q, target)
    assert_same_quantized(tk.dequantize_reduce_quantize(on_device(q), target), expected)


@pytest.mark.parametrize("block", [None, 24])
def test_blocks_longer_than_a_tile(monkeypatch, block):
    """Blocks over TILE elements are walked in chunks: two passes for the absmax, a grid axis to dequantize."""
    monkeypatch.setattr(tk, "TILE", 16)  # 40-element rows: 3 chunks a row, or 2 a block of 24
    spec = QuantSpec(4, block)
    x = sample((6, 40), torch.float16, spec.qmax)
    assert_same_quantized(tk.quantize(on_device(x), spec), reference.quantize(x, spec))
    q = quantized_sources(3, 6, 40, spec, seed=3)
    q_device = on_device(q)
    assert_same_quantized(tk.dequantize_reduce_quantize(q_device, spec), reference.dequantize_reduce_quantize(q, spec))
    expected = reference.dequantize_reduce(q, torch.bfloat16, divisor=3)
    assert_same(tk.dequantize_reduce(q_device, torch.bfloat16, divisor=3), expected)
    assert_same(tk.dequantize(q_device[0], torch.float32), reference.dequantize(q[0], torch.float32))


def test_one_element_rows_and_no_rows():
    spec = QuantSpec(4, None)
    x = sample((7, 1), torch.float32, spec.qmax)
    q = reference.quantize(x, spec)
    assert_same_quantized(tk.quantize(on_device(x), spec), q)
    assert_same(tk.dequantize(on_device(q), torch.float32), reference.dequantize(q, torch.float32))
    empty = tk.quantize(torch.empty(0, 64, device=DEVICE), spec)  # (the reference cannot view 0 rows)
    assert empty.data.shape == (0, 32) and empty.scales.shape == (0, 1)
    assert tk.dequantize(empty, torch.float32).shape == (0, 64)


# -- dispatch --------------------------------------------------------------------------------------


def test_implements_quant_kernels():
    assert_implements_quant_kernels(tk)


def test_kernels_for_dispatch():
    assert kernels_for(torch.device("cpu")) is reference
    assert kernels_for(torch.device("cuda"), "torch") is reference
    assert kernels_for(torch.device("cuda")) is tk  # a device name only: no GPU needed to choose
    if tk.INTERPRETED:
        assert kernels_for(torch.device("cpu"), "triton") is tk
    else:
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            kernels_for(torch.device("cpu"), "triton")
    with pytest.raises(ValueError, match="unknown quantization backend"):
        kernels_for(torch.device("cpu"), "cuda")


def test_kernels_for_without_triton(monkeypatch, request):
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` fail
    for name in ("kernels", "hadamard", "feedback"):
        monkeypatch.delitem(sys.modules, f"zeropp.quant.triton.{name}", raising=False)
        monkeypatch.delattr(zeropp.quant.triton, name, raising=False)
    backends.triton_backend.cache_clear()
    request.addfinalizer(backends.triton_backend.cache_clear)  # the next use imports the real kernels again
    assert kernels_for(torch.device("cuda")) is reference
    with pytest.raises(RuntimeError, match="needs the triton package"):
        kernels_for(torch.device("cuda"), "triton")
