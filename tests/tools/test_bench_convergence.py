"""zeropp bench convergence: paired gaps over seeds, the report, --resume, and the fixed-batch weight error."""

from __future__ import annotations

import argparse
import json
import statistics

import pytest
import torch

from zeropp.app.data.batches import Batches
from zeropp.tools.bench.quality import convergence, weight_error


def _run(losses: list[float], inter: float = 100.0) -> dict:
    return {"val_losses": [[50 * (i + 1), v] for i, v in enumerate(losses)], "inter_node_bytes_per_step": inter}


def _args(tmp_path, **changes) -> argparse.Namespace:
    values = dict(
        seeds=[1, 2], steps=150, preset="tiny", precision="bf16", lr=1e-3, warmup_steps=50, micro_batch_size=4,
        eval_interval=50, eval_batches=8, train_flags=[], weight_steps=10, out=tmp_path,
    )  # fmt: skip
    return argparse.Namespace(**(values | changes))


RUNS = {
    "ZeRO-3": {1: _run([3.0, 2.5, 2.0]), 2: _run([3.2, 2.4, 2.2])},
    "ZeRO++": {1: _run([3.0, 2.5 * 1.01, 2.0 * 1.01], 22.0), 2: _run([3.2, 2.4 * 1.03, 2.2 * 0.99], 22.0)},
}


def test_gaps_are_paired_per_seed_and_reported_after_warm_up(tmp_path):
    rows = convergence.curves(RUNS)["ZeRO++"]
    assert rows["steps"] == [50, 100, 150]
    assert rows["gap_mean"][1] == pytest.approx(0.02) and rows["gap_std"][1] == pytest.approx(0.02**0.5 / 10)
    assert rows["gap_mean"][2] == pytest.approx(0.0, abs=1e-12) and rows["gap_std"][2] == pytest.approx(0.02**0.5 / 10)
    assert rows["mean"][2] == pytest.approx((2.02 + 2.178) / 2)
    report = convergence.markdown(_args(tmp_path), RUNS, {"ZeRO-3": 0.0, "ZeRO++": 0.25})
    gaps = report.split("after warm-up:")[1]
    assert "step 50" not in gaps.split("\n\n")[1]  # warm-up (50 steps) left out of the gap table
    assert "+2.00% ± 1.41%" in gaps and "+2.00% ± 1.41% (step 100)" in report  # the largest mean gap
    assert "| ZeRO++ | +2.00% ± 1.41% (step 100) | 0.000 MiB | 0.220x | 0.250 |" in report
    assert f"std / mean = {statistics.stdev([2.0, 2.2]) / 2.1:.2%}" in report  # ZeRO-3's seeds at the end


def test_resume_keeps_the_runs_of_the_same_recipe_only(tmp_path, capsys):
    args = _args(tmp_path)
    saved = {"args": convergence._jsonable(args), "runs": json.loads(json.dumps(RUNS))}
    (tmp_path / "results.json").write_text(json.dumps(saved))
    kept = convergence._finished_runs(args)
    assert kept["ZeRO++"][2]["val_losses"] == RUNS["ZeRO++"][2]["val_losses"]
    assert convergence._finished_runs(_args(tmp_path, lr=2e-3)) == {}
    assert "another lr" in capsys.readouterr().out


def test_one_batch_gives_step_zeros_batch_at_every_step():
    batches = Batches("train", 16, 2, 2, 1, seed=5)
    fixed = weight_error.OneBatch(batches)
    x0, y0 = batches.local_batch(0)
    for step in (0, 3, 9):
        x, y = fixed.local_batch(step)
        assert torch.equal(x, x0) and torch.equal(y, y0)
    assert not torch.equal(batches.local_batch(3)[0], x0)


def test_relative_error_is_the_distance_to_the_exact_run_over_its_whole_update():
    initial = {"a": torch.zeros(2), "b": torch.zeros(1)}
    weights = {
        "exact": {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([4.0])},
        "other": {"a": torch.tensor([3.0, 1.0]), "b": torch.tensor([4.0])},
    }
    assert weight_error.relative_errors(weights, initial, "exact") == {"exact": 0.0, "other": pytest.approx(0.2)}


@pytest.mark.distributed  # the benchmark launches its ranks with torchrun
def test_fixed_batch_weight_error_is_zero_for_the_exact_run_and_grows_with_quantization():
    """4 ranks as 2 nodes x 2, 3 steps on one batch: ZeRO-3 against itself is 0; ZeRO++ (int8 weights,
    int4 gradients) moves the weights; its two-level qgZ (int8 inside a node) moves them less."""
    configs = {name: convergence.CONFIGS[name] for name in ("ZeRO-3", "ZeRO++", "ZeRO++ two-level + Hadamard")}
    base = weight_error.base_config("tiny", "fp32", 1e-3, 3, seed=1, micro_batch=2)
    errors = weight_error.measure({"base": base, "configs": configs, "exact": "ZeRO-3"})
    assert errors["ZeRO-3"] == 0.0
    assert 0.005 < errors["ZeRO++"] < 1.0
    assert 0 < errors["ZeRO++ two-level + Hadamard"] < errors["ZeRO++"]
