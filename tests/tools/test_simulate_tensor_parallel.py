"""zeropp simulate and zeropp plan with tensor parallelism: the tensor-parallel collectives against their
closed forms and on the critical path, ZeRO over the data-parallel group, compute and memory per GPU at
T against T = 1, the one-line refusals, and the planner choosing T where only it fits and not where it
only costs (docs/simulate.md)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from zeropp.costs.collectives import Group, ring_seconds
from zeropp.costs.memory import analytic_model_state_bytes
from zeropp.costs.tensor_parallel import megatron_bytes_per_block
from zeropp.tools.estimate.gpt import gpt_norm_parameters
from zeropp.tools.plan import Model, plan
from zeropp.tools.plan import main as plan_main
from zeropp.tools.plan.model import tensor_parallel_sizes
from zeropp.tools.simulate import GPUS, Assumptions, main, simulate
from zeropp.tools.simulate.model import fabric_for
from zeropp.tools.simulate.papers import tensor_parallel_table
from zeropp.tools.simulate.tensor_parallel import REPLICATED_ACTIVATION_BYTES, SPLIT_ACTIVATION_BYTES

pytestmark = pytest.mark.unit

PSI, LAYERS, WIDTH, TOKENS = 70_550_000_000, 80, 8192, 4096  # Llama-3-70B's shape, 4096 tokens per GPU
SHAPE = {"n_layer": LAYERS, "d_model": WIDTH}
H100_64 = ("h100", 64, 8, 400e9)


def run(tp: int, variant: str = "zero3", tokens: int = TOKENS, **kwargs):
    return simulate(*H100_64, PSI, tokens, variant, **SHAPE, tensor_parallel=tp, **kwargs)


def nvlink_ring(op: str, buffer_bytes: float, tp: int) -> float:
    """A ring over `tp` GPUs of a node, the closed form: p (T-1)/T B / β + p (T-1) α (p: 2 for an all-reduce)."""
    a, passes = Assumptions(), 2 if op == "all_reduce" else 1
    beta = GPUS["h100"].nvlink_bits_per_s * a.nvlink_efficiency / 8
    return passes * (tp - 1) / tp * buffer_bytes / beta + passes * (tp - 1) * a.intra_latency_s


# -- the tensor-parallel collectives ------------------------------------------------------------------


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("checkpointing", [True, False])
def test_megatron_all_reduces_are_the_closed_form(tp, checkpointing):
    """Per block and micro-batch (the group's T x tokens): 2 all-reduces of b s h in forward, 2 in backward
    and, with checkpointing, the 1 forward all-reduce zeropp's recomputation repeats; the bytes are
    costs.tensor_parallel's."""
    sim = run(tp, activation_checkpointing=checkpointing)
    buffer = tp * TOKENS * WIDTH * 2  # bf16
    all_reduce = nvlink_ring("all_reduce", buffer, tp)
    assert sim.tensor_parallel_s["forward"] == pytest.approx(LAYERS * 2 * all_reduce)
    assert sim.tensor_parallel_s["backward"] == pytest.approx(LAYERS * (3 if checkpointing else 2) * all_reduce)
    sent = sum(t.sent for t in sim.estimate.transfers if t.op.startswith("tp."))
    per_block = megatron_bytes_per_block(1, tp * TOKENS, WIDTH, tp, 2, recomputed=1 if checkpointing else 0)
    assert sent == LAYERS * per_block


def test_sequence_parallel_gathers_and_scatters_are_the_closed_form():
    """Per block 4 all-gathers / reduce-scatters of b s h forward, their 4 mirrors and 3 recomputed backward,
    one all-gather at each end of the model, and the norms' partial gradients all-reduced (bf16)."""
    tp = 8
    sim = run(tp, sequence_parallel=True)
    gather = nvlink_ring("all_gather", tp * TOKENS * WIDTH * 2, tp)
    norms = nvlink_ring("all_reduce", gpt_norm_parameters(LAYERS) * WIDTH * 2, tp)
    assert sim.tensor_parallel_s["forward"] == pytest.approx((4 * LAYERS + 1) * gather)
    assert sim.tensor_parallel_s["backward"] == pytest.approx((7 * LAYERS + 1) * gather + norms)


def test_tensor_parallel_collectives_are_on_the_critical_path():
    """Nothing hides them: the step is the step without them plus their seconds, whatever the overlap."""
    for overlap in (0.0, 0.5, 1.0):
        sim = run(8, "zeropp", assumptions=dataclasses.replace(Assumptions(), overlap=overlap))
        without = dataclasses.replace(sim, tensor_parallel_s=dict.fromkeys(sim.tensor_parallel_s, 0.0))
        assert sim.step_s == pytest.approx(without.step_s + sum(sim.tensor_parallel_s.values()))
        assert sum(sim.tensor_parallel_s.values()) > 0


def test_zero_runs_over_the_data_parallel_group_with_a_tth_of_each_unit():
    """ZeRO-3 at T = 8 on 8 nodes: each unit's 1/8 gathered (forward) and gathered and reduce-scattered
    (backward) over the 8 data-parallel ranks, one a node, the node's 8 such rings sharing its NICs."""
    tp, nodes = 8, 8
    sim = run(tp)
    assert sum(u.numel for u in sim.estimate.units) == pytest.approx(PSI / tp, rel=1e-6)
    fabric = fabric_for(GPUS["h100"], 8, 400e9, None, Assumptions())
    group = Group(64 // tp, nodes)
    gather = sum(ring_seconds("all_gather", u.padded * 2, group, fabric) for u in sim.estimate.units)
    scatter = sum(ring_seconds("reduce_scatter", u.padded * 2, group, fabric) for u in sim.estimate.units)
    assert sim.comm_s["forward"] == pytest.approx(gather)
    assert sim.comm_s["backward"] == pytest.approx(gather + scatter)


# -- compute and memory -------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_compute_per_gpu_is_the_models_flops_over_every_gpu(tp):
    """A group trains T x the tokens per GPU on T GPUs: the same compute per GPU as without tensor
    parallelism; at the same tokens per group, 1/T of it."""
    one, split = run(1), run(tp)
    assert split.compute_s == pytest.approx(one.compute_s) and split.flops == one.flops
    same_group = run(tp, tokens=TOKENS // tp)
    assert sum(same_group.compute_s.values()) == pytest.approx(sum(one.compute_s.values()) / tp)


@pytest.mark.parametrize("tp", [2, 8])
def test_model_states_are_the_formula_on_a_tth_over_the_data_parallel_group(tp):
    """Table 1 on Ψ/T over N/T ranks: DDP's (stage 0) 16Ψ/T, a T-th of its states at T = 1; stage 3's
    16Ψ/N as at T = 1 (ZeRO shards over the data-parallel group what T did not split)."""
    for variant, zero, stage in (("ddp", None, 0), ("zero3", {"stage": 1}, 1), ("zero3", {"stage": 2}, 2),
                                 ("zero3", None, 3)):  # fmt: skip
        states = run(tp, variant, zero=zero).memory["model_states"]
        assert states == pytest.approx(analytic_model_state_bytes(PSI / tp, 64 // tp, stage, "bf16"), rel=1e-3)
    assert run(tp, "ddp").memory["model_states"] == pytest.approx(run(1, "ddp").memory["model_states"] / tp, rel=1e-6)
    assert run(tp).memory["model_states"] == pytest.approx(run(1).memory["model_states"], rel=1e-3)


@pytest.mark.parametrize("tp", [2, 8])
def test_activations_split_where_megatron_splits_them(tp):
    """At the same tokens per GPU the group holds T x them: without sequence parallelism every block
    input (checkpoint) is whole on each GPU and of a block's 34 bytes per token and unit of d_model only
    the 24 between the split layers are split; with it, all of them."""
    one, plain, sequence = run(1), run(tp), run(tp, sequence_parallel=True)
    assert plain.memory["activation_checkpoints"] == tp * one.memory["activation_checkpoints"]
    split = REPLICATED_ACTIVATION_BYTES * tp + SPLIT_ACTIVATION_BYTES
    assert plain.memory["activations"] == pytest.approx(one.memory["activations"] * split / 34)
    assert sequence.memory["activation_checkpoints"] == one.memory["activation_checkpoints"]
    assert sequence.memory["activations"] == pytest.approx(one.memory["activations"])
    assert plain.memory["stage3_transient"] == pytest.approx(one.memory["stage3_transient"] / tp, rel=1e-3)


# -- the command lines ----------------------------------------------------------------------------------

FLAGS = ["--gpu", "h100", "--gpus", "64", "--inter-node-bandwidth", "100gbit", "--params", "70.55e9"]
FLAGS += ["--n-layer", "80", "--d-model", "8192", "--tokens-per-gpu", "8192", "--variant", "zeropp"]


def test_cli_prints_and_reports_the_tensor_parallel_layout(capsys):
    assert main([*FLAGS, "--tensor-parallel-size", "8", "--sequence-parallel", "--n-head", "64"]) == 0
    out = capsys.readouterr().out
    assert "tensor parallelism: 8 GPUs a group, sequence parallelism, ZeRO over 8 data-parallel ranks" in out
    assert "tensor-parallel collectives (not overlapped)" in out
    assert main([*FLAGS, "--tensor-parallel-size", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["tensor_parallel_size"], result["data_parallel_size"], result["sequence_parallel"]) == (2, 32, False)
    assert result["tensor_parallel_seconds"]["forward"] > 0


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--tensor-parallel-size", "3"], "--tensor-parallel-size 3 does not divide --gpus-per-node 8"),
        (["--tensor-parallel-size", "16"], "--tensor-parallel-size 16 does not divide --gpus-per-node 8"),
        (
            ["--tensor-parallel-size", "8", "--n-head", "20"],
            "--tensor-parallel-size 8 does not divide the 20 attention",
        ),
        (["--sequence-parallel"], "--sequence-parallel needs --tensor-parallel-size > 1"),
    ],
)
def test_bad_tensor_parallel_input_is_refused_in_one_line(capsys, argv, says):
    assert main([*FLAGS, *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith("zeropp simulate: error: ") and says in captured.err


# -- the planner ------------------------------------------------------------------------------------------

LLAMA_70B = Model("70B", PSI, LAYERS, WIDTH, heads=64, kv_heads=8)


def test_the_planner_chooses_tensor_parallelism_where_only_it_fits():
    """131,072-token sequences of the 70B model on 64 H100s: at T = 1 a GPU holds the whole sequence's
    activation checkpoints (80 x 131072 x 8192 x 2 bytes, 172 GB), with or without offload; with T GPUs
    and sequence parallelism a T-th of them."""
    ranked, dropped = plan(*H100_64, LLAMA_70B, sequence=131072, micro_batches=(1,), checkpointing=(True,))
    assert ranked and all(p.candidate.tensor_parallel > 1 and p.candidate.sequence_parallel for p in ranked)
    at_one = [p for p in dropped if p.candidate.tensor_parallel == 1]
    assert at_one and all("GB per GPU of 80 GB" in p.dropped for p in at_one)
    first = ranked[0]
    assert first.tokens_per_gpu == 131072 // first.candidate.tensor_parallel
    flags = first.candidate.flags("bf16")
    assert flags[flags.index("--tensor-parallel-size") + 1] == str(first.candidate.tensor_parallel)
    assert "--sequence-parallel" in flags


def test_the_planner_leaves_tensor_parallelism_out_where_it_only_costs():
    """Llama-3-8B on 64 H100s at 400 Gbit/s a node, 4096-token sequences: everything fits at T = 1, and
    the fastest configuration there beats every tensor-parallel one (whose collectives add to the step)."""
    eight_b = Model("8B", 8_030_000_000, 32, 4096, heads=32, kv_heads=8)
    ranked, _ = plan(*H100_64, eight_b, sequence=4096, micro_batches=(1, 2), checkpointing=(True,))
    assert {p.candidate.tensor_parallel for p in ranked} == {1, 2, 4, 8}
    assert ranked[0].candidate.tensor_parallel == 1
    best_split = next(p for p in ranked if p.candidate.tensor_parallel > 1)
    assert best_split.tokens_per_s < 0.95 * ranked[0].tokens_per_s  # 0.89 (docs/simulate.md)


def test_tensor_parallel_sizes_divide_the_node_and_the_heads():
    assert tensor_parallel_sizes("h100", 8, Model("m", 10**9)) == [1, 2, 4, 8]
    assert tensor_parallel_sizes("h100", 8, Model("m", 10**9, heads=12, kv_heads=12)) == [1, 2, 4]
    assert tensor_parallel_sizes("h100", 8, Model("m", 10**9, heads=32, kv_heads=2)) == [1, 2]
    assert tensor_parallel_sizes("v100", 16, Model("m", 10**9)) == [1, 2, 4, 8]
    assert tensor_parallel_sizes("cpu-gloo", 2, Model("m", 10**6)) == [1]  # its ranks share one host


PLAN_FLAGS = ["--gpu", "h100", "--gpus", "16", "--inter-node-bandwidth", "400gbit", "--params", "1e9"]
PLAN_FLAGS += ["--sequence-length", "2048", "--micro-batch-sizes", "1", "--activation-checkpointing"]


def test_plan_prints_t_in_its_table_and_json(capsys):
    assert plan_main([*PLAN_FLAGS, "--tensor-parallel-sizes", "1", "2"]) == 0
    assert "| # | configuration | TP |" in capsys.readouterr().out
    assert plan_main([*PLAN_FLAGS, "--tensor-parallel-sizes", "1", "2", "--json", "--top", "100"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["inputs"]["tensor_parallel_sizes"] == [1, 2]
    assert {r["tensor_parallel_size"] for r in result["ranked"]} == {1, 2}


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--tensor-parallel-sizes", "3"], "--tensor-parallel-size 3 does not divide --gpus-per-node 8"),
        (["--n-head", "12", "--tensor-parallel-sizes", "8"], "does not divide the 12 attention heads"),
    ],
)
def test_plan_refuses_a_size_it_cannot_lay_out_in_one_line(capsys, argv, says):
    assert plan_main([*PLAN_FLAGS, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zeropp plan: error: ") and err.count("\n") == 1 and says in err


def test_the_tensor_parallel_table():
    """docs/simulate.md's table: ZeRO++ at T = 1 leads at 100 Gbit/s; T = 8 adds its collectives, removes hpZ
    (one data-parallel rank a node) and fits only with sequence parallelism below stage 3."""
    rows = {r["configuration"]: r for r in tensor_parallel_table()}
    assert max(rows, key=lambda name: rows[name]["100"]["tflops"]) in ("ZeRO++", "ZeRO++, T 2")
    assert rows["ZeRO++, T 8 + SP"]["100"]["tflops"] < rows["ZeRO++"]["100"]["tflops"]
    assert rows["ZeRO-3"]["100"]["tensor_parallel_s"] == 0 < rows["ZeRO-3, T 8 + SP"]["100"]["tensor_parallel_s"]
    assert rows["ZeRO-2, T 8 + SP"]["fits"] and not rows["ZeRO-2, T 8"]["fits"]
