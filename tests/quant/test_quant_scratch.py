"""Reused memory changes no result: the reference kernels' scratch (zeropp.quant.scratch) and the
quantized collectives' message pool (zeropp.comm.quantized.MessagePool).

Against fresh, garbage-filled memory for every temporary and every message (a buffer read before
it is written, or two live ones sharing memory, would show), bit for bit: every function of the
quantization API on one process, and ZeRO++ training (qwZ + hpZ + qgZ, with accumulation, error
feedback and two-level qgZ) on 4 gloo ranks as 2 nodes x 2. What a kernel returns never lives in
scratch; a message goes back to the pool only once its collective has completed.
"""

from __future__ import annotations

import contextlib
import itertools
import math

import pytest
import torch
from launcher import run_ranks
from models import global_batch, loss_of, make_model, rows

from zeropp.quant import reference, scratch
from zeropp.quant.spec import Quantized, QuantSpec


def _garbage(slot: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A fresh tensor of random bytes (NaNs and infinities among them) instead of the slot's buffer."""
    raw = torch.empty(math.prod(shape) * dtype.itemsize, dtype=torch.uint8, device=device).random_()
    return raw.view(dtype).view(shape)


@contextlib.contextmanager
def fresh_garbage_scratch():
    """Every temporary and every message fresh and filled with garbage while inside."""
    from zeropp.comm.quantized import messages

    real = scratch.empty
    scratch.empty = _garbage
    messages.take = lambda shape, device, dtype=torch.uint8: _garbage("message", shape, dtype, device)
    messages.give_back = lambda *buffers: None  # nothing of the fresh run enters the pool
    try:
        yield
    finally:
        scratch.empty = real
        del messages.take, messages.give_back  # the class's methods again


def _calls(x: torch.Tensor, spec: QuantSpec) -> dict[str, torch.Tensor | Quantized]:
    """Every reference function on `x` [rows, n], with and without `out` and `row_order`."""
    rows_, n = x.shape
    q = reference.quantize(x, spec)
    sources = q.reshape(rows_, 1)  # rows_ sources of one row each
    out32, out16 = torch.empty(1, n), torch.empty(1, n, dtype=torch.bfloat16)
    results = {
        "quantize": q,
        "quantize-ordered": reference.quantize(x, spec, row_order=torch.arange(rows_).flip(0)),
        "quantize-out": reference.quantize(
            x, spec, out=Quantized(torch.empty_like(q.data), torch.empty_like(q.scales), n, spec)
        ),
        "dequantize": reference.dequantize(q, torch.float32),
        "dequantize-bf16": reference.dequantize(q, torch.bfloat16),
        "dequantize-out": reference.dequantize(q, torch.float32, out=torch.empty(rows_, n)),
        "reduce": reference.dequantize_reduce(sources, torch.float32, divisor=3),
        "reduce-bf16": reference.dequantize_reduce(sources, torch.bfloat16),
        "reduce-out": reference.dequantize_reduce(sources, torch.float32, divisor=rows_, out=out32),
        "reduce-out-bf16": reference.dequantize_reduce(sources, torch.bfloat16, out=out16),
        "reduce-quantize": reference.dequantize_reduce_quantize(sources, spec),
    }
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in results.items()}


def _same(a: torch.Tensor | Quantized, b: torch.Tensor | Quantized) -> bool:
    if isinstance(a, Quantized):
        return _same(a.data, b.data) and _same(a.scales, b.scales)
    return torch.equal(
        a.view(torch.uint8) if a.dtype != torch.uint8 else a, b.view(torch.uint8) if b.dtype != torch.uint8 else b
    )


CASES = list(itertools.product((4, 8), (256, 7, None), (1, 255, 1000), (1, 3, 4)))


def _input(bits: int, block: int | None, n: int, rows_: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(bits * 100_003 + n * 7 + rows_ + (block or 0))
    x = torch.randn(rows_, n, generator=g) * torch.logspace(-3, 2, rows_)[:, None]
    x[0, : n // 3] = 0  # a zero block
    if n > 3:
        x[-1, 2] = float("inf")  # a non-finite block
    return x


@pytest.mark.parametrize("bits,block,n,rows_", CASES)
def test_reused_scratch_gives_the_fresh_memory_results(bits, block, n, rows_):
    spec, x = QuantSpec(bits, block), _input(bits, block, n, rows_)
    reused = _calls(x, spec)
    _calls(_input(bits, block, n + 1, rows_ + 1), spec)  # leaves other values (and sizes) in the slots
    again = _calls(x, spec)
    with fresh_garbage_scratch():
        fresh = _calls(x, spec)
    for name in reused:
        assert _same(reused[name], fresh[name]), name
        assert _same(again[name], fresh[name]), name


def test_results_never_live_in_scratch():
    spec, x = QuantSpec(4, 16), torch.randn(4, 300)
    kept = _returned(x, spec)
    snapshot = {
        k: (v.data.clone(), v.scales.clone()) if isinstance(v, Quantized) else v.clone() for k, v in kept.items()
    }
    _returned(torch.randn(4, 300) * 100, spec)  # every slot rewritten
    buffers = [(b.data_ptr(), b.data_ptr() + b.numel()) for b in scratch._slots.buffers.values()]
    assert buffers, "the calls used no scratch memory"
    for name, value in kept.items():
        tensors = (value.data, value.scales) if isinstance(value, Quantized) else (value,)
        for t in tensors:
            start = t.untyped_storage().data_ptr()
            assert all(start >= stop or start + t.untyped_storage().nbytes() <= begin for begin, stop in buffers), name
        before = snapshot[name]
        assert _same(value, Quantized(*before, value.n, value.spec) if isinstance(value, Quantized) else before), name


def _returned(x: torch.Tensor, spec: QuantSpec) -> dict[str, torch.Tensor | Quantized]:
    """The functions' results as they return them (not cloned)."""
    q = reference.quantize(x, spec)
    return {
        "quantize": q,
        "quantize-ordered": reference.quantize(x, spec, row_order=torch.tensor([2, 0, 3, 1])),
        "dequantize": reference.dequantize(q, torch.float32),
        "reduce": reference.dequantize_reduce(q, torch.float32, divisor=2),
        "reduce-quantize": reference.dequantize_reduce_quantize(q.reshape(2, 2), spec),
    }


def test_scratch_keeps_the_largest_request_and_can_be_released():
    scratch.release()
    reference.quantize(torch.randn(4, 4096), QuantSpec(4, 256))
    largest = scratch.kept_bytes()
    assert largest >= 4 * 4096 * 4  # the fp32 codes of the call at least
    reference.quantize(torch.randn(2, 100), QuantSpec(4, 256))
    assert scratch.kept_bytes() == largest  # smaller calls reuse the same buffers
    scratch.release()
    assert scratch.kept_bytes() == 0


def test_message_pool_hands_out_the_newest_buffer_of_a_shape_and_never_one_in_use():
    from zeropp.comm.quantized import MessagePool

    pool, cpu = MessagePool(), torch.device("cpu")
    a, b = pool.take((2, 8), cpu), pool.take((2, 8), cpu)
    assert a.data_ptr() != b.data_ptr()
    pool.give_back(a, b)
    assert pool.take((2, 8), cpu) is b and pool.take((2, 8), cpu) is a
    pool.give_back(a)
    assert pool.take((3, 8), cpu) is not a  # another shape: a fresh buffer
    assert pool.allocations == 3


def test_message_pool_keeps_a_bounded_multiple_of_its_peak_whatever_the_number_of_shapes():
    from zeropp.comm.quantized import MessagePool

    pool, cpu = MessagePool(), torch.device("cpu")
    for width in range(1000, 1050):  # 50 unit shapes, one message in use at a time
        pool.give_back(pool.take((1, width), cpu))
        assert pool.kept_bytes() <= MessagePool.KEPT_PER_PEAK * width
    assert pool.kept_bytes() >= 3 * 1000  # it still keeps what the bound allows
    kept = pool.kept_bytes()
    held = pool.take((1, 1049), cpu)
    assert pool.kept_bytes() == kept - 1049
    pool.release()
    assert pool.kept_bytes() == 0
    pool.give_back(held)  # in use while released: comes back and is kept within the bound
    assert pool.kept_bytes() == 1049
    for width in range(10, 20):  # the bound is the peak since the release: 1049 bytes
        pool.give_back(pool.take((1, width), cpu))
    assert pool.kept_bytes() <= MessagePool.KEPT_PER_PEAK * 1049


def test_message_pool_keeps_exactly_up_to_its_bound():
    from zeropp.comm.quantized import MessagePool

    pool, cpu = MessagePool(), torch.device("cpu")
    for shape in ((1, 64), (64, 1), (2, 32), (32, 2)):  # 64 bytes in use at a time, four shapes
        pool.give_back(pool.take(shape, cpu))
    assert pool.kept_bytes() == 4 * 64  # all four: 4 x the peak is allowed
    pool.give_back(pool.take((4, 16), cpu))
    assert pool.kept_bytes() == 4 * 64  # a fifth drops the oldest
    assert pool.take((1, 64), cpu).shape == (1, 64) and pool.allocations == 6


# -- ZeRO++ training on 4 gloo ranks: bit for bit the same weights --------------------------------

STEPS, ACCUMULATION = 3, 2
SCENARIOS = {
    "zeropp": dict(qgz_pipeline_min_chunk=1),  # two chunks of the tiny model's shards
    "feedback-two-level": dict(gradient_error_feedback="loco", gradient_intra_node_bits=8),
    "one-chunk-int4-weights": dict(qgz_pipeline_chunks=1, weight_bits=4),
    "unquantized-intra-node-hop": dict(gradient_intra_node_bits=0, gradient_error_feedback="loco"),
}


def _train(extra: dict, topo) -> tuple[object, list[int]]:
    """The engine after STEPS steps, and the message buffers the pool allocated in each step."""
    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.comm.quantized import messages
    from zeropp.config.sections import ZEROPP_SWITCHES

    config = ZeroConfig(stage=3, gradient_accumulation_steps=ACCUMULATION, **ZEROPP_SWITCHES, **extra)
    engine = ZeroEngine(make_model("gpt"), torch.optim.AdamW, dict(lr=1e-2), config, topo)
    allocations = []
    for step in range(STEPS):
        before = messages.allocations
        for micro in range(ACCUMULATION):
            engine.backward(loss_of("gpt", engine, *rows(global_batch("gpt", step, micro, topo.world_size), topo.rank)))
        assert engine.step()
        allocations.append(messages.allocations - before)
    return engine, allocations


def training_worker() -> dict[str, bool]:
    from zeropp.comm.quantized import messages
    from zeropp.config.sections import TopologyConfig
    from zeropp.topology import init_topology

    topo = init_topology(TopologyConfig(nodes=2))
    same = {}
    for name, extra in SCENARIOS.items():
        messages.release()
        engine, allocations = _train(extra, topo)
        reused = engine.full_state_dict()
        same[f"{name}: messages kept"] = messages.kept_bytes() > 0  # the pool was used and got its buffers back
        # later steps allocate only when more messages are in flight at once than before, which timing
        # decides (measured: 0-8 in the next two steps together, 12-28 in the first; without reuse every
        # step would allocate all it takes, 30 or more)
        mostly_first = sum(allocations[1:]) < allocations[0]
        same[f"{name}: messages allocated per step {allocations} mostly in the first"] = mostly_first
        with fresh_garbage_scratch():
            fresh = _train(extra, topo)[0].full_state_dict()
        same[name] = all(torch.equal(reused[k], fresh[k]) for k in fresh) and reused.keys() == fresh.keys()
    engine.set_quantized_gradients(False)  # the schedule's switch frees what qgZ's hops kept
    same["released when qgZ is switched off"] = messages.kept_bytes() == 0 and scratch.kept_bytes() == 0
    engine.backward(loss_of("gpt", engine, *rows(global_batch("gpt", STEPS, 0, topo.world_size), topo.rank)))
    engine.step()  # qwZ alone fills them again
    engine.set_quantized_gradients(False)  # what the schedule says at every later step: nothing to free
    same["qwZ's buffers kept while qgZ stays off"] = messages.kept_bytes() > 0 and scratch.kept_bytes() > 0
    return same


def test_zeropp_training_is_bit_identical_with_and_without_reused_memory():
    for rank, same in enumerate(run_ranks(training_worker, 4, nodes=2)):
        for name, equal in same.items():
            assert equal, f"rank {rank}: {name} does not hold"
