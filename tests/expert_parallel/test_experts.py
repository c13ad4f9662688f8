"""Expert parallelism trains exactly as one process (fp32): the embedded GPT with 4 experts, top 2,
at world 2 (E 2) and world 4 (E 2 x data parallel 2) at stages 1-3; each rank holds 1/E of the
experts' model states; a rank whose tokens all go to another rank's experts, and an expert no token
chooses, train without a hang and exactly."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from launcher import run_ranks
from models import ADAM_EPS, GPT_TEST, TOLERANCE, global_batch, rows

STEPS = 3
OPTIM = dict(lr=1e-2, eps=ADAM_EPS, weight_decay=0.01)
MOE = dataclasses.replace(GPT_TEST, n_experts=4, top_k=2)


def moe_model(routing: str = "learned"):
    """The MoE GPT; `routing` "skewed": embedding dimension 0 marks a token's vocabulary half (+-10),
    dimension 1 is 10 for every token, and every router scores expert j by a_j x dim 0 + b_j x dim 1
    with a = (-2, -1, 1, 0), b = (0, 0, 0, -100): tokens of the lower half go to experts 2 and 1, of the
    upper half to experts 0 and 1 (both held by expert-parallel rank 0 at E 2), and no token to
    expert 3 (:func:`test_the_skewed_routing_is_what_it_says`)."""
    from zeropp.app.models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(MOE)
    if routing == "skewed":
        with torch.no_grad():
            model.wte.weight[:, 0] = torch.where(torch.arange(256) < 128, 10.0, -10.0)
            model.wte.weight[:, 1] = 10.0
            for block in model.blocks:
                router = block.mlp.router.weight
                router.zero_()
                router[:, 0] = torch.tensor([-2.0, -1.0, 1.0, 0.0])
                router[:, 1] = torch.tensor([0.0, 0.0, 0.0, -100.0])
    return model


def batch(step: int, readers: int, routing: str):
    x, y = global_batch("gpt", step, 0, readers)
    if routing == "skewed":  # the first reader's rows from the lower vocabulary half, the others' from the upper
        half = x.shape[0] // readers
        x = torch.cat([x[:half] % 128, x[half:] % 128 + 128])
    return x, y


def reference(readers: int, routing: str) -> tuple[dict, list[float]]:
    model = moe_model(routing)
    optimizer = torch.optim.AdamW(model.parameters(), **OPTIM)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = model(*batch(step, readers, routing))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def expert_worker(ep: int, stage: int, routing: str, extra: dict) -> dict:
    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.config.sections import TopologyConfig
    from zeropp.topology import init_topology

    topology = init_topology(TopologyConfig(expert_parallel_size=ep))
    rank, readers = topology.rank, topology.world_size
    config = ZeroConfig(
        stage=stage, prefetch=2, sequence_check_interval=1, **extra
    )  # every step's collectives compared
    engine = ZeroEngine(moe_model(routing), torch.optim.AdamW, OPTIM, config, topology)
    losses = []
    for step in range(STEPS):
        loss = engine(*rows(batch(step, readers, routing), rank))
        engine.backward(loss)
        assert engine.step()
        losses.append(loss.item())
    experts = [u for u in engine.units if u.module in engine.expert_units]
    return dict(
        state=engine.full_state_dict(), losses=losses,
        expert_numel=sum(u.layout.numel for u in experts), expert_shard=sum(u.master.numel() for u in experts),
    )  # fmt: skip


@pytest.mark.parametrize(
    "world,ep,stage,routing,extra",
    [
        (2, 2, 3, "learned", {}), (4, 2, 3, "learned", {}), (4, 2, 1, "learned", {}), (4, 2, 2, "skewed", {}),
        (2, 2, 3, "skewed", {}), (4, 2, 3, "skewed", dict(activation_checkpointing=True)),
        (2, 2, 3, "skewed", dict(step_in_backward=True)),
    ],
    ids=[
        "e2", "e2xdp2", "e2xdp2-stage1", "e2xdp2-stage2-skewed", "e2-skewed", "e2xdp2-skewed-checkpointed",
        "e2-skewed-step-in-backward",
    ],
)  # fmt: skip
def test_trains_the_weights_and_losses_of_one_process(world, ep, stage, routing, extra):
    per_rank = run_ranks(expert_worker, world, ep=ep, stage=stage, routing=routing, extra=extra)
    ref, ref_losses = reference(world, routing)
    for result in per_rank:
        error = max((result["state"][k].float() - ref[k]).abs().max().item() for k in ref)
        assert error <= TOLERANCE, error
    for step, expected in enumerate(ref_losses):
        assert sum(r["losses"][step] for r in per_rank) / world == pytest.approx(expected, rel=1e-5, abs=0)
    # each rank: its 1/E of the 4 experts (2 layers x 2 experts x (2 x 32 x 128 + 128 + 32)), sharded over world/E
    per_layer = (4 // ep) * (2 * 32 * 128 + 128 + 32)
    for result in per_rank:
        assert result["expert_numel"] == 2 * per_layer
        assert result["expert_shard"] * (world // ep) >= result["expert_numel"]


def test_the_skewed_routing_is_what_it_says():
    model, chosen = moe_model("skewed"), []
    for block in model.blocks:
        block.mlp.router.register_forward_hook(lambda m, args, out: chosen.append(out.topk(2, dim=-1).indices))
    x, y = batch(0, 2, "skewed")
    model(x, y)
    for layer in chosen:  # (tokens, 2), the first reader's rows first
        lower, upper = layer.view(2, -1, 2)
        assert set(lower.unique().tolist()) == {1, 2} and set(upper.unique().tolist()) == {0, 1}


def _summary(tmp_path, ep: int, qgz: str = "--no-quantized-gradients", world: int = 4, nodes: int = 2) -> dict:
    import json

    from cli_runner import run_cli
    from launcher import free_port

    out = tmp_path / f"ep{ep}{qgz}{world}-{nodes}.json"
    done = run_cli(
        "train", "--preset", "tiny", "--n-experts", "4", "--top-k", "2", "--expert-parallel", str(ep), "--steps", "2",
        "--eval-batches", "1", qgz, "--nproc-per-node", str(world), "--nodes", str(nodes), "--master-port", str(free_port()),
        "--summary-json", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_zeropp_train_with_expert_parallelism_trains_the_same_losses_in_less_memory(tmp_path):
    """At world 4 on 2 simulated nodes, stage 3 with qwZ and hpZ (qgZ off: its int4 rounding falls on
    other slices at E 2): E 2 trains the losses of E 1 (the same initialization: experts are units of
    their own either way; within qwZ's rounding, whose int8 blocks fall on other shards), each rank
    holding fewer model-state bytes, as the summary's formula says. With qgZ too, and at world 8 (2
    nodes of 4: the experts' hpZ group is the 2 ranks of a node holding them, so backward gathers
    nothing across nodes), `zeropp estimate` gives the run's bytes."""
    import json

    one, two = _summary(tmp_path, 1), _summary(tmp_path, 2)
    assert two["train_losses"][0] == one["train_losses"][0]  # the same weights before the first step
    assert two["train_losses"] == pytest.approx(one["train_losses"], rel=1e-4)
    assert two["zeropp"] == {"quantized_weights": True, "hpz_group_size": 2, "quantized_gradients": False}
    for summary in (one, two):
        assert summary["model_state_bytes_per_rank"] == [summary["analytic_model_state_bytes_per_rank"]] * 4
    assert two["model_state_bytes_per_rank"][0] < one["model_state_bytes_per_rank"][0]
    alone = _summary(tmp_path, 4, nodes=1)  # E 4: each rank alone holds its experts (their units as laid out)
    assert alone["model_state_bytes_per_rank"] == [alone["analytic_model_state_bytes_per_rank"]] * 4
    assert "ep.all_to_all" in two["ledger"] and "ep.all_to_all" not in one["ledger"]
    gathered = [sum(sum(links.values()) for links in s["ledger"]["all_gather"].values()) for s in (one, two)]
    assert gathered[1] < gathered[0]  # each rank gathers its half of the experts, over half the ranks
    # zeropp estimate of the same runs, and of E 2 with qgZ (zeropp train's default): every collective's
    # bytes as the ledger counted them, but the all-to-alls of the tokens, which it prices for routing
    # spread evenly over the experts (the router's is not)
    from zeropp.tools.estimate import main

    qgz, eight = _summary(tmp_path, 2, "--quantized-gradients"), _summary(tmp_path, 2, "--quantized-gradients", 8)
    assert qgz["zeropp"]["quantized_gradients"] and qgz["ledger"]["all_to_all"] != two["ledger"].get("all_to_all")
    assert eight["zeropp"]["hpz_group_size"] == 4 and eight["ledger"]["all_gather"]["backward"]["inter"] == 0
    assert eight["model_state_bytes_per_rank"] == [eight["analytic_model_state_bytes_per_rank"]] * 8
    runs = ((1, one, "--no-", 4), (2, two, "--no-", 4), (2, qgz, "--", 4), (2, eight, "--", 8))
    for ep, summary, gradients, world in runs:
        out = tmp_path / f"estimate{ep}{gradients}{world}.json"
        flags = ["--quantized-weights", "--hpz-partition-size", "0", f"{gradients}quantized-gradients"]
        argv = ["--preset", "tiny", "--n-experts", "4", "--top-k", "2", "--expert-parallel-size", str(ep), *flags]
        assert main([*argv, "--world", str(world), "--nodes", "2", "--micro-batch-size", "4", "--json", str(out)]) == 0
        estimated = json.loads(out.read_text())
        assert estimated["model_state_bytes_per_rank"] == summary["analytic_model_state_bytes_per_rank"]
        measured = {op: v for op, v in summary["ledger"].items() if op != "ep.all_to_all"}
        assert {op: v for op, v in estimated["ledger"].items() if op != "ep.all_to_all"} == measured


@pytest.mark.unit
def test_what_expert_parallelism_cannot_do_is_refused_in_one_line():
    from zeropp.app.models.gpt import GPT, GPTConfig, gpt_config
    from zeropp.config.model import ModelConfig
    from zeropp.config.sections import TopologyConfig
    from zeropp.errors import ConfigError
    from zeropp.expert_parallel import check_expert_parallel

    with pytest.raises(ConfigError, match=r"^topology.expert_parallel_size = 3 does not divide the model's 4 experts"):
        check_expert_parallel(moe_model(), 3)
    with pytest.raises(ConfigError, match=r"^topology.expert_parallel_size = 2 is not allowed with GPT: it has no"):
        check_expert_parallel(GPT(GPTConfig(n_layer=1, d_model=32, n_head=2)), 2)
    with pytest.raises(ConfigError, match=r"^topology.expert_parallel_size = 2 is not allowed; expected 1 with"):
        TopologyConfig(expert_parallel_size=2, context_parallel_size=2).validate()
    with pytest.raises(ConfigError, match=r"^model.top_k = 5 is not allowed with model.n_experts = 4"):
        gpt_config(ModelConfig(n_experts=4, top_k=5))


def hpz_worker() -> dict:
    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.config.sections import TopologyConfig
    from zeropp.topology import init_topology

    topology = init_topology(TopologyConfig(expert_parallel_size=2, nodes=2))
    rank, readers = topology.rank, topology.world_size
    config = ZeroConfig(stage=3, prefetch=2, hpz_partition_size=0, sequence_check_interval=1)
    engine = ZeroEngine(moe_model(), torch.optim.AdamW, OPTIM, config, topology)
    losses = []
    for step in range(STEPS):
        loss = engine(*rows(batch(step, readers, "learned"), rank))
        engine.backward(loss)
        assert engine.step()
        losses.append(loss.item())
    return dict(
        state=engine.full_state_dict(), losses=losses, dense_hpz=engine.groups.hpz_group_size,
        experts_secondary=engine.expert_groups.secondary.ranks,
    )  # fmt: skip


def test_hpz_keeps_the_experts_secondary_partition_on_the_ranks_of_a_node_holding_them():
    """World 8 on 2 nodes of 4, E 2, hpZ over each node: the 2 ranks of a node holding the same experts
    are their secondary group (backward gathers them inside the node); exact against one process."""
    per_rank = run_ranks(hpz_worker, 8, nodes=2)
    ref, ref_losses = reference(8, "learned")
    for rank, result in enumerate(per_rank):
        assert result["dense_hpz"] == 4
        node, position = divmod(rank, 4)
        assert result["experts_secondary"] == (4 * node + position % 2, 4 * node + position % 2 + 2)
        error = max((result["state"][k].float() - ref[k]).abs().max().item() for k in ref)
        assert error <= TOLERANCE, error
    for step, expected in enumerate(ref_losses):
        assert sum(r["losses"][step] for r in per_rank) / 8 == pytest.approx(expected, rel=1e-5, abs=0)


def refusal_worker() -> dict:
    from zeropp import ConfigError, ZeroConfig, ZeroEngine
    from zeropp.config.sections import TopologyConfig
    from zeropp.topology import init_topology

    topology = init_topology(TopologyConfig(expert_parallel_size=2))
    try:
        ZeroEngine(moe_model(), torch.optim.AdamW, OPTIM, ZeroConfig(stage=0), topology)
    except ConfigError as error:
        return {"stage0": str(error)}
    return {}


def test_stage_0_is_refused_before_any_collective():
    for messages in run_ranks(refusal_worker, 2):
        assert messages["stage0"] == "topology.expert_parallel_size = 2 is not allowed with zero.stage = 0; expected 1"


def zeropp_worker() -> dict:
    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.config.sections import TopologyConfig
    from zeropp.topology import init_topology

    topology = init_topology(TopologyConfig(expert_parallel_size=2, nodes=2))
    rank, readers = topology.rank, topology.world_size
    zeropp = ZeroConfig(
        stage=3, prefetch=2, quantized_weights=True, hpz_partition_size=0, quantized_gradients=True,
        sequence_check_interval=1,
    )  # fmt: skip
    engine = ZeroEngine(moe_model(), torch.optim.SGD, dict(lr=0.5), zeropp, topology)
    for step in range(STEPS):
        engine.backward(engine(*rows(batch(step, readers, "learned"), rank)))
        assert engine.step()
    return dict(state=engine.full_state_dict(), ops=sorted(engine.comm.ledger.as_dict()), hpz=engine.hpz_group_size)


def test_zeropp_with_expert_parallelism_trains_close_to_one_process_in_one_order_of_collectives():
    """qwZ, hpZ and qgZ at world 4 on 2 nodes with E 2: each node's 2 ranks split the experts, the
    ranks holding the same experts (one per node) are the dense units' second-hop ranks, so qgZ's
    second hops start at the same point of the program on every rank, never when their input happens
    to arrive (every step's collectives compared: a hop reordered against the experts' all-gathers
    and reductions over those ranks stops the run). The weights within the bound
    tests/zero/test_zeropp.py holds ZeRO++ to (int4 gradients: 0.35 of the SGD update)."""
    per_rank = run_ranks(zeropp_worker, 4, nodes=2)
    assert per_rank[0]["hpz"] == 2 and {"ep.all_to_all", "all_to_all"} <= set(per_rank[0]["ops"])
    model = moe_model()
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(STEPS):
        optimizer.zero_grad()
        model(*batch(step, 4, "learned")).backward()
        optimizer.step()
    moved = max((v - start[k]).abs().max().item() for k, v in model.state_dict().items())
    for result in per_rank:
        error = max((result["state"][k].float() - v).abs().max().item() for k, v in model.state_dict().items())
        assert 0 < error / moved <= 0.35, error / moved
