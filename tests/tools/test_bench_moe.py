"""zeropp bench moe: one tiny run writes its results, the all-gather bytes zeropp estimate's."""

from __future__ import annotations

import json

from cli_runner import run_cli


def test_a_tiny_run_writes_its_results_and_the_estimate_prices_its_gathers(tmp_path):
    out = tmp_path / "bench_moe.json"
    command = ["bench", "moe", "--preset", "tiny", "--world", "2", "--ep", "1", "2", "--steps", "2", "--rounds", "1"]
    done = run_cli(*command, "--micro-batch-size", "2", "--out", str(out), timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["variants"]
    assert set(rows) == {"1", "2"} and rows["1"]["ratios_to_e1"] == [1.0]
    for row in rows.values():
        assert sum(row["all_gather_bytes"].values()) == row["predicted_all_gather_bytes"]
    assert sum(rows["1"]["all_to_all_bytes"].values()) == 0 == rows["1"]["predicted_all_to_all_bytes"]
    assert sum(rows["2"]["all_to_all_bytes"].values()) > 0
