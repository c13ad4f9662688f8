"""The estimator's model against the engine with tensor parallelism: model-state memory, activation
checkpoints and every byte of the ledger per rank, and ZeRO++'s cross-node bytes on the mesh."""

from __future__ import annotations

import torch
from launcher import run_ranks
from models import GPT_TEST, global_batch, loss_of, make_model, rows


def one_step_per_config(configs: dict[str, dict], sequence_parallel: bool = False) -> dict:
    """Two fp32 steps of the embedded GPT split over tp 2 under each ZeroConfig (one launch): the model-state
    bytes the engine measures, its units' numels on this rank, the last step's ledger and its groups, and
    with activation checkpointing the last step's peak checkpoint bytes (device, host)."""
    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.config.sections import TopologyConfig
    from zeropp.tensor_parallel.apply import parallelize
    from zeropp.topology import init_topology

    topology = init_topology(TopologyConfig(tensor_parallel_size=2, sequence_parallel=sequence_parallel))
    dp = topology.data_parallel
    out = {}
    for name, zero in configs.items():
        model = parallelize(make_model("gpt"), topology)
        engine = ZeroEngine(model, torch.optim.AdamW, dict(lr=1e-3), ZeroConfig(**zero), topology)
        for step in range(2):  # the second step's ledger; its memory is measured with the optimizer state made
            engine.comm.ledger.reset()
            x, y = rows(global_batch("gpt", step, 0, dp.size), dp.rank)
            engine.backward(loss_of("gpt", engine, x, y))
            assert engine.step()
        secondary, stored = engine.groups.secondary, engine.last_activation_checkpoints
        out[name] = dict(
            checkpoints=stored and (stored.device_peak_bytes, stored.host_peak_bytes),
            memory=engine.measured_model_state_bytes,
            units=[u.layout.numel for u in engine.units],
            ledger=engine.comm.ledger.as_dict(),
            groups=(engine.groups.intra_node.ranks, engine.groups.inter_node.ranks, secondary and secondary.ranks),
        )
    return out


def estimate_for(world: int, nodes: int, zero: dict, sequence_parallel: bool = False):
    """The estimate of one_step_per_config's step: the test GPT's units on one tp rank, its activations
    under `zero`'s ZeRO-R switches (and sequence parallelism)."""
    from zeropp import ZeroConfig
    from zeropp.config.model import ModelConfig
    from zeropp.tools.estimate import estimate, gpt_activations, gpt_unit_numels
    from zeropp.tools.estimate.cli import ZERO_R_FLAGS

    gpt = ModelConfig(
        n_layer=GPT_TEST.n_layer, n_head=GPT_TEST.n_head, d_model=GPT_TEST.d_model, block_size=GPT_TEST.block_size
    )
    params = gpt_unit_numels(gpt, 2)
    units = [sum(unit) for unit in params]
    switches = {key: zero[key] for key in ZERO_R_FLAGS if key in zero}
    activations = gpt_activations(gpt, 2, sequence_parallel=sequence_parallel, **switches)
    return units, estimate(params, world, nodes, ZeroConfig(**zero), tensor_parallel=2, activations=activations)


def test_model_states_per_rank_are_table_1_on_the_tensor_parallel_share():
    """dp 2 x tp 2 on 2 nodes x 2, stages 0-3: the measured model-state bytes of every rank are ZeRO
    Table 1's formula over the 2 data-parallel ranks with Ψ = this rank's share (split weights / tp +
    the whole ones), and every byte of its ledger is the estimate's (ZeRO's on that share, Megatron's)."""
    from zeropp.costs.memory import analytic_model_state_bytes

    stages = {f"stage{s}": dict(stage=s) for s in (0, 1, 2, 3)}
    per_rank = run_ranks(one_step_per_config, world=4, nodes=2, configs=stages)
    whole = sum(p.numel() for p in make_model("gpt").parameters())
    for name, zero in stages.items():
        units, est = estimate_for(4, 2, zero)
        share = sum(units)
        assert share < whole and 2 * share > whole  # split weights halved, layer norms and embeddings whole
        padded = [u.padded for u in est.units]
        table_1 = sum(analytic_model_state_bytes(p, 2, zero["stage"], "fp32") for p in padded)
        assert abs(table_1 - analytic_model_state_bytes(share, 2, zero["stage"], "fp32")) <= 16 * (sum(padded) - share)
        for rank, results in enumerate(per_rank):
            got = results[name]
            assert got["units"] == units, (name, rank)
            assert got["memory"] == table_1 == est.model_state_bytes, (name, rank)
            assert got["ledger"] == est.ledger(rank).as_dict(), (name, rank)


def test_zero_r_bytes_and_checkpoints_per_rank_are_the_estimates():
    """dp 2 x tp 2 on 2 nodes x 2 with activation checkpointing, Pa and Pa+cpu (+MD): every byte of every
    rank's ledger is the estimate's (zeropp's recomputation: 5 all-reduces per block; Pa's all-gather),
    and the checkpoint bytes it held at peak are the estimate's per rank: on the device without Pa+cpu,
    on the host with it (where the device holds only the 2 pieces staged back in backward)."""
    ac = dict(activation_checkpointing=True)
    pa = dict(ac, partition_activations=True)
    configs = {
        "stage1-AC": dict(stage=1, **ac),
        "stage3-Pa": dict(stage=3, **pa),
        "stage2-Pa+cpu+MD": dict(stage=2, **pa, cpu_checkpointing=True, contiguous_memory_optimization=True),
    }
    per_rank = run_ranks(one_step_per_config, world=4, nodes=2, configs=configs)
    for name, zero in configs.items():
        _, est = estimate_for(4, 2, zero)
        device, host = est.activation_checkpoint_bytes(), est.activation_checkpoint_bytes("host")
        staged = 2 * est.activations.checkpoint_elements(2) * 4 if zero.get("cpu_checkpointing") else 0
        assert est.bytes_of("tp") > 0 and (est.bytes_of("pa") > 0) == zero.get("partition_activations", False)
        for rank, results in enumerate(per_rank):
            got = results[name]
            assert got["ledger"] == est.ledger(rank).as_dict(), (name, rank)
            assert got["checkpoints"] == (device + staged, host), (name, rank)
            assert got["checkpoints"][0 if device else 1] > 0, (name, rank)


def test_sequence_parallel_memory_bytes_and_checkpoints_per_rank_are_the_estimates():
    """dp 2 x tp 2 on 2 nodes x 2 with sequence parallelism, stages 0 and 3, checkpointing with Pa and
    with Pa+cpu+MD: every byte of every rank's ledger is `zeropp estimate --sequence-parallel`'s, the
    model states Table 1's on the same share as without it, the checkpoints 1/tp of each block's input
    with or without Pa."""
    ac = dict(activation_checkpointing=True)
    configs = {
        "stage0": dict(stage=0),
        "stage3-Pa": dict(stage=3, **ac, partition_activations=True),
        "stage2-Pa+cpu+MD": dict(stage=2, **ac, partition_activations=True, cpu_checkpointing=True,
                                 contiguous_memory_optimization=True),
    }  # fmt: skip
    per_rank = run_ranks(one_step_per_config, world=4, nodes=2, configs=configs, sequence_parallel=True)
    whole = GPT_TEST.n_layer * 2 * GPT_TEST.block_size * GPT_TEST.d_model * 4  # every block's input, fp32
    for name, zero in configs.items():
        _, est = estimate_for(4, 2, zero, sequence_parallel=True)
        _, megatron = estimate_for(4, 2, zero)
        assert est.model_state_bytes == megatron.model_state_bytes
        assert est.bytes_of("pa") == 0 and est.bytes_of("tp") > megatron.bytes_of("tp") - megatron.bytes_of("pa")
        device, host = est.activation_checkpoint_bytes(), est.activation_checkpoint_bytes("host")
        assert device + host == (whole // 2 if "Pa" in name else 0)
        staged = 2 * est.activations.checkpoint_elements(2) * 4 if zero.get("cpu_checkpointing") else 0
        for rank, results in enumerate(per_rank):
            got = results[name]
            assert got["ledger"] == est.ledger(rank).as_dict(), (name, rank)
            if "MD" not in name:  # MD's arenas keep the gradient buffers beyond Table 1's
                assert got["memory"] == est.model_state_bytes, (name, rank)
            assert got["checkpoints"] == (None if "Pa" not in name else (device + staged, host)), (name, rank)


def test_zeropp_with_tensor_parallel_sends_at_most_a_quarter_of_zero3_across_nodes():
    """qwZ + hpZ + qgZ with tp 2 on 2 nodes x 4 (8 ranks, fp32): each data-parallel group has 2 ranks per
    node, hpZ's secondary group and qgZ's intra-node hop are those 2, its inter-node hop one rank per
    node; cross-node bytes are at most 1/4 of ZeRO-3's with the same tp, and every rank's ledger is the
    estimate's."""
    from zeropp.config.sections import ZEROPP_SWITCHES

    qwd = dict(stage=3, **ZEROPP_SWITCHES, weight_bits=4, weight_quantization="delta")  # the second step: changes
    configs = {"zero3": dict(stage=3), "zeropp": dict(stage=3, **ZEROPP_SWITCHES), "zeropp-qwd": qwd}
    per_rank = run_ranks(one_step_per_config, world=8, nodes=2, configs=configs)
    inter = {}
    for name, zero in configs.items():
        _, est = estimate_for(8, 2, zero)
        for rank, results in enumerate(per_rank):
            assert results[name]["ledger"] == est.ledger(rank).as_dict(), (name, rank)
            if name == "zeropp-qwd":  # qWD's own rows of the reference beside hpZ's copy
                assert results[name]["memory"] == est.model_state_bytes, rank
        inter[name] = sum(
            links["inter"]
            for results in per_rank
            for phases in results[name]["ledger"].values()
            for links in phases.values()
        )
    intra, across, secondary = per_rank[0]["zeropp"]["groups"]
    assert (intra, across, secondary) == ((0, 2), (0, 4), (0, 2))  # rank 0's data-parallel group is 0, 2, 4, 6
    assert per_rank[3]["zeropp"]["groups"] == ((1, 3), (3, 7), (1, 3))
    ratio, qwd_ratio = inter["zeropp"] / inter["zero3"], inter["zeropp-qwd"] / inter["zero3"]
    print(f"cross-node bytes / ZeRO-3's with tp 2 on 2 nodes x 4 (fp32): ZeRO++ {ratio:.4f}, int4 qWD {qwd_ratio:.4f}")
    assert 0 < qwd_ratio < ratio <= 0.25
