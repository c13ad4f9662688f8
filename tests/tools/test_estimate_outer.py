"""zeropp estimate under DiLoCo's outer loop (``zero.outer``): ZeRO priced over one node's ranks, the
exchange per synchronization and spread over its H steps, against the engine's ledger and memory on 4
real ranks as 2 nodes x 2 (fp32, int8, int4; Streaming DiLoCo's fragments, each step's exchange its
fragment's); the command's output."""

from __future__ import annotations

import json

import pytest
import torch
from launcher import run_ranks

from zeropp.comm.ledger import ring_bytes
from zeropp.config.model import ModelConfig
from zeropp.config.sections import ZeroConfig
from zeropp.costs.memory import analytic_model_state_bytes, outer_state_bytes
from zeropp.costs.volume import outer_transfers
from zeropp.errors import ConfigError
from zeropp.index.ranks import Layout
from zeropp.tools.estimate import estimate, gpt_unit_numels, main

EVERY, STEPS = 2, 4  # synchronized after steps 2 and 4
OUTER_SCENARIOS = {
    "stage3-fp32": dict(stage=3, outer_sync_every=EVERY),
    "stage1-fp32-int8": dict(stage=1, outer_sync_every=EVERY, outer_bits=8, outer_block_size=64),
    "stage3-bf16-int4": dict(stage=3, precision="bf16", outer_sync_every=EVERY, outer_bits=4, outer_block_size=64),
    # fragments: 0 synchronized after steps 1 and 3, 1 after 2 and 4
    "stage3-fp32-fragments": dict(stage=3, outer_sync_every=EVERY, outer_fragments=2),
    "stage1-fp32-int8-fragments": dict(
        stage=1, outer_sync_every=EVERY, outer_fragments=2, outer_bits=8, outer_block_size=64
    ),
}


def outer_ledger_worker() -> dict:
    from zeropp import ZeroEngine
    from zeropp.app.models.gpt import GPT, GPTConfig
    from zeropp.config.sections import TopologyConfig
    from zeropp.topology import init_topology

    topo = init_topology(TopologyConfig(nodes=2))
    out = {}
    for name, zero in OUTER_SCENARIOS.items():
        torch.manual_seed(0)
        model = GPT(GPTConfig(block_size=16, n_layer=2, n_head=2, d_model=32))
        config = ZeroConfig(**zero, sequence_check_interval=0)
        engine = ZeroEngine(model, torch.optim.AdamW, dict(lr=1e-3), config, topo)
        steps = []
        for step in range(STEPS):
            engine.comm.ledger.reset()
            tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(step))
            engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
            assert engine.step()
            steps.append(engine.comm.ledger.as_dict())
        out[name] = dict(
            steps=steps,
            memory=engine.measured_model_state_bytes,
            shard_numel=sum(u.master.numel() for u in engine.units),
            params=[list(u.layout.numels) for u in engine.units],
        )
    return out


def test_estimate_equals_the_ledger_of_every_step_and_rank_and_the_memory():
    per_rank = run_ranks(outer_ledger_worker, 4, nodes=2)
    for name, zero in OUTER_SCENARIOS.items():
        est = estimate(per_rank[0][name]["params"], 4, 2, ZeroConfig(**zero))
        outer = est.outer_exchange()
        for rank, results in enumerate(per_rank):
            got = results[name]
            assert got["shard_numel"] == est.shard_numel == outer["shard_numel"], (name, rank)
            for step, measured in enumerate(got["steps"], start=1):
                synced = est.synced_after(step)  # the fragments it synchronizes (plain DiLoCo: its one, every H)
                fragmented = ((step - 1) % 2,) if zero.get("outer_fragments") else None
                assert synced == (fragmented or ((0,) if step % EVERY == 0 else ())), (name, step)
                assert measured == est.ledger(rank, synced).as_dict(), (name, rank, step)
            inter = [sum(p[phase]["inter"] for p in s.values() for phase in p) for s in got["steps"]]
            # per sync: the only bytes between nodes, a fragment's at its steps; per step: spread over the H steps
            fragments = outer["fragment_bytes_per_sync_per_rank"]
            assert inter == [sum(fragments[f] for f in est.synced_after(s)) for s in range(1, STEPS + 1)]
            assert sum(fragments) == outer["bytes_per_sync_per_rank"] and len(fragments) == outer["fragments"]
            assert sum(inter) / STEPS == est.ledger(rank).total(link="inter") == outer["bytes_per_step_per_rank"]
            assert got["memory"] == est.model_state_bytes, (name, rank)


# -- without processes -----------------------------------------------------------------------------------


@pytest.mark.unit
def test_the_exchange_over_more_nodes_and_its_refusals():
    units, shard, block = [(2000, False), (4000, False)], 3000, 64  # 8 nodes x 2 ranks: each rank half of each
    fp32 = outer_transfers(units, Layout(16, 8), ZeroConfig(outer_sync_every=5))
    assert [(t.op, t.phase, t.sent, t.crossing) for t in fp32] == [("all_reduce", "step", 2 * 7 * 4 * shard // 8, 1)]
    # quantized: the shard cut into 8 chunks of whole blocks, 6 blocks (384 values) each, the last 72 padding;
    # a chunk is 384 / 2 bytes of int4 codes and 6 scales, 216 bytes: the all-to-all sends 7, the all-gather 7
    int4 = outer_transfers(units, Layout(16, 8), ZeroConfig(outer_sync_every=5, outer_bits=4, outer_block_size=block))
    assert [(t.op, t.phase, t.sent, t.crossing) for t in int4] == [
        ("all_to_all", "step", 7 * 216, 1), ("all_gather", "step", 7 * 216, 1),
    ]  # fmt: skip
    # 4 nodes x 2 ranks, int8: chunks of 12 blocks (768 values), 768 + 4 * 12 bytes; 3 of them each way
    int8 = outer_transfers(units, Layout(8, 4), ZeroConfig(outer_sync_every=5, outer_bits=8, outer_block_size=block))
    assert [t.sent for t in int8] == [3 * 816, 3 * 816]
    # the state beside the masters: anchor and momentum, 8 bytes a value; 9 residual chunks of 384 values
    policy = ZeroConfig(outer_sync_every=5, outer_bits=4, outer_block_size=block).outer
    assert outer_state_bytes(shard, policy, 8) == 8 * 3000 + 4 * 9 * 384
    assert outer_state_bytes(shard, ZeroConfig(outer_sync_every=5).outer, 8) == 8 * 3000
    # three fragments of one unit each: chunks of 1000 / 8 values rounded up to 2 blocks, 9 residual chunks each
    streamed = ZeroConfig(outer_sync_every=5, outer_bits=4, outer_block_size=block, outer_fragments=3).outer
    assert outer_state_bytes([1000, 1000, 1000], streamed, 8) == 8 * 3000 + 3 * 4 * 9 * 128
    # the exchange of each fragment alone (the first unit, then the second); None: every fragment's in turn
    two = ZeroConfig(outer_sync_every=5, outer_fragments=2)
    assert [t.sent for t in outer_transfers(units, Layout(16, 8), two, 0)] == [2 * 7 * 4 * 1000 // 8]
    assert [t.sent for t in outer_transfers(units, Layout(16, 8), two, 1)] == [2 * 7 * 4 * 2000 // 8]
    assert [t.sent for t in outer_transfers(units, Layout(16, 8), two)] == [
        2 * 7 * 4 * 1000 // 8,
        2 * 7 * 4 * 2000 // 8,
    ]
    # stages 1-2 (every unit resident): the new weights are gathered again inside the node, in the compute dtype
    stage1 = outer_transfers([(2000, True)], Layout(16, 8), ZeroConfig(stage=1, precision="bf16", outer_sync_every=5))
    assert [(t.op, t.sent, t.crossing) for t in stage1[1:]] == [("all_gather", 2 * 2000 // 2, 0)]
    assert outer_transfers(units, Layout(4, 1), ZeroConfig(outer_sync_every=5)) == []  # one node: plain zeropp
    assert estimate(2**16, 4, 1, ZeroConfig(outer_sync_every=5)).outer_exchange() is None
    with pytest.raises(ConfigError, match=r"^zero.outer_sync_every = 5: DiLoCo steps the shards of element-wise"):
        estimate(2**16, 4, 2, ZeroConfig(outer_sync_every=5), whole_parameters=True)
    with pytest.raises(ConfigError, match=r"^zero.outer_fragments = 3: a fragment is whole units and 2 unit"):
        estimate([2000, 4000], 4, 2, ZeroConfig(outer_sync_every=5, outer_fragments=3))


@pytest.mark.unit
def test_cli_prices_a_diloco_run(capsys, tmp_path):
    out = tmp_path / "diloco.json"
    argv = ["--preset", "small", "--world", "8", "--nodes", "2", "--stage", "3", "--outer-sync-every", "50"]
    assert main([*argv, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "ZeRO over each node's 4 data-parallel ranks" in text and "every 50 steps an fp32 all-reduce" in text
    assert "per sync 1.85 MB per rank (7.42 MB per node); per step 37.1 kB per rank (148 kB per node)" in text
    result, units = json.loads(out.read_text()), gpt_unit_numels(ModelConfig(preset="small"))
    est = estimate(units, 8, 2, ZeroConfig(stage=3, outer_sync_every=50))
    shard = est.shard_numel
    assert shard == est.padded_psi // 4  # every unit sharded over one node's 4 ranks
    assert result["outer_exchange"] == {
        "sync_every": 50, "bits": 0, "shard_numel": shard,
        "fragments": 1, "fragment_bytes_per_sync_per_rank": [ring_bytes(4 * shard, 2, 2)],
        "bytes_per_sync_per_rank": ring_bytes(4 * shard, 2, 2), "node_bytes_per_sync": 4 * ring_bytes(4 * shard, 2, 2),
        "bytes_per_step_per_rank": ring_bytes(4 * shard, 2, 2) / 50,
        "node_bytes_per_step": 4 * ring_bytes(4 * shard, 2, 2) / 50, "intra_node_bytes_per_sync_per_rank": 0,
    }  # fmt: skip
    # nothing of the step crosses a node: the exchange, spread over 50 steps, is all its inter-node bytes
    assert result["inter_node_bytes_per_step"] == result["ledger"]["all_reduce"]["step"]["inter"] == 4 * shard / 50
    assert result["hpz_group_size"] == 1 and result["data_parallel_size"] == 8
    # memory: ZeRO-3 over the node's 4 ranks, the anchor and the outer momentum 8 more bytes a parameter
    policy = ZeroConfig(outer_sync_every=50).outer
    expected = sum(analytic_model_state_bytes(u.padded, 4, 3, "fp32", outer=(policy, 2)) for u in est.units)
    assert result["model_state_bytes_per_rank"] == expected == 24 * shard
    assert result["zero3_inter_node_bytes_per_step"] > 100 * result["inter_node_bytes_per_step"]  # 0.008x
    assert main([*argv, "--outer-sync-every", "-1"]) == 2
    assert capsys.readouterr().err == (
        "zeropp estimate: error: --outer-sync-every = -1 is not allowed; expected an integer >= 0 (0: off)\n"
    )


@pytest.mark.unit
def test_cli_prices_streaming_diloco(capsys, tmp_path):
    out = tmp_path / "streaming.json"
    argv = ["--preset", "small", "--world", "8", "--nodes", "2", "--stage", "3", "--outer-sync-every", "50"]
    assert main([*argv, "--outer-fragments", "4", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    result, units = json.loads(out.read_text()), gpt_unit_numels(ModelConfig(preset="small"))
    est = estimate(units, 8, 2, ZeroConfig(stage=3, outer_sync_every=50, outer_fragments=4))
    exchange = result["outer_exchange"]
    assert exchange["fragments"] == 4 and "  fragments" in text and "staggered over the 50 steps" in text
    # the fp32 exchange is linear in the values: the fragments' syncs add up to plain DiLoCo's one, per step too
    plain = estimate(units, 8, 2, ZeroConfig(stage=3, outer_sync_every=50)).outer_exchange()
    assert sum(exchange["fragment_bytes_per_sync_per_rank"]) == exchange["bytes_per_sync_per_rank"]
    assert exchange["bytes_per_sync_per_rank"] == plain["bytes_per_sync_per_rank"]
    assert exchange["bytes_per_step_per_rank"] == plain["bytes_per_step_per_rank"]
    assert est.ledger(0).total(link="inter") == pytest.approx(plain["bytes_per_step_per_rank"], rel=1e-12)
    # each fragment's sync sends about a quarter of the whole one (whole units, balanced by numel)
    assert max(exchange["fragment_bytes_per_sync_per_rank"]) < 0.4 * plain["bytes_per_sync_per_rank"]
    assert [t for t in range(1, 51) if est.synced_after(t)] == [12, 25, 37, 50]
    assert main([*argv, "--outer-fragments", "51"]) == 2
    assert capsys.readouterr().err.startswith(
        "zeropp estimate: error: --outer-fragments = 51 is not allowed; expected at most"
    )
