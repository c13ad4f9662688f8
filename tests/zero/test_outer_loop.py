"""DiLoCo's outer loop (``zero.outer``): every node a replica trained by ZeRO inside the node, the nodes
averaging their change every ``sync_every`` steps through torch's Nesterov SGD. Against a single-process
reference of the algorithm (one model and AdamW per node, each on its node's rows), fp32: the weights of
every node within 1e-5; no byte of ZeRO's crosses a node, the outer exchange is the only one; one node is
plain zeropp, bit for bit. Streaming DiLoCo (``outer_fragments``): the same against the reference with
each fragment synchronized on its own step by an SGD of its own, each sync sending its fragment only."""

from __future__ import annotations

import copy

import pytest
import torch
from launcher import run_ranks
from models import ADAM_EPS, TOLERANCE, global_batch, loss_of, make_model, rows

from zeropp.config.sections import ZeroConfig
from zeropp.errors import ConfigError
from zeropp.index.flat import node_chunk_numel, outer_fragments
from zeropp.zero.optim.outer import runs_outer_loop

STEPS, EVERY = 5, 2  # synchronized after steps 2 and 4; step 5 leaves the nodes apart
OPTIM = dict(lr=1e-2, eps=ADAM_EPS, weight_decay=0.01)
OUTER = dict(outer_sync_every=EVERY, outer_lr=0.7, outer_momentum=0.9)


def reference_replicas(
    world: int, nodes: int, fragments: list[list[str]] | None = None
) -> list[dict[str, torch.Tensor]]:
    """DiLoCo in one process: a model and an AdamW per node, on the rows of that node's ranks. Streaming
    DiLoCo with `fragments` (each one's parameter names): fragment f synchronized after the steps t with
    t % H == ((f + 1) H // F) % H, by an outer SGD of its own."""
    per_node = world // nodes
    replicas = [make_model("gpt") for _ in range(nodes)]
    inner = [torch.optim.AdamW(m.parameters(), **OPTIM) for m in replicas]
    names = [name for name, _ in replicas[0].named_parameters()]
    fragments = fragments or [names]
    anchors = dict((name, p.detach().clone()) for name, p in replicas[0].named_parameters())
    outer = [
        torch.optim.SGD(
            [anchors[n] for n in names], lr=OUTER["outer_lr"], momentum=OUTER["outer_momentum"], nesterov=True
        )
        for names in fragments
    ]
    for step in range(STEPS):
        x, y = global_batch("gpt", step, 0, world)
        for node, (model, optimizer) in enumerate(zip(replicas, inner, strict=True)):
            mine = rows((x, y), node, per_rank=2 * per_node)
            optimizer.zero_grad()
            loss_of("gpt", model, *mine).backward()
            optimizer.step()
        for f, synced in enumerate(fragments):
            if (step + 1) % EVERY != (f + 1) * EVERY // len(fragments) % EVERY:
                continue
            params = [dict(m.named_parameters()) for m in replicas]
            for name in synced:
                changes = [anchors[name] - p[name].detach() for p in params]
                anchors[name].grad = torch.stack(changes).mean(0)
            outer[f].step()
            with torch.no_grad():
                for p, name in ((p, name) for p in params for name in synced):
                    p[name].copy_(anchors[name])
    return [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in replicas]


def outer_worker(simulated_nodes: int, stage: int, extra: dict) -> dict:
    from zeropp import ZeroEngine
    from zeropp.config.sections import TopologyConfig
    from zeropp.topology import init_topology

    topology = init_topology(TopologyConfig(nodes=simulated_nodes))
    config = ZeroConfig(stage=stage, sequence_check_interval=0, **extra)
    engine = ZeroEngine(make_model("gpt"), torch.optim.AdamW, OPTIM, config, topology)
    inter_by_step, synced, after_syncs = [], None, []
    for step in range(STEPS):
        x, y = rows(global_batch("gpt", step, 0, topology.world_size), topology.rank)
        engine.backward(loss_of("gpt", engine, x, y))
        before = engine.comm.ledger.total(link="inter")
        assert engine.step()
        inter_by_step.append(engine.comm.ledger.total(link="inter") - before)
        if step + 1 == STEPS - 1:  # the last synchronization
            synced = engine.full_state_dict()
        if config.outer.fragments > 1:  # the weights after each step, to compare the fragment it synchronized
            after_syncs.append(engine.full_state_dict())
    outer = engine.outer
    from zeropp.costs.memory import analytic_model_state_bytes, flat_numels

    psi, _ = flat_numels(engine.units, engine.module)
    outer_state = (config.outer, topology.nodes) if outer is not None else None
    if outer is not None and config.outer.fragments > 1:  # the fragments are cut from the units' shards
        outer_state = (*outer_state, [u.master.numel() for u in engine.units])
    fragments = [] if outer is None else [[engine.units[i] for i in f] for f in outer.fragments]
    offloaded = config.offload.optimizer != "none"
    analytic = analytic_model_state_bytes(
        psi, engine.groups.shard.size, stage, "fp32", outer=outer_state, offload_optimizer=offloaded
    )
    return dict(
        memory=(engine.measured_model_state_bytes, analytic),  # at the last step, with its gradients
        state=engine.full_state_dict(),
        synced=synced,
        inter=inter_by_step,
        node=topology.node_of(topology.rank),
        shard_numel=sum(u.master.numel() for u in engine.units),
        residuals={} if outer is None else {hop: r.clone() for hop, r in outer.residuals().items()},
        fragments=[[name for unit in units for name in unit.names] for units in fragments],
        fragment_numels=[sum(unit.master.numel() for unit in units) for units in fragments],
        after_syncs=after_syncs,
    )


@pytest.mark.parametrize(
    "stage,offload", [(1, "none"), (3, "none"), (3, "cpu")], ids=["stage1", "stage3", "stage3-offload"]
)
def test_each_node_equals_the_single_process_algorithm_and_only_the_sync_crosses_nodes(stage, offload):
    world, nodes = 4, 2
    reference = reference_replicas(world, nodes)
    extra = dict(OUTER, offload_optimizer=offload)
    for rank, result in enumerate(
        run_ranks(outer_worker, world, nodes=nodes, simulated_nodes=nodes, stage=stage, extra=extra)
    ):
        expected = reference[result["node"]]
        error = max((result["state"][k] - expected[k]).abs().max().item() for k in expected)
        assert error <= TOLERANCE, (rank, error)
        # the sync's all-reduce of the fp32 shard over 2 nodes (a ring sends (n-1)/n twice): nothing else crosses
        syncs = [4 * result["shard_numel"] if (step + 1) % EVERY == 0 else 0 for step in range(STEPS)]
        assert result["inter"] == syncs, (rank, result["inter"], syncs)
        measured, analytic = result["memory"]  # the anchors and the outer momentum counted, 8 bytes a parameter
        assert measured == analytic, (rank, measured, analytic)
    apart = max((reference[0][k] - reference[1][k]).abs().max().item() for k in reference[0])
    assert apart > 1e-4  # step 5 trained each node alone: the comparison above tells the nodes apart


def quantized_sync_bytes(numel: int, nodes: int, bits: int, block: int) -> int:
    """A rank's bytes per sync, worked out by hand: its shard cut into one chunk of whole blocks per node,
    each quantized (codes and one fp32 scale a block); the all-to-all sends the n - 1 chunks for the other
    nodes, the all-gather the mean chunk it owns to each of them."""
    chunk = block * -(-numel // (nodes * block))
    row = (chunk if bits == 8 else (chunk + 1) // 2) + 4 * (chunk // block)
    return 2 * (nodes - 1) * row


def check_quantized_exchange(world: int, nodes: int, bits: int, block: int) -> None:
    """Run `world` ranks on `nodes` with the quantized exchange; check them against the exact outer loop."""
    exact = reference_replicas(world, nodes)
    extra = dict(OUTER, outer_bits=bits, outer_block_size=block)
    results = run_ranks(outer_worker, world, nodes=nodes, simulated_nodes=nodes, stage=3, extra=extra)
    by_node = {r["node"]: r for r in results}
    # every rank dequantizes the same mean chunks: after a sync the nodes hold the same weights, bit for bit
    for node in range(1, nodes):
        assert all(torch.equal(by_node[0]["synced"][k], by_node[node]["synced"][k]) for k in exact[0]), node
    initial = make_model("gpt").state_dict()
    for rank, result in enumerate(results):
        expected = exact[result["node"]]
        change = max((expected[k] - initial[k]).abs().max().item() for k in expected)
        error = max((result["state"][k] - expected[k]).abs().max().item() for k in expected)
        assert 0 < error < (0.02 if bits == 8 else 0.2) * change, (rank, error, change)
        numel = result["shard_numel"]
        sync = quantized_sync_bytes(numel, nodes, bits, block)
        assert result["inter"] == [sync if (step + 1) % EVERY == 0 else 0 for step in range(STEPS)], rank
        fp32 = 2 * (nodes - 1) * 4 * numel // nodes  # the exact loop's all-reduce
        assert sync < fp32 / (3.5 if bits == 8 else 6.5), (sync, fp32)
        gathered = (nodes - 1) * ((numel if bits == 8 else (numel + 1) // 2) + 4 * -(-numel // block))
        assert sync < (2 / nodes + 0.01) * gathered, (sync, gathered)  # an all-gather of the whole shard's codes
        # what the last quantization of the chunks and of the mean chunk dropped: within half a step of its block
        assert sorted(result["residuals"]) == ["gather", "inter"]
        assert all(0 < r.abs().max().item() < change for r in result["residuals"].values()), rank
        measured, analytic = result["memory"]  # the residuals too: 4 (nodes + 1) bytes a value of a chunk
        assert measured == analytic, (rank, measured, analytic)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_exchange_keeps_the_nodes_identical_near_the_exact_one_in_fewer_bytes(bits):
    check_quantized_exchange(4, 2, bits, block=64)  # errors measured: 0.9% (int8), 14% (int4) of the change


@pytest.mark.parametrize("bits", [8, 4])
def test_the_quantized_exchange_over_four_nodes_is_a_reduce_scatter(bits):
    """One rank per node: 2 (n - 1) quantized chunks of a quarter of the shard, where an all-gather of the
    shard would send n - 1 whole ones."""
    check_quantized_exchange(4, 4, bits, block=64)  # errors measured: 1.5% (int8), 17% (int4) of the change


FRAGMENTS = dict(OUTER, outer_fragments=2)  # H = 2: fragment 0 synchronized after steps 1, 3, 5, fragment 1 after 2, 4


def check_fragments(result: dict) -> list[int]:
    """Every parameter in one fragment, none empty; returns each one's numel on this rank."""
    names = [name for name, _ in make_model("gpt").named_parameters()]
    assert sorted(n for f in result["fragments"] for n in f) == sorted(names) and all(result["fragments"])
    return result["fragment_numels"]


@pytest.mark.parametrize("stage", [1, 3], ids=["stage1", "stage3"])
def test_streaming_fragments_equal_the_single_process_algorithm_each_sync_sending_its_fragment(stage):
    world, nodes = 4, 2
    results = run_ranks(outer_worker, world, nodes=nodes, simulated_nodes=nodes, stage=stage, extra=FRAGMENTS)
    # the tiny GPT's units: its 2 blocks and the root; balanced by numel, block 0 alone, block 1 with the root
    assert results[0]["fragments"][0] == [
        n for n, _ in make_model("gpt").named_parameters() if n.startswith("blocks.0.")
    ]
    reference = reference_replicas(world, nodes, results[0]["fragments"])
    for rank, result in enumerate(results):
        first, second = check_fragments(result)
        expected = reference[result["node"]]
        error = max((result["state"][k] - expected[k]).abs().max().item() for k in expected)
        assert error <= TOLERANCE, (rank, error)
        # every step synchronizes one fragment, alternately: its fp32 all-reduce over 2 nodes only
        assert result["inter"] == [4 * first, 4 * second, 4 * first, 4 * second, 4 * first], rank
        measured, analytic = result["memory"]
        assert measured == analytic, (rank, measured, analytic)
    apart = max((reference[0][k] - reference[1][k]).abs().max().item() for k in reference[0])
    assert apart > 1e-4  # step 5 synchronized fragment 0 only: fragment 1 is apart, the comparison tells nodes apart
    one = reference_replicas(world, nodes)
    assert max((one[0][k] - reference[0][k]).abs().max().item() for k in one[0]) > 1e-4  # not plain DiLoCo's


def test_quantized_fragments_keep_each_synchronized_fragment_identical_over_the_nodes():
    world, nodes, bits, block = 4, 2, 4, 64
    extra = dict(FRAGMENTS, outer_bits=bits, outer_block_size=block)
    results = run_ranks(outer_worker, world, nodes=nodes, simulated_nodes=nodes, stage=3, extra=extra)
    by_node = {r["node"]: r for r in results}
    fragments = by_node[0]["fragments"]
    for step, (mine, theirs) in enumerate(zip(by_node[0]["after_syncs"], by_node[1]["after_syncs"], strict=True)):
        synced, other = fragments[step % 2], fragments[1 - step % 2]  # step 1 (index 0) synchronizes fragment 0
        assert all(torch.equal(mine[k], theirs[k]) for k in synced), step
        if step:  # the other fragment trained apart since its own synchronization
            assert any(not torch.equal(mine[k], theirs[k]) for k in other), step
    exact, initial = reference_replicas(world, nodes, fragments), make_model("gpt").state_dict()
    for rank, result in enumerate(results):
        numels = check_fragments(result)
        expected = exact[result["node"]]
        change = max((expected[k] - initial[k]).abs().max().item() for k in expected)
        error = max((result["state"][k] - expected[k]).abs().max().item() for k in expected)
        assert 0 < error < 0.2 * change, (rank, error, change)
        syncs = [quantized_sync_bytes(numels[step % 2], nodes, bits, block) for step in range(STEPS)]
        assert result["inter"] == syncs, rank
        # residuals of its own per fragment, sized by its own chunk
        chunks = [node_chunk_numel(numel, nodes, block) for numel in numels]
        shapes = {name: tuple(r.shape) for name, r in result["residuals"].items()}
        assert shapes == {
            f"fragment{f}.{hop}": (rows, chunks[f]) for f in range(2) for hop, rows in (("inter", nodes), ("gather", 1))
        }, rank
        measured, analytic = result["memory"]
        assert measured == analytic, (rank, measured, analytic)


def refused_worker(fragments: int) -> str:
    from zeropp import ZeroEngine
    from zeropp.config.sections import TopologyConfig
    from zeropp.topology import init_topology

    topology = init_topology(TopologyConfig(nodes=2))
    config = ZeroConfig(stage=3, sequence_check_interval=0, outer_sync_every=4, outer_fragments=fragments)
    try:
        ZeroEngine(make_model("gpt"), torch.optim.AdamW, OPTIM, config, topology)
    except ConfigError as error:
        return str(error)
    return ""


def test_more_fragments_than_trainable_units_is_refused_when_the_engine_is_built():
    messages = run_ranks(refused_worker, 2, nodes=2, fragments=4)  # the tiny GPT has 3 units
    assert messages == ["zero.outer_fragments = 4: a fragment is whole units and 3 unit(s) hold trainable "
                        "parameters; expected at most 3"] * 2  # fmt: skip


def test_one_node_is_plain_zeropp_bit_for_bit():
    with_outer, plain = (
        run_ranks(outer_worker, 2, simulated_nodes=1, stage=3, extra=extra)[0]["state"] for extra in (OUTER, {})
    )
    assert all(torch.equal(with_outer[k], plain[k]) for k in plain)


@pytest.mark.unit
def test_what_the_outer_step_cannot_reach_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^zero.outer_sync_every = 2: DiLoCo steps the shards of element-wise"):
        runs_outer_loop(ZeroConfig(outer_sync_every=2), 2, "whole")
    assert not runs_outer_loop(ZeroConfig(outer_sync_every=2), 1, "whole")  # one node: plain zeropp, nothing refused
    assert runs_outer_loop(ZeroConfig(outer_sync_every=2), 2, "segments")
    nvme = ZeroConfig(outer_sync_every=2, offload_optimizer="nvme", offload_path=str(tmp_path))
    with pytest.raises(ConfigError, match=r"^zero.outer_sync_every = 2 is not allowed with zero.offload_optimizer"):
        runs_outer_loop(nvme, 2, "segments")
    params = ZeroConfig(outer_sync_every=2, offload_optimizer="cpu", offload_params="nvme", offload_path=str(tmp_path))
    with pytest.raises(
        ConfigError, match=r"^zero.outer_sync_every = 2 is not allowed with zero.offload_params = 'nvme'"
    ):
        runs_outer_loop(params, 2, "segments")
    for key, value, allowed in (
        ("outer_sync_every", -1, "an integer >= 0"),
        ("outer_momentum", 1.0, "a number from 0 to below 1"),
        ("outer_lr", 0.0, "a number > 0"),
        ("outer_lr", float("nan"), "a number > 0"),
    ):
        with pytest.raises(ConfigError, match=rf"^zero.{key} = .* is not allowed; expected {allowed}"):
            ZeroConfig(**{key: value}).validate()
    assert copy.deepcopy(ZeroConfig(outer_sync_every=3)).outer.enabled
    with pytest.raises(ConfigError, match=r"^zero.outer_fragments = 0 is not allowed; expected an integer >= 1$"):
        ZeroConfig(outer_fragments=0).validate()
    with pytest.raises(
        ConfigError, match=r"^zero.outer_fragments = 3 is not allowed; expected at most zero.outer_sync"
    ):
        ZeroConfig(outer_sync_every=2, outer_fragments=3).validate()
    ZeroConfig(outer_fragments=3).validate()  # the outer loop off: nothing to stagger


@pytest.mark.unit
def test_the_fragments_are_contiguous_balanced_units_staggered_over_the_h_steps():
    assert outer_fragments([5, 7, 3], 1) == [range(0, 3)]
    # boundaries at the unit boundary nearest f / F of the total: 30 over 3 -> 10 and 20
    assert outer_fragments([4, 4, 4, 4, 4, 10], 3) == [range(0, 2), range(2, 5), range(5, 6)]
    assert outer_fragments([100, 1, 1, 100], 3) == [range(0, 1), range(1, 3), range(3, 4)]
    assert outer_fragments([1, 1, 100], 3) == [range(0, 1), range(1, 2), range(2, 3)]  # one unit each at least
    with pytest.raises(ValueError):
        outer_fragments([1, 2], 3)
    policy = ZeroConfig(outer_sync_every=50, outer_fragments=3).outer
    synced = {t: policy.synced_after(t) for t in range(1, 101) if policy.synced_after(t)}
    assert synced == {16: (0,), 33: (1,), 50: (2,), 66: (0,), 83: (1,), 100: (2,)}
    plain = ZeroConfig(outer_sync_every=4).outer  # F = 1: every H steps, as before
    assert [t for t in range(1, 13) if plain.synced_after(t)] == [4, 8, 12] and plain.synced_after(4) == (0,)
    every = ZeroConfig(outer_sync_every=3, outer_fragments=3).outer  # F = H: one fragment every step
    assert [every.synced_after(t) for t in range(1, 7)] == [(0,), (1,), (2,), (0,), (1,), (2,)]
