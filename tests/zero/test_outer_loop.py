"""DiLoCo's outer loop (``zero.outer``): every node a replica trained by ZeRO inside the node, the nodes
averaging their change every ``sync_every`` steps through torch's Nesterov SGD. Against a single-process
reference of the algorithm (one model and AdamW per node, each on its node's rows), fp32: the weights of
every node within 1e-5; no byte of ZeRO's crosses a node, the outer exchange is the only one; one node is
plain zeropp, bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
from launcher import run_ranks
from models import ADAM_EPS, TOLERANCE, global_batch, loss_of, make_model, rows

from zeropp.config.sections import ZeroConfig
from zeropp.errors import ConfigError
from zeropp.zero.optim.outer import refuse_outer_with

STEPS, EVERY = 5, 2  # synchronized after steps 2 and 4; step 5 leaves the nodes apart
OPTIM = dict(lr=1e-2, eps=ADAM_EPS, weight_decay=0.01)
OUTER = dict(outer_sync_every=EVERY, outer_lr=0.7, outer_momentum=0.9)


def reference_replicas(world: int, nodes: int) -> list[dict[str, torch.Tensor]]:
    """DiLoCo in one process: a model and an AdamW per node, on the rows of that node's ranks."""
    per_node = world // nodes
    replicas = [make_model("gpt") for _ in range(nodes)]
    inner = [torch.optim.AdamW(m.parameters(), **OPTIM) for m in replicas]
    anchors = [p.detach().clone() for p in replicas[0].parameters()]
    outer = torch.optim.SGD(anchors, lr=OUTER["outer_lr"], momentum=OUTER["outer_momentum"], nesterov=True)
    for step in range(STEPS):
        x, y = global_batch("gpt", step, 0, world)
        for node, (model, optimizer) in enumerate(zip(replicas, inner, strict=True)):
            mine = rows((x, y), node, per_rank=2 * per_node)
            optimizer.zero_grad()
            loss_of("gpt", model, *mine).backward()
            optimizer.step()
        if (step + 1) % EVERY == 0:
            for k, anchor in enumerate(anchors):
                changes = [anchor - list(m.parameters())[k].detach() for m in replicas]
                anchor.grad = torch.stack(changes).mean(0)
            outer.step()
            for model in replicas:
                with torch.no_grad():
                    for p, anchor in zip(model.parameters(), anchors, strict=True):
                        p.copy_(anchor)
    return [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in replicas]


def outer_worker(simulated_nodes: int, stage: int, extra: dict) -> dict:
    from zeropp import ZeroEngine
    from zeropp.config.sections import TopologyConfig
    from zeropp.topology import init_topology

    topology = init_topology(TopologyConfig(nodes=simulated_nodes))
    config = ZeroConfig(stage=stage, sequence_check_interval=0, **extra)
    engine = ZeroEngine(make_model("gpt"), torch.optim.AdamW, OPTIM, config, topology)
    inter_by_step = []
    for step in range(STEPS):
        x, y = rows(global_batch("gpt", step, 0, topology.world_size), topology.rank)
        engine.backward(loss_of("gpt", engine, x, y))
        before = engine.comm.ledger.total(link="inter")
        assert engine.step()
        inter_by_step.append(engine.comm.ledger.total(link="inter") - before)
    shard_bytes = sum(u.master.numel() * 4 for u in engine.units)
    return dict(
        state=engine.full_state_dict(),
        inter=inter_by_step,
        shard_bytes=shard_bytes,
        node=topology.node_of(topology.rank),
    )


@pytest.mark.parametrize("stage", [1, 3])
def test_each_node_equals_the_single_process_algorithm_and_only_the_sync_crosses_nodes(stage):
    world, nodes = 4, 2
    reference = reference_replicas(world, nodes)
    for rank, result in enumerate(
        run_ranks(outer_worker, world, nodes=nodes, simulated_nodes=nodes, stage=stage, extra=OUTER)
    ):
        expected = reference[result["node"]]
        error = max((result["state"][k] - expected[k]).abs().max().item() for k in expected)
        assert error <= TOLERANCE, (rank, error)
        # the sync's all-reduce of the fp32 shard over 2 nodes (a ring sends (n-1)/n twice): nothing else crosses
        syncs = [result["shard_bytes"] if (step + 1) % EVERY == 0 else 0 for step in range(STEPS)]
        assert result["inter"] == syncs, (rank, result["inter"], syncs)
    apart = max((reference[0][k] - reference[1][k]).abs().max().item() for k in reference[0])
    assert apart > 1e-4  # step 5 trained each node alone: the comparison above tells the nodes apart


def test_one_node_is_plain_zeropp_bit_for_bit():
    with_outer, plain = (
        run_ranks(outer_worker, 2, simulated_nodes=1, stage=3, extra=extra)[0]["state"] for extra in (OUTER, {})
    )
    assert all(torch.equal(with_outer[k], plain[k]) for k in plain)


@pytest.mark.unit
def test_what_the_outer_step_cannot_reach_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^zero.outer_sync_every = 2: DiLoCo steps the shards of element-wise"):
        refuse_outer_with(ZeroConfig(outer_sync_every=2), "whole")
    nvme = ZeroConfig(outer_sync_every=2, offload_optimizer="nvme", offload_path=str(tmp_path))
    with pytest.raises(ConfigError, match=r"^zero.outer_sync_every = 2 is not allowed with zero.offload_optimizer"):
        refuse_outer_with(nvme, "segments")
    for key, value, allowed in (
        ("outer_sync_every", -1, "an integer >= 0"),
        ("outer_momentum", 1.0, "a number from 0 to below 1"),
        ("outer_lr", 0.0, "a number > 0"),
        ("outer_lr", float("nan"), "a number > 0"),
    ):
        with pytest.raises(ConfigError, match=rf"^zero.{key} = .* is not allowed; expected {allowed}"):
            ZeroConfig(**{key: value}).validate()
    assert copy.deepcopy(ZeroConfig(outer_sync_every=3)).outer.enabled
