"""The main job end to end: `zeropp train` launches ranks through torchrun and writes its summary."""

from __future__ import annotations

import json

import pytest
from cli_runner import run_cli
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


def test_train_runs_four_ranks_as_two_nodes_with_zeropp_and_writes_summary(tmp_path):
    out = tmp_path / "summary.json"
    result = run_cli(
        "train", "--preset", "tiny", "--steps", "4", "--eval-batches", "1",
        "--master-port", str(free_port()), "--summary-json", str(out),
    )  # fmt: skip
    # nothing on stderr: the ranks, forked from the launcher's server, exit without gloo's abort too
    assert result.returncode == 0 and result.stderr == "", result.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert SUMMARY_KEYS <= summary.keys()
    assert (summary["world_size"], summary["nodes"], summary["steps"], summary["stage"]) == (4, 2, 4, 3)
    # ZeRO++ is on by default at stage 3: qwZ, hpZ over each node's 2 ranks, qgZ
    assert summary["zeropp"] == {"quantized_weights": True, "hpz_group_size": 2, "quantized_gradients": True}
    assert len(summary["model_state_bytes_per_rank"]) == 4
    measured, analytic = summary["model_state_bytes_per_rank"][0], summary["analytic_model_state_bytes_per_rank"]
    padding = 3 * (4 * 32) * 18  # 3 units (2 blocks + root), each padded by < world x alignment, 16+2 B/element
    assert abs(measured - analytic) <= 0.05 * analytic + padding
    ledger = summary["ledger"]
    assert ledger["all_gather"]["backward"]["inter"] == 0 < ledger["all_gather"]["backward"]["intra"]
    assert ledger["all_to_all"]["backward"]["inter"] > 0 and "reduce_scatter" not in ledger
    # fp32 run: int8 weights (1/4) forward, nothing backward, int4 gradients (1/8 per hop)
    assert 0 < summary["inter_node_bytes_per_step"] <= 0.25 * summary["zero3_inter_node_bytes_per_step"]
    assert "summary" in result.stdout and "ZeRO-3" in result.stdout
    # not a terminal: progress lines; the last shows the summary's validation loss
    progress = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert progress[-1].startswith("step 4/4") and f"val {summary['final_val_loss']:.4f}" in progress[-1]


def test_train_with_error_feedback_two_level_qgz_and_the_schedule_counts_residuals_frees_them_and_switches(tmp_path):
    from zeropp.config.model import ModelConfig
    from zeropp.costs.memory import qgz_residual_bytes
    from zeropp.index.flat import FlatLayout
    from zeropp.tools.estimate import gpt_unit_numels

    tiny = ModelConfig(preset="tiny")

    out = tmp_path / "summary.json"
    result = run_cli(
        "train", "--preset", "tiny", "--steps", "4", "--eval-batches", "1", "--eval-interval", "2",
        "--gradient-error-feedback", "loco", "--err-beta", "0.5", "--gradient-intra-node-bits", "8",
        "--gradient-hadamard", "--quantized-gradients-until", "0.5",
        "--master-port", str(free_port()), "--summary-json", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(out.read_text())
    # fp32 residuals: the whole unit for hop 1, half of it (2 ranks per node) for hop 2, over the units'
    # padded buffers (qwZ is on: each parameter starts on a block of 256)
    residuals = summary["qgz_residual_bytes_per_rank"]
    padded = sum(FlatLayout(tuple((n,) for n in unit), 4, 32, 256).padded_numel for unit in gpt_unit_numels(tiny))
    assert residuals == qgz_residual_bytes(padded, 2, 2), (residuals, padded)
    # qgZ for steps 1-2, the full-precision reduce-scatter for steps 3-4: the residuals are freed from
    # step 3, so the last step's model-state bytes (measured and analytic) hold none; kept, they would
    # add 6Ψ to the 6Ψ measured (fp32 ZeRO-3's 4Ψ + hpZ's 2Ψ)
    assert summary["qgz_residuals_freed_at_step"] == 3
    measured, analytic = summary["model_state_bytes_per_rank"][0], summary["analytic_model_state_bytes_per_rank"]
    assert abs(measured - analytic) <= 0.05 * analytic + 3 * (4 * 32) * 24
    assert analytic < residuals * 1.5
    backward = summary["ledger"]
    assert backward["all_to_all"]["backward"]["inter"] > 0 and backward["reduce_scatter"]["backward"]["inter"] > 0
    assert summary["val_losses"] == [[2, summary["val_losses"][0][1]], [4, summary["final_val_loss"]]]


def test_the_disk_tiers_model_states_are_what_stays_in_memory_and_their_bytes_are_reported(tmp_path):
    """The summary's formula counts what a rank holds in memory, as the measurement does: with the optimizer's
    disk tier the bf16 compute shard (2Ψ/N) alone at stage 3, with the parameters' too nothing between steps."""
    for tiers, per_element in ((["--offload-optimizer", "nvme"], 2), (["--offload-params", "nvme"], 0)):
        out = tmp_path / "summary.json"
        result = run_cli(
            "train", "--preset", "tiny", "--steps", "2", "--eval-batches", "1", "--nproc-per-node", "2",
            "--nodes", "1", "--precision", "bf16", "--offload-optimizer", "nvme", *tiers, "--offload-path",
            str(tmp_path), "--master-port", str(free_port()), "--summary-json", str(out),
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        summary = json.loads(out.read_text())
        measured, analytic = summary["model_state_bytes_per_rank"], summary["analytic_model_state_bytes_per_rank"]
        assert measured == [analytic] * 2  # the shards as laid out: the parameters plus the units' padding
        assert analytic == pytest.approx(per_element * summary["param_count"] / 2, rel=0.05)
        assert all(read > 0 and written > 0 for read, written in summary["disk_bytes_per_step_per_rank"])
        assert "the disk tiers' files aside" in result.stdout and "disk tiers per step" in result.stdout


def test_deepspeed_flag_names_and_zeropp_opt_out_parse():
    from zeropp.cli import build_parser

    args = vars(build_parser().parse_args([
        "train", "--zero-quantized-weights", "--zero-hpz-partition-size", "4", "--no-zero-quantized-gradients",
        "--weight-bits", "4", "--gradient-bits", "8",
    ]))  # fmt: skip
    assert args["zero.quantized_weights"] is True and args["zero.quantized_gradients"] is False
    assert (args["zero.hpz_partition_size"], args["zero.weight_bits"], args["zero.gradient_bits"]) == (4, 4, 8)


def test_bad_flag_value_is_one_line_error_before_launch():
    result = run_cli("train", "--stage", "5")
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == ["zeropp: error: zero.stage = 5 is not allowed; expected one of 0, 1, 2, 3"]


def test_nodes_must_divide_world_before_launch():
    result = run_cli("train", "--nodes", "3", "--nproc-per-node", "4")
    assert result.returncode == 2
    assert "topology.nodes = 3 does not divide world size 4" in result.stderr


def test_hpz_partition_that_does_not_fit_the_world_is_refused_before_launch():
    result = run_cli("train", "--nproc-per-node", "4", "--hpz-partition-size", "3")
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("zeropp: error: zero.hpz_partition_size = 3 is not allowed")


def test_train_with_muon_steps_whole_parameters_and_the_ledger_names_the_exchange(tmp_path):
    out = tmp_path / "summary.json"
    result = run_cli(
        "train", "--preset", "tiny", "--steps", "4", "--eval-batches", "1", "--optimizer", "muon",
        "--nproc-per-node", "2", "--master-port", str(free_port()), "--summary-json", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(out.read_text())
    ledger = summary["ledger"]
    for op in ("to_owners", "from_owners"):  # every rank sends its pieces of the others' parameters, both ways
        assert sum(ledger[op]["step"].values()) > 0, ledger.get(op)
    assert summary["final_train_loss"] < 6 and "to_owners" in result.stdout
