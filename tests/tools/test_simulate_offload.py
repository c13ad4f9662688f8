"""zeropp simulate and zeropp plan with ZeRO-Offload (offload_optimizer = "cpu"): the step's PCIe and host
terms against their closed forms, the memory per GPU against zeropp.costs.memory, the planner offloading
only where a configuration needs it to fit, the host step inside backward (step_in_backward) against its
closed forms, and the one-line refusals (docs/simulate.md)."""

from __future__ import annotations

import json

import pytest

from zeropp.costs.memory import analytic_model_state_bytes
from zeropp.errors import ConfigError
from zeropp.tools.plan import Model, candidates, plan
from zeropp.tools.plan import main as plan_main
from zeropp.tools.simulate import GPUS, Assumptions, main, simulate
from zeropp.tools.simulate.offload import host_step_left_after_backward

pytestmark = pytest.mark.unit

OFFLOAD = {"offload_optimizer": "cpu"}
IN_BACKWARD = {**OFFLOAD, "step_in_backward": True}
A = Assumptions()
H100_PCIE = 64e9 * A.pcie_efficiency  # bytes/s each way, achieved
H100_HOST = 2 * 8 * 38.4e9 * A.host_memory_efficiency / 8  # a DGX H100's host memory over its 8 GPUs
EIGHT_B = dict(n_layer=32, d_model=4096)


def _sim(zero=None, gpu="h100", gpus=64, params=8 * 10**9, variant="zero3", **kw):
    return simulate(gpu, gpus, GPUS[gpu].ranks_per_node, 400e9, params, 4096, variant, zero=zero, **{**EIGHT_B, **kw})


def test_stage3_step_is_the_closed_form():
    """Gradients to the host in fp32 (4 S bytes), then the host's AdamW (28 S bytes of host memory) pipelined
    unit by unit with the fp32 shards back (4 S): 4S/β + max(28S/h, 4S/β) + min(28S/h, 4S/β)/U."""
    base, sim = _sim(), _sim(OFFLOAD)
    shard, units = sim.estimate.shard_numel, sim.units
    o = sim.offload
    assert (o.to_host_bytes, o.to_device_bytes, o.host_bytes) == (4 * shard, 4 * shard, 28 * shard)
    assert o.to_host_s == pytest.approx(4 * shard / H100_PCIE)
    assert o.host_s == pytest.approx(28 * shard / H100_HOST)
    host_s, back_s = 28 * shard / H100_HOST, 4 * shard / H100_PCIE
    expected = 4 * shard / H100_PCIE + max(host_s, back_s) + min(host_s, back_s) / units
    assert sim.optimizer_s == o.seconds == pytest.approx(expected)
    # after backward: the passes are the same, the step longer by the offload's time less the GPU's Adam
    assert sim.passes_s == base.passes_s and sim.comm_s == base.comm_s
    assert sim.step_s - base.step_s == pytest.approx(o.seconds - base.optimizer_s)
    assert base.offload is None and base.optimizer_s < o.seconds


def test_whole_units_are_converted_on_the_host_and_sent_blocking():
    """Stages 1-2: each unit's master converted on the host (6 bytes more) and sent in bf16 (2 S), step and
    copy adding up."""
    sim = _sim({"stage": 2, **OFFLOAD})
    shard, o = sim.estimate.shard_numel, sim.offload
    assert (o.to_device_bytes, o.host_bytes) == (2 * shard, 34 * shard)
    assert o.seconds == pytest.approx(4 * shard / H100_PCIE + 34 * shard / H100_HOST + 2 * shard / H100_PCIE)


def test_clipping_and_fp16s_loss_scale_add_host_passes_and_the_flags_override_the_rates():
    v100 = _sim({"max_grad_norm": 1.0, **OFFLOAD}, gpu="v100")  # fp16: unscaled, then clipped: 8 + 8 bytes
    assert v100.offload.host_bytes == 44 * v100.estimate.shard_numel
    slow = _sim(OFFLOAD, pcie_bits_per_s=8 * 32e9, host_bits_per_s=8 * 307.2e9)  # half the H100's rates
    fast = _sim(OFFLOAD)
    assert slow.offload.to_host_s == pytest.approx(2 * fast.offload.to_host_s)
    assert slow.offload.host_s == pytest.approx(2 * fast.offload.host_s)


@pytest.mark.parametrize(("unit_s", "backward_s", "left"), [([1.0] * 4, 8.0, 1.0), ([3.0] * 4, 4.0, 9.0)])
def test_the_host_step_inside_backward_is_the_closed_form(unit_s, backward_s, left):
    """L equal units of s seconds landing at k B / L, one worker: max(s, L s + B/L - B) left after backward."""
    s, units = unit_s[0], len(unit_s)
    assert left == max(s, units * s + backward_s / units - backward_s)
    assert host_step_left_after_backward(unit_s, backward_s) == left


@pytest.mark.parametrize("stage", [2, 3])
def test_a_host_step_shorter_than_backward_leaves_one_units_step_and_the_parameters_back(stage):
    """8B on 64 H100s: each unit's copy and host step (s) is done before the next unit lands (s <= B/L), so
    after backward the GPU waits for the last unit's (s) and every unit's parameters back (stage 3: 4S/β;
    stages 1-2: converted on the host, 6S/h, and 2S/β); the passes unchanged."""
    after, sim = _sim({"stage": stage, **OFFLOAD}), _sim({"stage": stage, **IN_BACKWARD})
    o, units, backward = sim.offload, sim.units, sim.passes_s["backward"]
    assert len(set(sim.estimate.unit_shard_numels)) == 1  # equal units: the closed form holds exactly
    shard = sim.estimate.shard_numel
    s = shard * (4 / H100_PCIE + 28 / H100_HOST) / units
    cast_s = 6 * shard / H100_HOST if stage < 3 else 0.0
    assert s <= backward / units and o.in_backward and not after.offload.in_backward
    assert sim.optimizer_s == o.seconds == pytest.approx(s + o.to_device_s + cast_s)
    assert sim.passes_s == after.passes_s and sim.step_s - after.step_s == pytest.approx(o.seconds - after.optimizer_s)
    assert sim.step_s < after.step_s


def test_a_host_step_longer_than_backward_leaves_its_excess():
    """A host step far longer than backward (1 GB/s of host memory a node): the worker never waits after the first
    unit lands (B/L), so what is left is the host's total less backward plus that arrival, then the shards back."""
    sim = _sim(IN_BACKWARD, host_bits_per_s=8e9)
    o, units, backward = sim.offload, sim.units, sim.passes_s["backward"]
    assert o.to_host_s + o.host_s > 10 * backward
    expected = o.to_host_s + o.host_s - backward + backward / units + o.to_device_s
    assert o.seconds == pytest.approx(expected)


@pytest.mark.parametrize("stage", [2, 3])
def test_with_clipping_the_step_waits_for_backward(stage):
    """max_grad_norm: the norm needs every gradient, so the step runs after backward, as without the switch."""
    clipped = {"stage": stage, "max_grad_norm": 1.0}
    sim, after = _sim({**IN_BACKWARD, **clipped}), _sim({**OFFLOAD, **clipped})
    assert not sim.offload.in_backward and sim.offload == after.offload and sim.step_s == after.step_s


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_memory_is_zeropp_costs_memorys(stage):
    """Device: the analytic model states with offload_optimizer (stage 3: 4Ψ/N in bf16); host: its host
    bytes (12Ψ/N) plus the step's fp32 gradient copies (4Ψ/N)."""
    psi, gpus = 8 * 10**9, 64
    sim = _sim({"stage": stage, **OFFLOAD})
    device = analytic_model_state_bytes(psi, gpus, stage, "bf16", offload_optimizer=True, where="device")
    host = analytic_model_state_bytes(psi, gpus, stage, "bf16", offload_optimizer=True, where="host")
    assert sim.memory["model_states"] == pytest.approx(device, rel=1e-3)
    assert sim.host_memory_bytes == pytest.approx(host + 4 * psi / gpus, rel=1e-3)
    assert sim.memory["model_states"] < _sim({"stage": stage}).memory["model_states"]


def test_the_hosts_memory_bounds_an_offloaded_run():
    """130B on one DGX H200: 4Ψ/8 fits each GPU, but the node's 16Ψ of host states exceed its 2 TB."""
    sim = _sim(OFFLOAD, gpu="h200", gpus=8, params=130 * 10**9, n_layer=96, d_model=10240)
    assert sim.memory_bytes <= sim.memory_capacity and not sim.fits
    assert sim.host_memory_bytes * 8 > GPUS["h200"].host_memory_bytes


def test_the_planner_offloads_only_what_does_not_fit_without():
    """8B on 64 H100s fits without offload: no configuration is offloaded. 70B on one node of 8 fits only
    with it: every ranked configuration is offloaded, each slower than it would be without (and not fit)."""
    ranked, dropped = plan("h100", 64, 8, 400e9, Model("8B", 8 * 10**9, 32, 4096), tokens_per_gpu=4096)
    assert ranked and not any(p.candidate.offloaded for p in ranked + dropped)
    seventy = Model("70B", 70 * 10**9, 80, 8192)
    ranked, dropped = plan("h100", 8, 8, 400e9, seventy, tokens_per_gpu=4096)
    assert len(ranked) + len(dropped) == len(candidates(1, 8, (1,), (False, True), (1, 2, 4, 8)))
    assert ranked and all(p.candidate.offloaded and p.candidate.name.endswith(" + offload") for p in ranked)
    for p in ranked[:3]:
        c = p.candidate
        without = {k: v for k, v in c.zero.items() if k != "offload_optimizer"}
        sim = simulate("h100", 8, 8, 400e9, seventy.params, 4096, c.variant, n_layer=80, d_model=8192,
                       activation_checkpointing=c.activation_checkpointing, zero=without,
                       tensor_parallel=c.tensor_parallel, sequence_parallel=c.sequence_parallel)  # fmt: skip
        assert not sim.fits and sim.step_s < p.simulation.step_s
        assert "--offload-optimizer" in c.flags("bf16")
    assert all("with offload: " in p.dropped for p in dropped if p.candidate.variant != "ddp")


def test_cli_prints_and_json_the_offload(capsys):
    argv = ["--gpu", "h100", "--gpus", "8", "--inter-node-bandwidth", "400gbit", "--params", "70e9",
            "--n-layer", "80", "--d-model", "8192", "--tokens-per-gpu", "4096", "--variant", "zero3"]  # fmt: skip
    assert main([*argv, "--offload-optimizer", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "offload (after backward, not overlapping it)" in out and "host memory per node" in out
    assert main([*argv, "--offload-optimizer", "cpu", "--pcie-bandwidth", "32GB/s", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["fits"] and result["offload"]["to_host_s"] == pytest.approx(
        result["offload"]["to_host_bytes"] / (32e9 * A.pcie_efficiency)
    )
    assert main([*argv, "--offload-optimizer", "cpu", "--step-in-backward", "--json"]) == 0
    inside = json.loads(capsys.readouterr().out)
    assert inside["offload"]["in_backward"] and inside["zero"]["step_in_backward"]
    assert plan_main([*argv[:6], "--params", "70e9", "--n-layer", "80", "--d-model", "8192",
                      "--tokens-per-gpu", "4096"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "| 1 | ZeRO-3" in out and "+ offload |" in out and "--offload-optimizer cpu" in out


@pytest.mark.parametrize(
    ("gpu", "extra", "says"),
    [
        ("h100", ["--offload-optimizer", "nvme"], "argument --offload-optimizer: invalid choice: 'nvme'"),
        ("h100", ["--offload-optimizer", "cpu", "--pcie-bandwidth", "fast"], "argument --pcie-bandwidth"),
        ("h100", ["--host-memory-bandwidth", "0GB/s"], "argument --host-memory-bandwidth"),
        ("cpu-gloo", ["--offload-optimizer", "cpu"], "its ranks are the host already"),
        ("h100", ["--step-in-backward"], "(--step-in-backward) without offload_optimizer 'cpu' is not modelled"),
        ("v100", ["--offload-optimizer", "cpu", "--step-in-backward"], "expected false with zero.precision = 'fp16'"),
    ],
)
def test_bad_offload_input_is_refused_in_one_line(capsys, gpu, extra, says):
    argv = ["--gpu", gpu, "--gpus", "4", "--gpus-per-node", "2", "--inter-node-bandwidth", "1gbit",
            "--params", "1e8", "--tokens-per-gpu", "128", "--variant", "zero3"]  # fmt: skip
    assert main([*argv, *extra]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith("zeropp simulate: error: ") and says in captured.err


def test_offloads_it_does_not_model_are_refused():
    for zero in ({"offload_optimizer": "nvme"}, {"offload_params": "cpu", **OFFLOAD}):
        with pytest.raises(ConfigError, match="is not modelled; expected offload_optimizer 'none' or 'cpu'"):
            _sim(zero)
    with pytest.raises(ConfigError, match="expected it with --offload-optimizer cpu"):
        _sim({"step_in_backward": True})
