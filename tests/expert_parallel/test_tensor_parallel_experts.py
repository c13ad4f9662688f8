"""Tensor parallelism composed with expert parallelism ("expert tensor parallel size 1"): attention and
the dense layers split over the tensor-parallel ranks, every mixture-of-experts layer whole on each of
them (the same experts, the same tokens), its experts split over E data-parallel ranks sharing a
tensor-parallel rank. World 4 = tp 2 x E 2 trains the weights and losses of one process (fp32): the
embedded GPT with 4 experts, top 2, at stages 1 and 3 (gradient clipping on: the norm counts the
experts once, not once per tensor-parallel rank), tiny Mixtral and Qwen3-MoE at stage 3; each rank
holds 1/E of the experts; a checkpoint saved at tp 2 x E 2 resumes on other meshes; `zeropp train` runs it."""

from __future__ import annotations

import pytest
import torch
from launcher import run_ranks
from models import TOLERANCE, rows
from test_experts import OPTIM, STEPS, batch, moe_model

CLIP = 0.05  # the GPT's gradient norm is 0.8-1.5 here: every step clipped, Adam's eps makes that count
LAYERS, EXPERTS, E, DP = 2, 4, 2, 2
# each rank's experts: n / E of every layer's, sharded over the dp / E ranks holding them (here 1: whole)
EXPERT_NUMEL = LAYERS * (EXPERTS // E) * (2 * 32 * 128 + 128 + 32)  # w_in, w_out, b_in, b_out per expert


def gpt_worker(stage: int, max_norm: float | None, extra: dict) -> dict:
    from zeropp import ConfigError, ZeroConfig, ZeroEngine
    from zeropp.config.sections import TopologyConfig
    from zeropp.tensor_parallel.apply import parallelize
    from zeropp.topology import init_topology
    from zeropp.zero.weights.dtensor_params import is_split

    topology = init_topology(TopologyConfig(tensor_parallel_size=2, expert_parallel_size=E))
    dp = topology.data_parallel  # the tensor-parallel ranks read the same rows
    config = ZeroConfig(stage=stage, prefetch=2, max_grad_norm=max_norm, sequence_check_interval=1, **extra)
    refused = None
    try:  # Pa: refused before any collective of the engine
        pa = ZeroConfig(stage=stage, activation_checkpointing=True, partition_activations=True)
        ZeroEngine(parallelize(moe_model(), topology), torch.optim.AdamW, OPTIM, pa, topology)
    except ConfigError as error:
        refused = str(error)
    model = parallelize(moe_model(), topology)
    split = {name for name, p in model.named_parameters() if is_split(p)}
    engine = ZeroEngine(model, torch.optim.AdamW, OPTIM, config, topology)
    losses, norms = [], []
    for step in range(STEPS):
        loss = engine(*rows(batch(step, dp.size, "learned"), dp.rank))
        engine.backward(loss)
        assert engine.step()
        losses.append(loss.item())
        norms.append(engine.last_grad_norm)
    experts = [u for u in engine.units if u.module in engine.expert_units]
    return dict(
        state=engine.full_state_dict(), losses=losses, norms=norms, split=split, refused=refused,
        groups=(topology.tensor_parallel.ranks, topology.expert_parallel.ranks, engine.expert_groups.shard.ranks),
        expert_numel=sum(u.layout.numel for u in experts), expert_shard=sum(u.master.numel() for u in experts),
    )  # fmt: skip


def gpt_reference(max_norm: float | None) -> tuple[dict, list[float], list[float]]:
    """One process on both data-parallel ranks' rows: the state, each step's loss and gradient norm."""
    model = moe_model()
    optimizer = torch.optim.AdamW(model.parameters(), **OPTIM)
    losses, norms = [], []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = model(*batch(step, 2, "learned"))
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm or float("inf")).item())
        optimizer.step()
        losses.append(loss.item())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses, norms


@pytest.mark.parametrize(
    "stage,max_norm,extra",
    [(3, CLIP, {}), (1, None, {}), (3, None, dict(activation_checkpointing=True))],
    ids=["stage3-clip", "stage1", "stage3-checkpointed"],
)
def test_gpt_trains_the_weights_and_losses_of_one_process(stage, max_norm, extra):
    """Also with activation checkpointing (each experts container recomputed, its dispatch too); Pa
    (ZeRO-R's partitioned checkpoints) is refused in one line."""
    per_rank = run_ranks(gpt_worker, 4, stage=stage, max_norm=max_norm, extra=extra)
    ref, ref_losses, ref_norms = gpt_reference(max_norm)
    for rank, result in enumerate(per_rank):
        # tp over (0, 1) and (2, 3); the experts split over data-parallel ranks (0, 2) and (1, 3), each held by one
        assert result["groups"] == ((rank - rank % 2, rank - rank % 2 + 1), (rank % 2, rank % 2 + 2), (rank,))
        assert "blocks.0.attn.qkv.weight" in result["split"] and not any("mlp" in n for n in result["split"])
        error = max((result["state"][k].float() - ref[k]).abs().max().item() for k in ref)
        assert error <= TOLERANCE, (rank, error)
        assert result["norms"] == pytest.approx(ref_norms, rel=1e-5)  # the experts counted once
        assert result["expert_numel"] == EXPERT_NUMEL and result["expert_shard"] * (DP // E) == EXPERT_NUMEL
        assert result["refused"] == (
            "topology.expert_parallel_size = 2 is not allowed with zero.partition_activations under tensor "
            "parallelism (not composed yet); expected 1"
        )
    assert max_norm is None or all(norm > max_norm for norm in ref_norms)  # clipping engaged every step
    for step, expected in enumerate(ref_losses):  # the data-parallel ranks' mean (tp ranks' losses are equal)
        assert per_rank[0]["losses"][step] == per_rank[1]["losses"][step]
        mean = (per_rank[0]["losses"][step] + per_rank[2]["losses"][step]) / 2
        assert mean == pytest.approx(expected, rel=1e-5, abs=0)


@pytest.mark.parametrize("world,ep,tp", [(2, 2, 1), (4, 4, 1), (4, 2, 2)], ids=["to-e2", "to-e4", "to-tp2-e2"])
def test_a_checkpoint_saved_at_tp2_e2_resumes_at_another_mesh(tmp_path, world, ep, tp):
    """Saved at tp 2 x E 2 (world 4) after 2 steps, each rank its pieces: resumed at E 2 (world 2), E 4
    (world 4) without tensor parallelism and at tp 2 x E 2, the next step's weights are the straight run's."""
    from test_checkpoints import run_worker

    straight = run_ranks(run_worker, 4, folder=str(tmp_path), ep=2, resume=False, tp=2)[0]
    for resumed in run_ranks(run_worker, world, folder=str(tmp_path), ep=ep, resume=True, tp=tp):
        error = max((resumed[k] - straight[k]).abs().max().item() for k in straight)
        assert error <= TOLERANCE, error


HF_MODELS = ("mixtral", "qwen3-moe")


def hf_worker() -> dict:
    from zoo import OPTIM as HF_OPTIM
    from zoo import zoo_batch, zoo_loss, zoo_model

    from zeropp import ConfigError, ZeroConfig, ZeroEngine
    from zeropp.config.sections import TopologyConfig
    from zeropp.expert_parallel.apply import hf_experts
    from zeropp.tensor_parallel.apply import parallelize, plan_for
    from zeropp.topology import init_topology
    from zeropp.zero.weights.dtensor_params import is_split

    topology = init_topology(TopologyConfig(tensor_parallel_size=2, expert_parallel_size=2))
    dp, out = topology.data_parallel, {}
    for name in HF_MODELS:
        model = parallelize(zoo_model(name), topology)
        split = sorted(n for n, p in model.named_parameters() if is_split(p))
        engine = ZeroEngine(model, torch.optim.AdamW, HF_OPTIM, ZeroConfig(stage=3, prefetch=2), topology)
        losses = []
        for step in range(STEPS):
            loss = zoo_loss(engine, zoo_batch(step, dp.size).chunk(dp.size)[dp.rank])
            engine.backward(loss)
            assert engine.step()
            losses.append(loss.item())
        held = [tuple(p.shape) for m in hf_experts(engine.module) for p in m.parameters()]
        out[name] = dict(state=engine.full_state_dict(), losses=losses, held=held, split=split)
    try:  # a plan of the user's splitting the experts: refused before any collective of the engine
        model = zoo_model("mixtral")
        model = parallelize(model, topology, plan_for(model, 2))
        ZeroEngine(model, torch.optim.AdamW, HF_OPTIM, ZeroConfig(stage=3), topology)
    except ConfigError as error:
        out["refused"] = str(error)
    return out


def test_hugging_face_experts_train_as_one_process():
    from zoo import zoo_reference

    pytest.importorskip("transformers")
    per_rank = run_ranks(hf_worker, 4)
    for name in HF_MODELS:
        ref, ref_losses = zoo_reference(name, STEPS, 2)
        for result in (r[name] for r in per_rank):
            assert any(".self_attn.q_proj." in n for n in result["split"]), name
            assert not any(".mlp." in n for n in result["split"]), (name, result["split"])
            error = max((result["state"][k].float() - ref[k]).abs().max().item() for k in ref)
            assert error <= TOLERANCE, (name, error)
            assert all(shape[0] == 2 for shape in result["held"]), (name, result["held"])  # 2 of 4 experts
        for step in range(STEPS):
            mean = (per_rank[0][name]["losses"][step] + per_rank[2][name]["losses"][step]) / 2
            assert mean == pytest.approx(sum(ref_losses[step]) / 2, rel=1e-5), (name, step)
    assert per_rank[0]["refused"].startswith(
        "topology.expert_parallel_size = 2 cannot split gate_up_proj: the tensor-parallel plan split it"
    )


@pytest.mark.unit
def test_the_plans_leave_the_experts_whole_and_sequence_parallelism_is_refused():
    from zoo import zoo_model

    from zeropp.config.sections import TopologyConfig
    from zeropp.errors import ConfigError
    from zeropp.tensor_parallel.apply import plan_for
    from zeropp.tensor_parallel.hf_plans import MoeExperts

    pytest.importorskip("transformers")
    mixtral = zoo_model("mixtral")
    assert isinstance(plan_for(mixtral, 2)["model.layers.*.mlp.experts"], MoeExperts)  # no expert parallelism
    whole = plan_for(mixtral, 2, experts_whole=True)
    assert sorted(whole) == sorted(f"model.layers.*.self_attn.{p}_proj" for p in "qkvo")  # attention only
    assert not any("mlp" in pattern for pattern in plan_for(moe_model(), 2))  # the GPT's experts and router
    with pytest.raises(ConfigError, match=r"^topology.sequence_parallel is not allowed with model.n_experts = 4"):
        plan_for(moe_model(), 2, sequence_parallel=True)
    with pytest.raises(ConfigError, match=r"^topology.expert_parallel_size = 2 is not allowed; expected 1 with "):
        TopologyConfig(tensor_parallel_size=2, expert_parallel_size=2, sequence_parallel=True).validate()
    TopologyConfig(tensor_parallel_size=2, expert_parallel_size=2).validate()  # composes


def _train(tmp_path, ep: int) -> dict:
    import json

    from cli_runner import run_cli
    from launcher import free_port

    out = tmp_path / f"ep{ep}.json"
    done = run_cli(
        "train", "--preset", "tiny", "--n-experts", "4", "--top-k", "2", "--expert-parallel", str(ep),
        "--tensor-parallel", "2", "--nodes", "1", "--steps", "2", "--eval-batches", "1",
        "--master-port", str(free_port()), "--summary-json", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_zeropp_train_with_tensor_and_expert_parallelism(tmp_path):
    """`zeropp train` at world 4 on one node (a node of 2 ranks would leave one data-parallel rank per
    node, which E 2 does not divide), stage 3 with qwZ and qgZ: tp 2 x E 2 trains the losses of tp 2
    x E 1 (within qwZ's rounding, whose blocks fall on other shards), dispatching by all-to-all."""
    one, two = _train(tmp_path, 1), _train(tmp_path, 2)
    assert two["world_size"] == 4 and two["zeropp"]["quantized_weights"]
    assert two["train_losses"] == pytest.approx(one["train_losses"], rel=1e-4)
    assert {"ep.all_to_all", "tp.all_reduce"} <= set(two["ledger"]) and "ep.all_to_all" not in one["ledger"]
    # zeropp estimate of the same runs: every collective's bytes as the ledger counted them (tensor
    # parallelism's one all-reduce per block and direction, attention's: the experts run whole), but
    # the all-to-alls of the tokens, which it prices for routing spread evenly
    import json

    from zeropp.tools.estimate import main

    for ep, summary in ((1, one), (2, two)):
        out = tmp_path / f"estimate{ep}.json"
        argv = ["--preset", "tiny", "--n-experts", "4", "--top-k", "2", "--expert-parallel-size", str(ep)]
        argv += ["--tensor-parallel-size", "2", "--world", "4", "--nodes", "1", "--micro-batch-size", "4"]
        assert main([*argv, "--quantized-weights", "--quantized-gradients", "--json", str(out)]) == 0
        estimated = json.loads(out.read_text())
        measured = {op: v for op, v in summary["ledger"].items() if op != "ep.all_to_all"}
        assert {op: v for op, v in estimated["ledger"].items() if op != "ep.all_to_all"} == measured
