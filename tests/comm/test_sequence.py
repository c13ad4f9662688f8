"""Ranks that issue different collectives are stopped in one line; a hang names the rank behind."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from launcher import run_ranks
from torch import nn

TIMEOUT_S = 3.0
ZEROPP = dict(quantized_weights=True, quantized_gradients=True, hpz_partition_size=1)


class RankDependent(nn.Module):
    """Rank r runs layers[r]: the same shapes on every rank, different units (or rank 1 skips layers[1]
    from step `skip_at`)."""

    def __init__(self, skip_at: int | None = None) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.out = nn.Linear(16, 1)
        self.skip_at, self.calls = skip_at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rank = torch.distributed.get_rank()
        x = torch.tanh(self.inp(x))
        if self.skip_at is None:
            x = torch.tanh(self.layers[rank](x))
        else:
            for i, layer in enumerate(self.layers):
                if not (rank == 1 and i == 1 and self.calls >= self.skip_at):
                    x = torch.tanh(layer(x))
        self.calls += 1
        return self.out(x).square().mean()


def engine_for(model: nn.Module, timeout_s: float = 60.0, **zero):
    from zeropp import ZeroEngine
    from zeropp.config.sections import TopologyConfig, ZeroConfig
    from zeropp.topology import init_topology

    topology = init_topology(TopologyConfig(nodes=2, timeout_s=timeout_s))
    torch.manual_seed(0)
    return ZeroEngine(model, torch.optim.AdamW, dict(lr=1e-2), ZeroConfig(**zero), topology, units=list(model.layers))


def train(engine, steps: int) -> None:
    for step in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        engine.backward(engine(x))
        engine.step()


def diverging_worker(zero: dict) -> str:
    from zeropp.comm.sequence import SequenceMismatch

    engine = engine_for(RankDependent(), **zero)
    try:
        train(engine, 3)
    except SequenceMismatch as error:
        return f"{engine.global_step}|{error}"
    return "trained silently"


@pytest.mark.parametrize("zero", [dict(stage=s) for s in range(4)] + [dict(stage=3, **ZEROPP)], ids=str)
def test_rank_dependent_units_stop_at_the_first_step_naming_both_ranks_units(zero):
    for result in run_ranks(diverging_worker, 2, zero=zero):
        step, message = result.split("|", 1)
        assert step == "1" and "\n" not in message, result
        assert message.startswith("zeropp: the ranks issued different collectives by step 1, first at collective #")
        assert "rank 0 " in message and "rank 1 " in message, message
        assert "unit 'layers.0'" in message and "unit 'layers.1'" in message, message


def same_units_worker() -> tuple[int, float]:
    engine = engine_for(RankDependent(skip_at=10**9), stage=3, sequence_check_interval=2, **ZEROPP)
    train(engine, 4)
    return engine.comm.trace.count, engine.comm.ledger.total(op="sequence.all_gather")


def test_ranks_that_agree_pass_every_check():
    (count, checked), (other_count, _) = run_ranks(same_units_worker, 2)
    assert count == other_count > 0
    assert checked == 3 * 16  # checks after steps 1, 2 and 4, each 16 bytes from the one other rank


# -- the flight recorder -----------------------------------------------------------------------------


def stopped_rank_worker(folder: str) -> str:
    from zeropp.comm.communicator import CollectiveTimeout

    model = RankDependent(skip_at=10**9)
    engine = engine_for(model, TIMEOUT_S, stage=3, flight_record_dir=folder)
    pids = [None, None]
    torch.distributed.all_gather_object(pids, os.getpid())
    if engine.topology.rank == 1:  # stops itself in step 2, before layers.1 is gathered
        stop = lambda *_: os.kill(os.getpid(), signal.SIGSTOP) if model.calls else None  # noqa: E731
        model.layers[1].register_forward_pre_hook(stop, prepend=True)
    try:
        train(engine, 3)
        return "no error"
    except CollectiveTimeout as error:
        if engine.topology.rank == 0:
            os.kill(pids[1], signal.SIGCONT)  # rank 1 goes on and finds rank 0 gone
        return str(error)


def test_a_stopped_rank_is_named_with_the_unit_and_op_the_others_wait_in(tmp_path):
    message = run_ranks(stopped_rank_worker, 2, folder=str(tmp_path))[0]
    assert message.startswith("zeropp: a collective timed out (topology.timeout_s): rank 1 behind (no flight record")
    assert "\n" not in message and str(tmp_path) in message
    record = json.loads((tmp_path / "flight-rank0.json").read_text())
    waiting = record["entries"][-1]
    assert record["reason"] == "timeout" and waiting["completed"] is None
    # rank 1 stopped before layers.1's forward; rank 0 waits in layers.1's gather, or in layers.2's where
    # the prefetch had gathered layers.1 already: the line names the one in its record
    assert waiting["unit"] in ("layers.1", "layers.2"), waiting
    assert "rank 0 waits in collective #" in message, message
    assert f"all_gather of unit '{waiting['unit']}' (forward" in message, message


def skipping_worker(folder: str) -> str:
    from zeropp.comm.communicator import CollectiveTimeout
    from zeropp.comm.sequence import SequenceMismatch

    engine = engine_for(
        RankDependent(skip_at=1), TIMEOUT_S, stage=3, sequence_check_interval=0, flight_record_dir=folder
    )
    try:
        train(engine, 3)
        return "no error"
    except (CollectiveTimeout, SequenceMismatch) as error:
        return str(error)


def test_a_rank_that_skips_a_unit_is_named_with_the_unit_and_op(tmp_path):
    started = time.monotonic()
    messages = run_ranks(skipping_worker, 2, folder=str(tmp_path))
    assert time.monotonic() - started < 60
    for message in messages:
        assert "\n" not in message and "different collectives, first at collective #" in message, message
        assert "rank 0 all_gather of unit 'layers.1' (backward" in message, message
        assert "rank 1 reduce_scatter of unit 'layers.2' (backward" in message, message
    assert sorted(p.name for p in Path(tmp_path).iterdir()) == ["flight-rank0.json", "flight-rank1.json"]
