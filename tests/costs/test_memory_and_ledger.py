"""Measured model-state memory (ZeRO paper, Table 1) and per-rank communication volume (ZeRO paper, section 7).

Notation: Psi = parameter count, N = world size, P = the padded parameter count (sum of the units'
padded_numel), B = bytes of one full copy of the (padded) parameters in the reduction dtype.
"""

from __future__ import annotations

import torch
from launcher import run_ranks

WORLD, NODES = 4, 2
STAGES = (0, 1, 2, 3)
PER_RANK = 2
SCALAR_STEP_BYTES = 64  # per step: the grad-norm all-reduce of one fp32 number may be in "step"


def _gpt(block_size: int = 32, d_model: int = 64):
    from zeropp.app.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=block_size, n_layer=2, n_head=2, d_model=d_model))


def _batch(step: int, rank: int, block_size: int = 32):
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 256, (WORLD * PER_RANK, block_size + 1), generator=g)[
        rank * PER_RANK : (rank + 1) * PER_RANK
    ]
    return tokens[:, :-1], tokens[:, 1:]


def _engine(stage: int, topology, **zero):
    from zeropp import ZeroConfig, ZeroEngine

    # sequence_check_interval=0: the steps' traffic alone (the check's all-gather: tests/comm/test_sequence.py)
    config = ZeroConfig(stage=stage, persistence_threshold=0, sequence_check_interval=0, **zero)
    return ZeroEngine(_gpt(), torch.optim.AdamW, dict(lr=1e-3), config, topology)


def _train(engine, steps: int, accumulation: int = 1) -> None:
    rank = engine.topology.rank
    for step in range(steps):
        for micro in range(accumulation):
            x, y = _batch(step * accumulation + micro, rank)
            engine.backward(engine(x, y))
        assert engine.step()


def _units(engine) -> list[tuple[int, int]]:
    return [(u.layout.numel, u.layout.padded_numel) for u in engine.units]


# -- a. memory -------------------------------------------------------------------------------------


def memory_worker() -> dict:
    from zeropp.config.sections import TopologyConfig
    from zeropp.topology import init_topology

    topology = init_topology(TopologyConfig(nodes=NODES))
    out = {}
    for stage in STAGES:
        engine = _engine(stage, topology, precision="bf16")
        _train(engine, steps=2)  # the second step() measures with Adam's state allocated
        out[stage] = dict(measured=engine.measured_model_state_bytes, psi=engine.param_count, units=_units(engine))
    return out


def test_model_state_memory_matches_zero_table_1():
    per_rank = run_ranks(memory_worker, WORLD, nodes=NODES)
    n = WORLD
    # bf16 parameters and gradients (2 + 2 bytes), fp32 master + Adam m + v (K = 12 bytes)
    analytic = {
        0: lambda p: 16 * p,
        1: lambda p: 4 * p + 12 * p / n,
        2: lambda p: 2 * p + 14 * p / n,
        3: lambda p: 16 * p / n,
    }
    for rank, stages in enumerate(per_rank):
        for stage, got in stages.items():
            psi, measured = got["psi"], got["measured"]
            assert psi == sum(numel for numel, _ in got["units"])
            padding = sum(padded - numel for numel, padded in got["units"])
            padded = psi + padding
            what = f"rank {rank} stage {stage}: measured {measured}, Psi {psi}, padding {padding}"
            assert padding < 0.01 * psi, what  # the model is big enough for padding to be noise
            expected = analytic[stage](psi)
            assert abs(measured - expected) <= 0.05 * expected + 16 * padding, what
            # with the padding counted the byte count is exact
            assert measured == analytic[stage](padded), what
        measured = [stages[s]["measured"] for s in STAGES]
        assert measured[3] < measured[2] < measured[1] < measured[0], measured
    assert len({tuple(stages[s]["measured"] for s in STAGES) for stages in per_rank}) == 1  # equal shards


# -- b. ledger -------------------------------------------------------------------------------------


def ledger_worker() -> dict:
    from zeropp.config.sections import TopologyConfig
    from zeropp.topology import init_topology

    topology = init_topology(TopologyConfig(nodes=NODES))
    out = {}
    for stage in STAGES:
        engine = _engine(stage, topology)  # fp32
        ledger = engine.comm.ledger
        construction = ledger.total()
        ledger.reset()
        _train(engine, steps=3)
        out[stage] = dict(
            construction=construction,
            bytes=dict(ledger.bytes),
            calls=dict(ledger.calls),
            as_dict=ledger.as_dict(),
            steps=ledger.steps,
            psi=engine.param_count,
            units=_units(engine),
        )
    return out


def _total(bytes_: dict, op=None, phase=None, link=None) -> int:
    return sum(
        b
        for (o, p, k), b in bytes_.items()
        if (op is None or o == op) and (phase is None or p == phase) and (link is None or k == link)
    )


def test_ledger_volume_matches_zero_section_7():
    per_rank = run_ranks(ledger_worker, WORLD, nodes=NODES)
    n = WORLD
    for rank, stages in enumerate(per_rank):
        # ring successor of rank r is r + 1: 0->1 and 2->3 stay on a node, 1->2 and 3->0 cross
        link, other = ("intra", "inter") if rank in (0, 2) else ("inter", "intra")
        for stage, got in stages.items():
            what = f"rank {rank} stage {stage}: {got['as_dict']}"
            steps, bytes_ = got["steps"], got["bytes"]
            assert steps == 3, what
            # the initial-weight broadcast from rank 0 (the rank whose ring successor is rank 0 forwards nothing)
            assert got["construction"] == (0 if rank == WORLD - 1 else 4 * got["psi"]), what
            assert _total(bytes_, op="broadcast") == 0, what
            padded = sum(p for _, p in got["units"])
            B = 4 * padded  # fp32 parameters and gradients
            one_pass = B * (n - 1) // n

            big_ops = {}
            if stage == 3:
                big_ops = {
                    ("all_gather", "forward"): one_pass,
                    ("all_gather", "backward"): one_pass,
                    ("reduce_scatter", "backward"): one_pass,
                }
            elif stage in (1, 2):
                big_ops = {("reduce_scatter", "backward"): one_pass, ("all_gather", "step"): one_pass}
            else:
                big_ops = {("all_reduce", "backward"): 2 * one_pass}
            for (op, phase), expected in big_ops.items():
                total = _total(bytes_, op=op, phase=phase)
                assert total % steps == 0 and total // steps == expected, f"{op}/{phase}: {what}"
            big = sum(big_ops.values())

            # nothing else but a few scalar all-reduces (grad norm) in the step phase
            rest = _total(bytes_) - big * steps
            scalars = _total(bytes_, op="all_reduce", phase="step")
            assert rest == scalars, what
            assert scalars < SCALAR_STEP_BYTES * steps, what
            assert _total(bytes_, phase="other") == 0, what

            # the paper's figures, in Psi: 2 Psi per step for stages 0-2 (DP baseline), 3 Psi for stage 3
            psi_bytes = (3 if stage == 3 else 2) * 4 * got["psi"] * (n - 1) / n
            padding_bytes = (3 if stage == 3 else 2) * 4 * (padded - got["psi"])
            assert abs(big - psi_bytes) <= padding_bytes, what
            assert abs(_total(bytes_) / steps - psi_bytes) <= padding_bytes + SCALAR_STEP_BYTES, what

            # every byte goes to the ring successor: all on one link kind for this rank
            assert _total(bytes_, link=other) == 0, what
            assert _total(bytes_, link=link) == _total(bytes_), what
            for phases in got["as_dict"].values():
                for split in phases.values():
                    assert split[other] == 0, what
    # the same volume on every rank
    for stage in STAGES:
        assert len({_total(stages[stage]["bytes"]) for stages in per_rank}) == 1


# -- c. gradient accumulation -----------------------------------------------------------------------


def accumulation_worker() -> dict:
    from zeropp.config.sections import TopologyConfig
    from zeropp.topology import init_topology

    topology = init_topology(TopologyConfig(nodes=NODES))
    out = {}
    for stage in STAGES:
        engine = _engine(stage, topology, gradient_accumulation_steps=2)
        engine.comm.ledger.reset()
        _train(engine, steps=2, accumulation=2)
        ledger = engine.comm.ledger
        out[stage] = dict(calls=dict(ledger.calls), bytes=dict(ledger.bytes), steps=ledger.steps, units=_units(engine))
    return out


def test_gradient_accumulation_reduction_count():
    per_rank = run_ranks(accumulation_worker, WORLD, nodes=NODES)
    n = WORLD
    for rank, stages in enumerate(per_rank):
        for stage, got in stages.items():
            what = f"rank {rank} stage {stage}: {got}"
            steps, units = got["steps"], len(got["units"])
            assert steps == 2, what
            one_pass = 4 * sum(p for _, p in got["units"]) * (n - 1) // n
            # stages 2 and 3 reduce-scatter every micro-batch (gradients are sharded); stage 1 keeps whole
            # gradients and reduce-scatters once per step; stage 0 all-reduces once per step
            reductions_per_step = {0: 0, 1: 1, 2: 2, 3: 2}[stage]
            assert got["calls"].get(("reduce_scatter", "backward"), 0) == reductions_per_step * units * steps, what
            assert _total(got["bytes"], op="reduce_scatter") == reductions_per_step * one_pass * steps, what
            all_reduces = 1 if stage == 0 else 0
            assert got["calls"].get(("all_reduce", "backward"), 0) == all_reduces * units * steps, what
            assert _total(got["bytes"], op="all_reduce", phase="backward") == all_reduces * 2 * one_pass * steps, what


def test_the_disk_tiers_and_bf16_states_in_table_1():
    """Ψ = 10^9 on N = 8 in bf16 with Adam: Table 1's 16Ψ/N at stage 3, 12Ψ/N with bf16 moments; each
    tier holds its share, the disk tiers leave the host their rings only."""
    from zeropp.costs.memory import (
        analytic_model_state_bytes,
        disk_params_ring_bytes,
        disk_params_step_bytes,
        disk_tier_ring_bytes,
        disk_tier_step_bytes,
    )

    psi, n = 10**9, 8

    def tiers(**kw):
        return [analytic_model_state_bytes(psi, n, 3, "bf16", where=w, **kw) for w in ("device", "host", "disk")]

    assert tiers() == [16 * psi / n, 0, 0]
    assert tiers(optimizer_bytes=4) == [12 * psi / n, 0, 0]  # optimizer_state_dtype = "bf16": 2 + 2 + 4 + 4
    assert tiers(offload_optimizer=True, offload_params=True) == [2 * psi / n, 14 * psi / n, 0]
    # the optimizer's disk tier takes the reduced gradients too (stages 2-3: See [Note: gradients on disk])
    assert tiers(optimizer_on_disk=True) == [2 * psi / n, 0, 14 * psi / n]
    assert tiers(offload_optimizer=True, params_on_disk=True) == [2 * psi / n, 12 * psi / n, 2 * psi / n]
    assert tiers(optimizer_on_disk=True, params_on_disk=True, optimizer_bytes=4) == [0, 0, 12 * psi / n]
    stage2 = [
        analytic_model_state_bytes(psi, n, 2, "bf16", where=w, optimizer_on_disk=True) for w in ("device", "disk")
    ]
    assert stage2 == [2 * psi, 14 * psi / n]  # the whole bf16 weights stay; gradients and states go
    stage1 = [
        analytic_model_state_bytes(psi, n, 1, "bf16", where=w, optimizer_on_disk=True) for w in ("device", "disk")
    ]
    assert stage1 == [4 * psi, 12 * psi / n]  # whole gradients (not sharded) stay in memory
    # the rings: depth + 1 units of fp32 master and moments; window + 1 compute shards
    assert disk_tier_ring_bytes(1000, depth=2) == 3 * 12 * 1000
    assert disk_tier_ring_bytes(1000, depth=2, optimizer_bytes=4) == 3 * 8 * 1000
    assert disk_params_ring_bytes(1000, "bf16", window=2) == 3 * 2 * 1000
    # a step's traffic: the optimizer tier reads and writes its 12 (8) bytes once; the parameters' tier reads
    # the shard at every gather (2 per micro-batch) or, with hpZ, once, and writes it once
    assert disk_tier_step_bytes(1000) == (12_000, 12_000)
    assert disk_tier_step_bytes(1000, optimizer_bytes=4) == (8_000, 8_000)
    assert disk_params_step_bytes(1000, "bf16", micro_batches=4) == (16_000, 2_000)
    assert disk_params_step_bytes(1000, "bf16", micro_batches=4, hpz=True) == (2_000, 2_000)
