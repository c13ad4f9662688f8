"""The main job end to end: `zeropp train` launches ranks through torchrun and writes its summary."""

from __future__ import annotations

import json
import subprocess
import sys

from launcher import free_port

SUMMARY_KEYS = {
    "final_train_loss",
    "final_val_loss",
    "tokens_per_s",
    "world_size",
    "nodes",
    "param_count",
    "model_state_bytes_per_rank",
    "analytic_model_state_bytes_per_rank",
    "peak_memory_bytes_per_rank",
    "intra_node_bytes_per_step",
    "inter_node_bytes_per_step",
    "ledger",
}


def zeropp(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zeropp.cli", *args], capture_output=True, text=True, timeout=300)


def test_train_runs_four_ranks_as_two_nodes_and_writes_summary(tmp_path):
    out = tmp_path / "summary.json"
    result = zeropp(
        "train", "--preset", "tiny", "--steps", "4", "--eval-batches", "1", "--stage", "3",
        "--master-port", str(free_port()), "--summary-json", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert SUMMARY_KEYS <= summary.keys()
    assert (summary["world_size"], summary["nodes"], summary["steps"]) == (4, 2, 4)
    assert len(summary["model_state_bytes_per_rank"]) == 4
    measured, analytic = summary["model_state_bytes_per_rank"][0], summary["analytic_model_state_bytes_per_rank"]
    padding = 3 * (4 * 32) * 16  # 3 units (2 blocks + root), each padded by < world x alignment, 16 B/element
    assert abs(measured - analytic) <= 0.05 * analytic + padding
    # stage 3 sends 3 x the fp32 parameter bytes x (N-1)/N per rank per step; half of it crosses nodes (ring)
    sent = summary["intra_node_bytes_per_step"] + summary["inter_node_bytes_per_step"]
    assert sent >= 3 * 4 * summary["param_count"] * 3 / 4
    assert summary["inter_node_bytes_per_step"] == summary["intra_node_bytes_per_step"]
    assert set(summary["ledger"]["all_gather"]) == {"forward", "backward"}
    assert "summary" in result.stdout and "ledger" in result.stdout


def test_bad_flag_value_is_one_line_error_before_launch():
    result = zeropp("train", "--stage", "5")
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == ["zeropp: error: zero.stage = 5 is not allowed; expected one of 0, 1, 2, 3"]


def test_nodes_must_divide_world_before_launch():
    result = zeropp("train", "--nodes", "3", "--nproc-per-node", "4")
    assert result.returncode == 2
    assert "topology.nodes = 3 does not divide world size 4" in result.stderr
