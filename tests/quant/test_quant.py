"""Single-process tests of the ZeRO++ quantization reference (qgZ's index math: test_qgz_order.py).

Covered:

* ``zeropp.quant`` / ``zeropp.quant.reference``: the round-trip error bound (int8 / int4, blocks that
  divide and do not divide the row, odd rows, one scale per row, fp32 / bf16 / fp16 inputs), the
  storage layout (int8 codes, int4 nibble packing, scale shapes), zero and non-finite blocks,
  ``row_order`` (also on a strided view), ``dequantize_reduce`` (fp32 sum in index order, divisor,
  output dtype, ``out=``), ``dequantize_reduce_quantize``, round-half-even, ``out=`` of quantize /
  dequantize, ``pack_int4`` / ``unpack_int4``, ``kernels_for`` and the ``QuantKernels`` protocol.
* Block versus per-tensor accuracy (ZeRO++ Fig. 2): on one transformer block of a briefly trained
  GPT and on heavy-tailed synthetic weights, block int8 must have >= 3x lower mean-squared error.
"""

from __future__ import annotations

import inspect
import math
from types import SimpleNamespace

import pytest
import torch

from zeropp.app.models.gpt import GPT, GPTConfig
from zeropp.quant import reference as ref
from zeropp.quant.backends import kernels_for
from zeropp.quant.spec import Quantized, QuantKernels, QuantSpec, pack_int4, unpack_int4

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FP32_UNIT = 2.0**-24  # unit roundoff of fp32


def _random(shape, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Normal values with magnitudes varying by row, so blocks have different scales."""
    g = torch.Generator().manual_seed(seed)
    rows = math.prod(shape[:-1])
    row_scale = torch.logspace(-3, 1, rows)[torch.randperm(rows, generator=g)]
    values = torch.randn(*shape, generator=g) * row_scale.view(*shape[:-1], 1)
    return values.to(dtype)


def _block_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """For every element, max |x| over its block (blocks of `block` along the last dim, last one shorter)."""
    x = x.float().abs()
    pieces = [x[..., s : s + block] for s in range(0, x.shape[-1], block)]
    return torch.cat([p.amax(dim=-1, keepdim=True).expand_as(p) for p in pieces], dim=-1)


def _codes(q: Quantized) -> torch.Tensor:
    """The integer codes of `q`, decoded by hand from the documented storage layout."""
    if q.spec.bits == 8:
        return q.data.to(torch.int16)
    low, high = (q.data & 0xF).to(torch.int16), (q.data >> 4).to(torch.int16)
    nibbles = torch.stack((low, high), dim=-1).flatten(-2)[..., : q.n]
    return torch.where(nibbles >= 8, nibbles - 16, nibbles)


# ---------------------------------------------------------------------------------------------
# round trip


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(
    "n, block_size", [(1, 256), (7, 4), (7, None), (64, 16), (1001, 256), (1001, 7), (1001, None), (512, 256)]
)
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_round_trip_error_bound(bits, n, block_size, dtype):
    spec = QuantSpec(bits, block_size)
    x = _random((5, n), seed=n * 31 + bits, dtype=DTYPES[dtype])
    q = ref.quantize(x, spec)
    out = ref.dequantize(q, torch.float32)
    assert out.shape == x.shape and out.dtype == torch.float32

    x32 = x.float()
    absmax = _block_absmax(x32, spec.block(n))
    err = (x32.double() - out.double()).abs()
    # half a quantization step; the second term is fp32 rounding of x / scale and q * scale, which
    # can push an element sitting on a rounding tie a few ulps of absmax past the half step
    bound = absmax.double() / (2 * spec.qmax) * (1 + 1e-6) + absmax.double() * 4 * FP32_UNIT
    assert (err <= bound).all(), f"worst error / half step = {(err / (absmax.double() / (2 * spec.qmax))).max():.9f}"
    if n > 1:
        assert err.max() > 0, "nothing was quantized"

    # the block's absmax element round-trips up to fp32 rounding
    at_max = x32.abs() == absmax
    assert at_max.any()
    torch.testing.assert_close(out[at_max], x32[at_max], rtol=4 * FP32_UNIT, atol=0)

    # another output dtype is the fp32 values cast to it
    for other in (torch.bfloat16, torch.float16):
        assert torch.equal(ref.dequantize(q, other), out.to(other))


@pytest.mark.parametrize("bits", [8, 4])
def test_round_trip_many_leading_dims(bits):
    spec = QuantSpec(bits, 32)
    x = _random((3, 4, 75), seed=5)
    out = ref.dequantize(ref.quantize(x, spec), torch.float32)
    assert out.shape == (3, 4, 75)
    absmax = _block_absmax(x, 32)
    assert ((x - out).abs() <= absmax / (2 * spec.qmax) * (1 + 1e-6) + absmax * 4 * FP32_UNIT).all()


# ---------------------------------------------------------------------------------------------
# storage


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n, block_size", [(1, 256), (7, 4), (1001, 256), (1001, None), (256, 256), (10, 3)])
def test_storage_shapes(bits, n, block_size):
    spec = QuantSpec(bits, block_size)
    q = ref.quantize(_random((2, 3, n), seed=1), spec)
    blocks = 1 if block_size is None else math.ceil(n / block_size)
    row_bytes = n if bits == 8 else math.ceil(n / 2)
    assert spec.qmax == (127 if bits == 8 else 7)
    assert spec.blocks(n) == blocks and spec.row_bytes(n) == row_bytes
    assert q.data.dtype == (torch.int8 if bits == 8 else torch.uint8) == spec.data_dtype
    assert q.data.shape == (2, 3, row_bytes)
    assert q.scales.dtype == torch.float32 and q.scales.shape == (2, 3, blocks)
    assert q.n == n and q.spec == spec
    assert q.nbytes == 6 * row_bytes + 6 * blocks * 4
    sub = q[1]
    assert sub.data.shape == (3, row_bytes) and torch.equal(sub.scales, q.scales[1])
    flat = q.reshape(6)
    assert flat.data.shape == (6, row_bytes) and flat.scales.shape == (6, blocks)


def test_int4_nibble_layout_by_hand():
    # absmax 7 -> scale 7 / 7 = 1, so the codes are the values themselves
    x = torch.tensor([[-7.0, 7.0, 1.0, -1.0, 3.0], [0.0, -3.0, 7.0, 2.0, -6.0]])
    q = ref.quantize(x, QuantSpec(4, 8))
    assert torch.equal(q.scales, torch.ones(2, 1))
    # row 0: (-7 low = 0x9, 7 high = 0x7) -> 0x79; (1 -> 0x1, -1 -> 0xF) -> 0xF1; (3, pad 0) -> 0x03
    # row 1: (0, -3 = 0xD) -> 0xD0; (7, 2) -> 0x27; (-6 = 0xA, pad) -> 0x0A
    expected = torch.tensor([[0x79, 0xF1, 0x03], [0xD0, 0x27, 0x0A]], dtype=torch.uint8)
    assert torch.equal(q.data, expected)
    assert torch.equal(ref.dequantize(q, torch.float32), x)


def test_int8_codes_by_hand():
    x = torch.tensor([[-7.0, 7.0, 1.0, -1.0, 3.0, 127.0, -127.0]])  # absmax 127 -> scale 1
    q = ref.quantize(x, QuantSpec(8, None))
    assert torch.equal(q.data, x.to(torch.int8))
    assert torch.equal(q.scales, torch.ones(1, 1))


def test_pack_int4_by_hand_under_leading_dims():
    codes = (torch.arange(2 * 3 * 9) % 16 - 8).to(torch.int8).view(2, 3, 9)  # every nibble, odd rows
    packed = pack_int4(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 3, 5)
    assert packed[0, 0].tolist() == [0x98, 0xBA, 0xDC, 0xFE, 0x00]  # -8 -7, -6 -5, -4 -3, -2 -1, 0 (pad)
    assert torch.equal(_codes(Quantized(packed, torch.empty(0), 9, QuantSpec(4))), codes.to(torch.int16))
    assert torch.equal(unpack_int4(packed, 9), codes)


@pytest.mark.parametrize("n", [1, 2, 15, 16, 33])
def test_int4_every_code_round_trips_through_nibbles(n):
    codes = (torch.arange(n) % 15 - 7).float().view(1, n)
    codes[0, 0] = 7.0  # absmax 7 -> scale 1
    q = ref.quantize(codes, QuantSpec(4, None))
    assert q.data.shape == (1, math.ceil(n / 2))
    assert torch.equal(_codes(q).float(), codes)


# ---------------------------------------------------------------------------------------------
# zero and non-finite blocks


@pytest.mark.parametrize("bits", [8, 4])
def test_zero_blocks(bits):
    spec = QuantSpec(bits, 4)
    x = _random((2, 13), seed=2)
    x[0, 4:8] = 0.0  # a full zero block
    x[1, 12:] = 0.0  # the short last block
    q = ref.quantize(x, spec)
    codes = _codes(q)
    assert (codes[0, 4:8] == 0).all() and (codes[1, 12:] == 0).all()
    assert q.scales[0, 1] == 0 and q.scales[1, 3] == 0
    out = ref.dequantize(q, torch.float32)
    assert torch.isfinite(out).all()
    assert (out[0, 4:8] == 0).all() and (out[1, 12:] == 0).all()

    zeros = ref.quantize(torch.zeros(3, 9), spec)
    assert (_codes(zeros) == 0).all() and (zeros.scales == 0).all()
    assert torch.equal(ref.dequantize(zeros, torch.float32), torch.zeros(3, 9))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_non_finite_block_dequantizes_to_nan(bits, bad, dtype):
    spec = QuantSpec(bits, 4)
    x = _random((3, 14), seed=3).to(DTYPES[dtype])
    x[0, 5] = bad  # block 1 of row 0
    x[2, 13] = bad  # the short last block (12:14) of row 2
    out = ref.dequantize(ref.quantize(x, spec), torch.float32)
    poisoned = torch.zeros(3, 14, dtype=torch.bool)
    poisoned[0, 4:8] = True
    poisoned[2, 12:14] = True
    assert out[poisoned].isnan().all()
    assert torch.isfinite(out[~poisoned]).all()
    clean = x.float()
    absmax = _block_absmax(torch.where(poisoned, 0.0, clean), 4)
    bound = absmax / (2 * spec.qmax) * (1 + 1e-6) + absmax * 4 * FP32_UNIT
    assert ((clean - out).abs()[~poisoned] <= bound[~poisoned]).all()
    # cast to a low-precision output keeps the NaN (what the loss scaler checks)
    assert ref.dequantize(ref.quantize(x, spec), DTYPES[dtype])[poisoned].isnan().all()


def test_non_finite_row_without_blocks():
    x = _random((3, 10), seed=4)
    x[1, 7] = float("inf")
    out = ref.dequantize(ref.quantize(x, QuantSpec(8, None)), torch.float32)
    assert out[1].isnan().all()
    assert torch.isfinite(out[[0, 2]]).all()


# ---------------------------------------------------------------------------------------------
# row_order


def _assert_same_quantized(a: Quantized, b: Quantized) -> None:
    assert a.n == b.n and a.spec == b.spec
    assert a.data.dtype == b.data.dtype and torch.equal(a.data, b.data)
    assert torch.equal(a.scales, b.scales)


@pytest.mark.parametrize("spec", [QuantSpec(8, 16), QuantSpec(4, 16), QuantSpec(4, 5), QuantSpec(8, None)])
def test_row_order(spec):
    x = _random((2, 3, 37), seed=6)
    rows = x.reshape(-1, 37)
    for order in ([5, 0, 3, 1, 4, 2], [4, 1], [2, 2, 0]):
        idx = torch.tensor(order)
        got = ref.quantize(x, spec, row_order=idx)
        assert got.data.shape[0] == len(order)
        _assert_same_quantized(got, ref.quantize(rows[idx], spec))


@pytest.mark.parametrize("spec", [QuantSpec(8, 4), QuantSpec(4, 4), QuantSpec(4, None)])
def test_row_order_on_strided_view(spec):
    full = _random((40,), seed=7)
    view = full.view(4, 10)[:, 3:9]
    assert not view.is_contiguous()
    idx = torch.tensor([2, 0, 3])
    expected = ref.quantize(view.contiguous()[idx], spec)
    _assert_same_quantized(ref.quantize(view, spec, row_order=idx), expected)
    _assert_same_quantized(ref.quantize(view.reshape(-1, 6)[idx], spec), expected)
    _assert_same_quantized(ref.quantize(view, spec), ref.quantize(view.contiguous(), spec))


# ---------------------------------------------------------------------------------------------
# reductions


def _sources(count: int, rows: int, n: int, spec: QuantSpec, seed: int) -> Quantized:
    """`count` quantized sources of [rows, n], magnitudes differing by orders between sources."""
    x = torch.stack([_random((rows, n), seed=seed + i) * 10.0 ** (i % 4 - 1) for i in range(count)])
    return ref.quantize(x, spec)


def _fold(q: Quantized, order) -> torch.Tensor:
    total = None
    for i in order:
        value = ref.dequantize(q[i], torch.float32)
        total = value if total is None else total + value
    return total


@pytest.mark.parametrize("spec", [QuantSpec(8, 16), QuantSpec(4, 7), QuantSpec(8, None)])
@pytest.mark.parametrize("divisor", [1, 3, 8])
def test_dequantize_reduce(spec, divisor):
    q = _sources(5, 6, 50, spec, seed=10)
    in_order = _fold(q, range(5))
    expected = in_order / divisor if divisor != 1 else in_order
    got = ref.dequantize_reduce(q, torch.float32, divisor=divisor)
    assert got.dtype == torch.float32 and got.shape == (6, 50)
    assert torch.equal(got, expected)
    # the sources differ by orders of magnitude, so another summation order gives other bits:
    # the equality above really pins the index order
    assert not torch.equal(_fold(q, reversed(range(5))), in_order)

    for dtype in (torch.bfloat16, torch.float16):
        low = ref.dequantize_reduce(q, dtype, divisor=divisor)
        assert low.dtype == dtype and torch.equal(low, expected.to(dtype))


def test_dequantize_reduce_out_writes_in_place():
    spec = QuantSpec(4, 16)
    q = _sources(3, 4, 20, spec, seed=20)
    expected = (_fold(q, range(3)) / 3).to(torch.bfloat16)

    big = torch.full((7, 20), -1.0, dtype=torch.bfloat16)
    out = big[2:6]
    result = ref.dequantize_reduce(q, torch.bfloat16, divisor=3, out=out)
    assert result.data_ptr() == out.data_ptr()
    assert torch.equal(big[2:6], expected)
    assert (big[:2] == -1).all() and (big[6:] == -1).all()

    wide = torch.full((4, 30), -1.0)  # a column slice: strided rows
    ref.dequantize_reduce(q, torch.float32, divisor=3, out=wide[:, 5:25])
    assert torch.equal(wide[:, 5:25], _fold(q, range(3)) / 3)
    assert (wide[:, :5] == -1).all() and (wide[:, 25:] == -1).all()


@pytest.mark.parametrize(
    "source_spec, out_spec",
    [(QuantSpec(8, 16), QuantSpec(8, 16)), (QuantSpec(4, 16), QuantSpec(4, 16)), (QuantSpec(4, 7), QuantSpec(8, 32))],
)
def test_dequantize_reduce_quantize(source_spec, out_spec):
    q = _sources(4, 3, 45, source_spec, seed=30)
    got = ref.dequantize_reduce_quantize(q, out_spec)
    _assert_same_quantized(got, ref.quantize(_fold(q, range(4)), out_spec))


def test_quantize_and_dequantize_out():
    spec = QuantSpec(4, 8)
    x = _random((3, 21), seed=40)
    expected = ref.quantize(x, spec)
    target = Quantized(torch.zeros_like(expected.data), torch.zeros_like(expected.scales), 21, spec)
    result = ref.quantize(x, spec, out=target)
    assert result is target
    _assert_same_quantized(target, expected)

    big = torch.zeros(5, 21, dtype=torch.float16)
    ref.dequantize(expected, torch.float16, out=big[1:4])
    assert torch.equal(big[1:4], ref.dequantize(expected, torch.float16))
    assert (big[0] == 0).all() and (big[4] == 0).all()


def _rule_block_by_block(x: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The rounding rule of ``zeropp.quant`` written out one block at a time: (int codes, scales)."""
    rows = x.float().reshape(-1, x.shape[-1])
    block, n = spec.block(rows.shape[-1]), rows.shape[-1]
    codes, scales = torch.zeros(rows.shape, dtype=torch.int16), torch.zeros(rows.shape[0], spec.blocks(n))
    for start in range(0, n, block):
        values = rows[:, start : start + block]
        scale = values.abs().amax(dim=-1, keepdim=True) / torch.tensor(float(spec.qmax))
        usable = (scale > 0) & torch.isfinite(scale)
        q = torch.round(values / torch.where(usable, scale, 1.0)).clamp(-spec.qmax, spec.qmax)
        codes[:, start : start + block] = torch.where(usable, q, 0.0).to(torch.int16)
        scales[:, start // block] = scale[:, 0]
    return codes, scales


@pytest.mark.parametrize(
    "spec", [QuantSpec(8, 256), QuantSpec(4, 256), QuantSpec(8, 48), QuantSpec(4, 49), QuantSpec(4, None)]
)
@pytest.mark.parametrize("n", [1, 203, 512, 1001])
def test_reference_is_the_rounding_rule_bit_for_bit(spec, n):
    """The reference's view of rows as full blocks plus a tail, its int4 packing by int16 words and
    its unpacking by shifts give the rule's codes and scales exactly, on special rows too."""
    x = _random((7, n), seed=n)
    x[0, : min(n, 5)] = torch.tensor([127.0, 2.5, -3.5, 0.5, -1.5])[: min(n, 5)]  # ties (scale 1 for int8 rows)
    x[1] = 0.0
    x[2, n // 2] = float("inf")
    x[3, n - 1] = float("nan")
    x[4] *= 1e-39  # subnormal scales
    x[5] = -0.0
    q = ref.quantize(x, spec)
    codes, scales = _rule_block_by_block(x, spec)
    assert torch.equal(_codes(q), codes)
    assert torch.equal(torch.isnan(q.scales), torch.isnan(scales))
    assert torch.equal(q.scales.nan_to_num(0).view(torch.int32), scales.nan_to_num(0).view(torch.int32))
    assert torch.equal(q.data, codes.to(torch.int8) if spec.bits == 8 else pack_int4(codes.to(torch.int8)))
    expected = torch.where(torch.isfinite(scales).repeat_interleave(spec.block(n), dim=1)[:, :n], 0.0, float("nan"))
    expected += codes.float() * scales.nan_to_num(0).repeat_interleave(spec.block(n), dim=1)[:, :n]
    assert torch.equal(torch.isnan(ref.dequantize(q, torch.float32)), torch.isnan(expected))
    assert torch.equal(ref.dequantize(q, torch.float32).nan_to_num(0), expected.nan_to_num(0))


@pytest.mark.parametrize("spec", [QuantSpec(8, 16), QuantSpec(4, 7), QuantSpec(4, None)])
def test_joined_message_round_trips(spec):
    """qwZ / qgZ send each row's scales and data as one uint8 message; the receiver's rows are the sender's."""
    from zeropp.comm.quantized import joined, split

    q = ref.quantize(_random((6, 45), seed=41), spec)
    message = joined(q)
    assert message.dtype == torch.uint8 and message.shape == (6, q.nbytes // 6)
    assert torch.equal(message[:, : 4 * spec.blocks(45)].contiguous().view(torch.float32), q.scales)
    received = split(message.clone(), 45, spec)
    _assert_same_quantized(received, q)
    assert received.data.dtype == spec.data_dtype
    assert torch.equal(ref.dequantize(received, torch.float32), ref.dequantize(q, torch.float32))


# ---------------------------------------------------------------------------------------------
# rounding


def test_round_half_even_int8():
    x = torch.tensor([[127.0, 2.5, -2.5, 3.5, -3.5, 0.5, 1.5, -0.5, 126.5]])  # absmax 127 -> scale 1
    q = ref.quantize(x, QuantSpec(8, None))
    assert q.scales.item() == 1.0
    assert q.data.tolist() == [[127, 2, -2, 4, -4, 0, 2, 0, 126]]


def test_round_half_even_int4():
    x = torch.tensor([[7.0, 2.5, -3.5, 0.5, -1.5, 6.5, 5.5]])  # absmax 7 -> scale 1
    q = ref.quantize(x, QuantSpec(4, 8))
    assert q.scales.item() == 1.0
    assert _codes(q).tolist() == [[7, 2, -4, 0, -2, 6, 6]]


def test_kernels_for_cpu_is_the_reference():
    assert kernels_for(torch.device("cpu")) is ref
    assert kernels_for(torch.device("cpu"), "torch") is ref


def assert_implements_quant_kernels(module) -> None:
    """`module` has the functions of ``QuantKernels`` with its signatures: names, kinds, defaults, annotations."""
    assert isinstance(module, QuantKernels)
    names = [name for name in vars(QuantKernels) if not name.startswith("_")]
    assert names == ["quantize", "dequantize", "dequantize_reduce", "dequantize_reduce_quantize"]
    for name in names:
        declared = inspect.signature(getattr(QuantKernels, name))
        without_self = declared.replace(parameters=list(declared.parameters.values())[1:])
        assert inspect.signature(getattr(module, name)) == without_self, name


def test_reference_implements_quant_kernels():
    assert_implements_quant_kernels(ref)
    functions = {name: getattr(ref, name) for name in ("dequantize", "dequantize_reduce", "dequantize_reduce_quantize")}
    drifted = SimpleNamespace(**functions, quantize=lambda x, spec, *, order=None, out=None: None)
    with pytest.raises(AssertionError, match="quantize"):
        assert_implements_quant_kernels(drifted)


# ---------------------------------------------------------------------------------------------
# qgZ index math


def _block_vs_tensor_ratio(flat: torch.Tensor) -> float:
    """Mean-squared int8 error of one scale for the whole vector over that of 256-element blocks."""
    flat = flat.float().view(1, -1)

    def mse(spec: QuantSpec) -> float:
        return float((ref.dequantize(ref.quantize(flat, spec), torch.float32) - flat).pow(2).mean())

    return mse(QuantSpec(8, None)) / mse(QuantSpec(8, 256))


def _trained_block() -> torch.Tensor:
    """One transformer block's parameters, concatenated, after 30 AdamW steps on random bytes."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        config = GPTConfig(block_size=32, n_layer=2, n_head=2, d_model=64)
        model = GPT(config)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for _ in range(30):
            tokens = torch.randint(0, 256, (8, config.block_size + 1))
            loss = model(tokens[:, :-1], tokens[:, 1:])
            opt.zero_grad()
            loss.backward()
            opt.step()
    block = model.blocks[0]
    assert not torch.allclose(block.ln_1.weight, torch.ones_like(block.ln_1.weight)), "weights did not move"
    return torch.cat([p.detach().reshape(-1) for p in block.parameters()])


def test_block_quantization_beats_per_tensor_on_trained_gpt_block():
    flat = _trained_block()
    assert flat.numel() == 12 * 64 * 64 + 13 * 64
    ratio = _block_vs_tensor_ratio(flat)
    assert ratio >= 3, f"per-tensor / block int8 MSE ratio {ratio:.2f} on a trained GPT block"


def test_block_quantization_beats_per_tensor_on_heavy_tails():
    with torch.random.fork_rng():
        torch.manual_seed(1)
        t = torch.distributions.StudentT(df=3.0).sample((256, 512))
        row_scale = torch.distributions.LogNormal(0.0, 1.0).sample((256, 1))
    ratio = _block_vs_tensor_ratio(t * row_scale)
    assert ratio >= 3, f"per-tensor / block int8 MSE ratio {ratio:.2f} on Student-t(3) x lognormal rows"
