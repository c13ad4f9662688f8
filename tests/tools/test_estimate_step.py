"""The estimator's step beside the model states: the transient bytes of a stage-3 step, and its time with
the communication overlapped (zeropp.costs.step_time)."""

import json

import pytest

from zeropp.config.model import ModelConfig
from zeropp.config.sections import ZeroConfig
from zeropp.tools.estimate import estimate, gpt_unit_numels, main


def test_stage3_transient_bytes_by_hand():
    """Beside the model states, stage 3 holds 1 + prefetch gathered units in the compute dtype and, on more
    than one rank, three whole gradients in the gradient dtype: the unit in backward, two reductions in flight."""
    bf16 = estimate(2**20, 4, 1, ZeroConfig(stage=3, precision="bf16", prefetch=2))
    assert bf16.transient_bytes() == {"units_gathered": 3 * 2 * 2**20, "gradients_in_reduction": 3 * 2 * 2**20}
    fp32_grads = estimate(2**20, 4, 1, ZeroConfig(stage=3, precision="bf16", grad_dtype="fp32"))
    assert fp32_grads.transient_bytes() == {"units_gathered": 2 * 2 * 2**20, "gradients_in_reduction": 3 * 4 * 2**20}
    # a LoRA base: the frozen weights are gathered, but have no gradient (a quarter of 2^20 is trainable)
    lora = estimate(2**20, 4, 1, ZeroConfig(stage=3, precision="bf16"), frozen_fraction=0.75)
    assert lora.transient_bytes() == {"units_gathered": 2 * 2 * 2**20, "gradients_in_reduction": 3 * 2 * 2**18}
    # nothing is gathered per use on one rank or below stage 3
    assert estimate(2**20, 1, 1, ZeroConfig(stage=3)).transient_bytes() is None
    assert estimate(2**20, 4, 1, ZeroConfig(stage=2)).transient_bytes() is None


def test_step_time_overlaps_each_pass_over_the_gathered_units():
    """ZeRO-3 on 2 nodes x 2, Ψ = 2^20 in one unit: 4Ψ(W-1)/W = 3 MiB leave a node per ring collective
    (a forward gather; a backward gather and reduce-scatter), gloo sending the reduce-scatter twice."""
    est = estimate(2**20, 4, 2, ZeroConfig(stage=3))
    ring = 4 * 2**20 * 3 / 4
    nccl, gloo = est.phase_bytes("nccl"), est.phase_bytes("gloo")
    assert (nccl["forward"]["inter"], nccl["backward"]["inter"]) == (ring, 2 * ring)
    assert gloo["backward"]["inter"] == 3 * ring and gloo["forward"] == nccl["forward"]
    assert est.gathered_units == 1
    inter = 8 * ring  # bits per second: one second per ring collective on the wire
    step = est.step_time(0.6, float("inf"), inter, backend="gloo")
    # one unit: nothing overlaps (max + min / 1); forward 0.2 s of compute, backward 0.4 s
    assert step.forward_s == pytest.approx(0.2 + 1.0)
    assert step.backward_s == pytest.approx(0.4 + 3.0)
    gpt = estimate(gpt_unit_numels(ModelConfig(preset="small")), 4, 2, ZeroConfig(stage=3))
    assert gpt.gathered_units == 5  # four blocks and the embedding: a pass hides all but a fifth of its shorter stage
    forward = gpt.comm_seconds_by_phase(float("inf"), 200e6)["forward"]
    assert gpt.step_time(0.3, float("inf"), 200e6).forward_s == pytest.approx(max(0.1, forward) + min(0.1, forward) / 5)


def test_cli_predicts_the_step_from_a_given_compute(capsys, tmp_path):
    out = tmp_path / "estimate.json"
    argv = ["--preset", "small", "--world", "4", "--nodes", "2", "--stage", "3", "--quantized-gradients",
            "--inter-node-bandwidth", "200mbit", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert json.loads(out.read_text())["predicted_step_seconds"] is None  # no compute given
    assert main([*argv, "--compute-seconds", "0.25", "--backend", "gloo"]) == 0
    assert "predicted step" in capsys.readouterr().out
    step = json.loads(out.read_text())["predicted_step_seconds"]
    est = estimate(gpt_unit_numels(ModelConfig(preset="small")), 4, 2, ZeroConfig(stage=3, quantized_gradients=True))
    assert step["total_s"] == pytest.approx(est.step_time(0.25, 100e9, 200e6, "gloo").total_s)
    assert step["total_s"] == pytest.approx(step["forward_s"] + step["backward_s"] + step["step_comm_s"])


def test_the_backend_defaults_to_the_configs(tmp_path):
    config = tmp_path / "gloo.toml"
    config.write_text('[topology]\nbackend = "gloo"\n')
    out = tmp_path / "estimate.json"
    argv = ["--config", str(config), "--world", "4", "--nodes", "2", "--compute-seconds", "0.1", "--json", str(out)]
    assert main(argv) == 0
    assert json.loads(out.read_text())["backend"] == "gloo"
    assert main([*argv, "--backend", "nccl"]) == 0
    assert json.loads(out.read_text())["backend"] == "nccl"
