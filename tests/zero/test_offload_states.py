"""``engine.offload_states()`` / ``reload_states()``: exact counts of what moved, bit-identical training
across an offload and reload between two steps, refusals while offloaded; the CUDA path's device bytes."""

from __future__ import annotations

import pytest
import torch
from launcher import run_ranks
from models import GPT_TEST

CASES = (  # (stage, precision, offload.optimizer)
    (0, "bf16", "none"),
    (1, "fp32", "none"),
    (2, "bf16", "none"),
    (3, "fp32", "none"),
    (3, "bf16", "none"),
    (3, "bf16", "cpu"),
)


def _engine(stage: int, precision: str, offload: str, topology):
    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.app.models.gpt import GPT

    torch.manual_seed(0)
    config = ZeroConfig(stage=stage, precision=precision, persistence_threshold=0, offload_optimizer=offload)
    return ZeroEngine(GPT(GPT_TEST), torch.optim.AdamW, dict(lr=1e-3), config, topology)


def _step(engine, step: int) -> None:
    g = torch.Generator().manual_seed(step * 10 + engine.topology.rank)
    tokens = torch.randint(0, 256, (2, GPT_TEST.block_size + 1), generator=g).to(engine.topology.device)
    engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
    assert engine.step()


def _expected(engine) -> dict[str, tuple[int, int]]:
    """What offload_states must report, from the rule in zeropp.zero.offload.states."""
    out = {}
    for k, unit in enumerate(engine.units):
        host = unit.options.master_device is not None
        # the segments' per-element states live in one buffer per key and unit (See [Note: segments]);
        # a step count is a tensor of each segment's
        steps = [v for t in engine.stepper.tensors(k) for key, v in engine.optimizer.state[t].items() if key == "step"]
        aliased = unit.master.data_ptr() in {
            t.data_ptr() for t in (unit.compute_flat, unit.compute_shard) if t is not None
        }
        kept = [unit.grad_flat, unit.grad_shard]
        pieces = {
            "master": [] if host or aliased else [unit.master],
            "optimizer": [] if host else [*engine.stepper.buffers[k].values(), *steps],
            "gradients": [t for t in kept if t is not None],
        }
        for kind, tensors in pieces.items():
            tensors = [t for t in tensors if t.device == engine.topology.device]  # CUDA: Adam's step is on the host
            count, size = out.get(kind, (0, 0))
            out[kind] = (count + len(tensors), size + sum(t.numel() * t.element_size() for t in tensors))
    return {kind: value for kind, value in out.items() if value[0]}


def offload_worker() -> list:
    from zeropp.topology import init_topology

    topology = init_topology()
    results = []
    for case in CASES:
        plain, moved = _engine(*case, topology), _engine(*case, topology)
        for engine in (plain, moved):
            _step(engine, 0)
        expected = _expected(moved)
        out = moved.offload_states()
        zeros = torch.zeros(1, 4, dtype=torch.long)
        with pytest.raises(RuntimeError) as backward:
            moved.backward(moved(zeros, zeros))
        with pytest.raises(RuntimeError) as again:
            moved.offload_states()
        refused = [str(backward.value), str(again.value)]
        back = moved.reload_states()
        for engine in (plain, moved):
            _step(engine, 1)
            _step(engine, 2)
        same = all(torch.equal(a.master, b.master) for a, b in zip(plain.units, moved.units, strict=True))
        got = {kind: (out.tensors[kind], out.bytes[kind]) for kind in out.tensors}
        again = {kind: (back.tensors[kind], back.bytes[kind]) for kind in back.tensors}
        results.append(dict(case=case, got=got, again=again, expected=expected, same=same, refused=refused))
    return results


def test_offload_and_reload_count_what_moved_and_training_continues_bit_identically():
    for rank_results in run_ranks(offload_worker, 2):
        for r in rank_results:
            assert r["got"] == r["expected"] == r["again"], r["case"]
            assert r["same"], r["case"]
            assert all("reload_states()" in line and "\n" not in line for line in r["refused"]), r["case"]
            stage, precision, offload = r["case"]
            assert ("master" in r["got"]) == (precision == "bf16" and offload == "none" or stage in (1, 2)), r["case"]
            assert ("gradients" in r["got"]) == (stage <= 1), r["case"]
            assert ("optimizer" in r["got"]) == (offload == "none"), r["case"]


def bad_kind_worker() -> tuple[str, dict]:
    from zeropp.errors import ConfigError
    from zeropp.topology import init_topology

    engine = _engine(1, "bf16", "none", init_topology())
    with pytest.raises(ConfigError) as error:
        engine.offload_states(include=("optimizer", "weights"))
    moved = engine.offload_states("master")  # one kind by name
    with pytest.raises(RuntimeError, match=r"loading a state with states offloaded; call engine.reload_states\(\)"):
        engine.load_sharded_state_dict({})
    engine.reload_states()
    return str(error.value), moved.tensors


def test_an_unknown_state_is_refused_in_one_line_and_one_kind_may_be_named_alone():
    message, moved = run_ranks(bad_kind_worker, 1)[0]
    assert message == "offload_states: unknown state 'weights'; expected some of optimizer, master, gradients"
    assert moved == {"master": 3}  # the GPT's 2 blocks and its root at world 1, and nothing else


def cuda_worker() -> dict:
    from zeropp.topology import init_topology

    topology = init_topology()
    plain, moved = (_engine(1, "bf16", "none", topology) for _ in range(2))
    for engine in (plain, moved):
        _step(engine, 0)
    expected = _expected(moved)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = moved.offload_states()
    after_offload = torch.cuda.memory_allocated()
    pinned = all(t.is_pinned() for s in moved.optimizer.state.values() for t in s.values() if t.dim())
    back = moved.reload_states()
    after_reload = torch.cuda.memory_allocated()
    for engine in (plain, moved):
        _step(engine, 1)
    same = all(torch.equal(a.master, b.master) for a, b in zip(plain.units, moved.units, strict=True))
    return dict(
        before=before, after_offload=after_offload, after_reload=after_reload, pinned=pinned, same=same,
        moved=sum(out.bytes.values()), tensors=sum(out.tensors.values()), reloaded=sum(back.bytes.values()),
        expected=sum(size for _, size in expected.values()),
    )  # fmt: skip


@pytest.mark.gpu
def test_cuda_offload_frees_the_device_bytes_it_reports_and_reload_brings_them_back():
    r = run_ranks(cuda_worker, 1, start="spawn")[0]
    print(r)
    assert r["moved"] == r["reloaded"] == r["expected"] > 0 and r["pinned"] and r["same"]
    freed = r["before"] - r["after_offload"]  # the allocator rounds each block up to 512 bytes
    assert r["moved"] <= freed <= r["moved"] + 512 * r["tensors"]
    assert r["after_reload"] == r["before"]
