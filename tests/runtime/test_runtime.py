"""The runtime's pieces without processes: recorded order and prefetch, the reduction queue's bound
and hop ordering, and a unit's training-state transitions."""

from __future__ import annotations

import datetime

import pytest
import torch
from torch import nn

from zeropp.comm.communicator import Communicator, Pending
from zeropp.index.ranks import Layout
from zeropp.runtime.order import ExecutionOrder
from zeropp.runtime.reductions import ReductionQueue
from zeropp.topology import Group, ShardGroups, Topology
from zeropp.zero.options import UnitOptions
from zeropp.zero.stages import StagePolicy
from zeropp.zero.unit import FlatUnit
from zeropp.zero.unit_states import TrainingState


def test_order_is_recorded_once_and_prefetch_follows_it():
    order = ExecutionOrder()
    a, b, c = object(), object(), object()
    for unit in (a, b, a, c):
        order.record(unit)
        assert order.after(unit, 2) == []  # nothing is prefetched while recording
    order.freeze()
    order.record(object())  # not recorded any more
    assert order.units == [a, b, c]
    assert order.after(a, 1) == [b] and order.after(a, 5) == [b, c] and order.after(c, 1) == []
    assert order.after(object(), 1) == []


class FakeReduction(Pending):
    """A reduction with a second hop that can start once `ready` is set; logs what happens."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log, self.ready, self.hop_started = name, log, False, False
        super().__init__([], self._land, start_hops=self._start)

    def _start(self, wait: bool) -> bool:
        if (self.ready or wait) and not self.hop_started:
            self.hop_started = True
            self.log.append(f"hop {self.name}")
        return self.hop_started

    def _land(self) -> None:
        self.log.append(f"wait {self.name}")


def test_reduction_queue_bounds_in_flight_and_starts_hops_in_issue_order():
    log: list[str] = []
    queue = ReductionQueue(max_in_flight=2)
    first, second, third = (FakeReduction(n, log) for n in ("first", "second", "third"))
    second.ready = True  # its hop is ready, but the first's is not: it must not overtake
    queue.push(first)
    queue.push(second)
    assert log == []
    first.ready = True
    queue.push(third)  # over the bound: the oldest is waited for, then ready hops start in order
    assert log == ["wait first", "hop second"]
    queue.drain()
    assert log == ["wait first", "hop second", "wait second", "wait third"]


def test_reduction_queue_in_program_order_starts_the_earlier_hops_at_each_push_whether_ready_or_not():
    log: list[str] = []
    queue = ReductionQueue(max_in_flight=2, hops_in_program_order=True)
    first, second, third = (FakeReduction(n, log) for n in ("first", "second", "third"))
    second.ready = third.ready = True  # readiness decides nothing: the pushes do
    queue.push(first)
    assert log == []  # the newest reduction's hop waits for the next push
    queue.push(second)
    assert log == ["hop first"]  # not ready: started anyway, waiting for its first hop
    queue.push(third)
    assert log == ["hop first", "wait first", "hop second"]
    queue.drain()
    assert log == ["hop first", "wait first", "hop second", "wait second", "wait third"]  # third's: in its wait


def _unit(policy: StagePolicy) -> FlatUnit:
    layout = Layout(1, 1)
    world = Group(None, (0,), 0)
    topology = Topology(
        layout, 0, torch.device("cpu"), world, world, world, world, world, world, world, datetime.timedelta(seconds=5)
    )
    module = nn.Linear(3, 2)
    options = UnitOptions(torch.device("cpu"), torch.float32, torch.float32, 1, 0, 1 << 20, 1 << 20)
    groups = ShardGroups(world, world, world)
    return FlatUnit(module, list(module.named_parameters()), Communicator(topology), groups, policy, options)


def test_unit_training_state_transitions():
    unit = _unit(StagePolicy.for_stage(3))
    assert unit.training_state is TrainingState.IDLE
    unit.begin_backward()
    assert unit.training_state is TrainingState.PRE_BACKWARD
    assert unit.enter_backward() and not unit.enter_backward()  # gathered for backward once
    assert not unit.add_grad(0, torch.ones(2, 3))
    assert unit.add_grad(1, torch.ones(2))  # the last awaited gradient
    unit.finish_backward()
    assert unit.finished_backward and not unit.enter_backward()  # nothing to gather once reduced
    with pytest.raises(RuntimeError, match="second gradient after its unit was reduced"):
        unit.add_grad(0, torch.ones(2, 3))
    unit.end_backward()
    assert unit.training_state is TrainingState.IDLE
    assert torch.equal(unit.grad_flat[:8], torch.ones(8))
