"""zeropp.costs.step_time: a pass over U units as a two-stage pipeline, and a step of three phases."""

import pytest

from zeropp.costs.step_time import pass_seconds, step_seconds


def test_a_pass_takes_the_longer_stage_and_one_unit_of_the_shorter():
    assert pass_seconds(1.0, 0.4, units=4) == pytest.approx(1.1)
    assert pass_seconds(0.4, 1.0, units=4) == pytest.approx(1.1)
    assert pass_seconds(1.0, 0.4, units=0) == pytest.approx(1.4)  # nothing gathered per use: no overlap


def test_a_step_splits_its_compute_one_to_two_and_adds_the_steps_collectives():
    step = step_seconds(0.3, {"forward": 0.05, "backward": 0.4, "step": 0.01}, units=5)
    assert step.forward_s == pytest.approx(0.1 + 0.05 / 5)
    assert step.backward_s == pytest.approx(0.4 + 0.2 / 5)
    assert step.total_s == pytest.approx(0.11 + 0.44 + 0.01)
