"""zeropp estimate: the papers' published numbers, zeropp's own byte models, and the engine's ledger.

Published values: ZeRO (Rajbhandari et al., arXiv 1910.02054) Table 1, Table 2, §7's and §8's
examples with model parallelism, and (SC20 version) ZeRO-R's Pa example (§6.1, Table 4's 100B
model) and communication analysis (§8); ZeRO++ (Wang et al., arXiv 2306.10209) Table 1 and the hpZ
memory example of section 3.2.2 / Fig. 4.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from launcher import run_ranks

from zeropp import tensor_parallel
from zeropp.comm.ledger import ring_bytes
from zeropp.comm.volume import zero3_step_bytes
from zeropp.config import ConfigError, LossScaleConfig, ModelConfig, ZeroConfig
from zeropp.estimate import (
    ZERO_TABLE_DP,
    ZEROPP_SWITCHES,
    estimate,
    gpt_activations,
    gpt_unit_numels,
    hpz_example,
    main,
    max_model_table,
    mp_example,
    pa_example,
    paper_gb,
    parse_bandwidth,
    trillion_example,
    zero_table,
    zeropp_table,
)
from zeropp.memory import Activations
from zeropp.models.gpt import PRESETS
from zeropp.topology import Layout

# -- ZeRO Table 1 ------------------------------------------------------------------------------------

# per-device GB of model states as printed, rows DP 1, 4, 16, 64, 256, 1024 (every cell of the table)
ZERO_TABLE_1 = {
    "7.5B": {
        "Pos": ("120", "52.5", "35.6", "31.4", "30.4", "30.1"),
        "Pos+g": ("120", "41.3", "21.6", "16.6", "15.4", "15.1"),
        "Pos+g+p": ("120", "30", "7.5", "1.88", "0.47", "0.12"),
    },
    "128B": {
        "Pos": ("2048", "896", "608", "536", "518", "513"),
        "Pos+g": ("2048", "704", "368", "284", "263", "257"),
        "Pos+g+p": ("2048", "512", "128", "32", "8", "2"),
    },
    "1T": {
        "Pos": ("16000", "7000", "4750", "4187", "4046", "4011"),
        "Pos+g": ("16000", "5500", "2875", "2218", "2054", "2013"),
        "Pos+g+p": ("16000", "4000", "1000", "250", "62.5", "15.6"),
    },
}


def test_zero_table_1_every_published_cell():
    computed = zero_table()
    cells = 0
    for model, stages in ZERO_TABLE_1.items():
        for stage, column in stages.items():
            for n, published in zip(ZERO_TABLE_DP, column, strict=True):
                gb, what = computed[model][stage][n], f"{model} {stage} DP {n}"
                assert paper_gb(gb) == published, f"{what}: {gb} GB prints as {paper_gb(gb)}, paper {published}"
                # and independently of the rounding rule: within the last printed digit (cut, from 100 GB on)
                digit = 1.0 if gb >= 100 else 0.1 if gb >= 10 else 0.01
                assert 0 <= gb - float(published) < digit if gb >= 100 else abs(gb - float(published)) <= digit / 2
                cells += 1
    assert cells == 54
    # the worked examples of the text (section 5.1-5.2): 7.5B at Nd = 64
    assert computed["7.5B"]["Pos"][64] == pytest.approx(31.4, abs=0.05)
    assert computed["7.5B"]["Pos+g"][64] == pytest.approx(16.6, abs=0.05)


def test_zero_table_1_with_model_parallelism_16():
    """ZeRO §7: with N_m-way model parallelism each device holds Ψ/N_m, so every cell is Table 1's / 16,
    and P_os+g+p at N_d is 16Ψ/(16 N_d): Table 1's printed cell at DP = 16 N_d."""
    plain, mp16 = zero_table(), zero_table(16)
    for model, stages in mp16.items():
        for stage, cells in stages.items():
            for n, gb in cells.items():
                assert gb == pytest.approx(plain[model][stage][n] / 16, rel=1e-12)
        for n in (1, 4, 16, 64):
            published = ZERO_TABLE_1[model]["Pos+g+p"][ZERO_TABLE_DP.index(16 * n)]
            assert paper_gb(stages["Pos+g+p"][n]) == published, (model, n)


def test_zero_section_7_example_32b_with_mp16_dp64():
    """'a 32 B parameter with 16-way model parallelism and 64-way data parallelism will consume 8.4GB,
    4.4GB and 0.5GB, with P_os, P_os+g and P_os+g+p respectively, while without using ZeRO, it would
    consume at least 32GB'."""
    gb = mp_example()
    assert {name: round(v, 1) for name, v in gb.items()} == {"Baseline": 32.0, "Pos": 8.4, "Pos+g": 4.4, "Pos+g+p": 0.5}


# ZeRO Table 2 (left): the largest model on 32 GB V100s with MP x 64-way DP, as printed
ZERO_TABLE_2 = {
    1: ("2B", "7.6B", "14.4B", "128B"),
    2: ("4B", "15.2B", "28.8B", "256B"),
    4: ("8B", "30.4B", "57.6B", "0.5T"),
    8: ("16B", "60.8B", "115.2B", "1T"),
    16: ("32B", "121.6B", "230.4B", "2T"),
}


def test_zero_table_2_largest_model_with_model_parallelism():
    ours = max_model_table()
    for mp, published in ZERO_TABLE_2.items():
        row = list(ours[mp].values())
        printed = [float(p[:-1]) * (1e12 if p.endswith("T") else 1e9) for p in published]
        assert row[0] == printed[0] == 2e9 * mp  # baseline: 16Ψ/N_m <= 32 GB
        # P_os and P_os+g: the paper prints its MP = 1 figure, cut to 0.1B, times MP
        for column in (1, 2):
            cut = math.floor(ours[1][list(ours[1])[column]] / 1e8) / 10
            assert round(cut * mp, 1) == printed[column] / 1e9, (mp, column)
            assert abs(row[column] - printed[column]) < 0.1e9 * mp
        # P_os+g+p: 16Ψ/(64 N_m) <= 32 GB, Ψ = 128B x N_m; the paper rounds to one figure in T from 0.5T
        assert row[3] == 128e9 * mp
        assert float(f"{row[3] / 1e12:.1g}") == printed[3] / 1e12 if mp >= 4 else row[3] == printed[3]


def test_a_trillion_parameters_on_1024_gpus_with_mp16_dp64():
    """ZeRO §8: 'ZeRO could fit more than 1 Trillion parameters on 1024 GPUs with 16-way model
    parallelism (within each DGX2 node) and 64-way data parallelism across nodes': only P_os+g+p fits a
    32 GB V100, at Table 1's 1T cell for 1024 devices (16Ψ / 1024 = 15.6 GB)."""
    got = trillion_example()
    assert (got["gpus"], got["mp"], got["dp"]) == (1024, 16, 64)
    assert got["fits"] == {"Baseline": False, "Pos": False, "Pos+g": False, "Pos+g+p": True}
    padded = math.ceil(10**12 / 16 / (64 * 32)) * 64 * 32  # this rank's Ψ/16, padded for 64 shards
    used = got["bytes_per_gpu"]
    assert used["Pos+g+p"] == 16 * padded / 64
    assert paper_gb(used["Pos+g+p"] / 1e9) == ZERO_TABLE_1["1T"]["Pos+g+p"][-1] == "15.6"
    assert used["Baseline"] == 16 * 10**12 / 16  # stage 0 shards nothing: Ψ/16 pads to 32 elements only
    assert paper_gb(used["Pos"] / 1e9) == "261"  # (4 + 12/64) x 62.5 GB: P_os alone does not fit
    assert max_model_table()[16]["Pos+g+p"] >= 2e12  # Table 2: up to 2T at MP 16


def test_gpt_units_on_one_tensor_parallel_rank():
    """Megatron's layout: per block, qkv and the MLP's first linear split with their biases, the output
    projections' weights split and biases whole, layer norms whole; the root (embeddings, ln_f) whole."""
    model = ModelConfig(preset="small")
    d, layers = PRESETS["small"].d_model, PRESETS["small"].n_layer
    whole = gpt_unit_numels(model)
    for tp in (2, 4):
        local = gpt_unit_numels(model, tp)
        assert local[:-1] == [(12 * d * d + 7 * d) // tp + 6 * d] * layers
        assert local[-1] == whole[-1]


def test_paper_rounding_rule():
    assert [paper_gb(x) for x in (513.5, 4187.5, 41.25, 1.875, 0.46875, 7.5, 2.0, 62.5, 15.625)] == [
        "513", "4187", "41.3", "1.88", "0.47", "7.5", "2", "62.5", "15.6",
    ]  # fmt: skip


# -- ZeRO++ Table 1 and the hpZ example --------------------------------------------------------------

SCALES_INT8 = 4 / 256  # fp32 scale bytes per element, blocks of 256: relative to int8 data, 1/64


def test_zeropp_table_1_per_phase_at_64_nodes_x_8():
    table = zeropp_table(nodes=64, ranks_per_node=8)
    zero3, zpp = table["rows"]["ZeRO-3"]["inter"], table["rows"]["ZeRO++"]["inter"]
    ring = 511 / 512  # a ring over W ranks sends (W-1)/W of the buffer: per node, M (W-1)/W
    assert zero3 == pytest.approx([ring] * 3, rel=1e-9)  # paper: M, M, M
    forward, backward, gradients, total = table["ratios"]
    # qwZ: int8 data (0.5M) plus one fp32 scale per 256 values: 0.5 (1 + 1/64)
    assert forward == pytest.approx(0.5 * (1 + SCALES_INT8), rel=1e-6)
    assert backward == 0 == zpp[1]  # hpZ: the backward gather stays inside the node
    # qgZ: the paper's 0.25M counts M/Z per machine; ours sends (Y-1)/Y of it (a node keeps its own
    # slice) plus the scales (int4: 4 bytes per 128 data bytes), against the ring's (W-1)/W
    paper_accounting = (63 / 64) * 0.25 * (1 + 4 / 128)
    assert zpp[2] == pytest.approx(paper_accounting, rel=1e-6)
    assert gradients == pytest.approx(paper_accounting / ring, rel=1e-6)
    assert gradients == pytest.approx(0.25, rel=0.05) and total == pytest.approx(0.25, rel=0.05)  # 3M -> 0.75M
    assert sum(zpp) == pytest.approx(0.75, rel=0.02)


def test_qgz_cross_node_share_approaches_a_quarter_as_nodes_grow():
    ratios = [zeropp_table(nodes, 8, 10**9)["ratios"][2] for nodes in (2, 4, 16, 64, 256)]
    assert ratios == sorted(ratios)
    assert ratios[0] == pytest.approx((1 / 2) / (15 / 16) * 0.25 * (1 + 4 / 128), rel=1e-5)  # 2 nodes: 0.14
    limit = 0.25 * (1 + 4 / 128)  # int4 + scales, no self-share left
    assert ratios[-1] == pytest.approx(limit, rel=0.005)
    assert abs(ratios[-2] / 0.25 - 1) < 0.05


def test_hpz_example_fig_4():
    """100B on 64 DGX-2 nodes x 16 V100 (P = 1024), secondary group of one node (alpha = 64 groups):
    DP (2+2+K)M, ZeRO-3 (2+2+K)M/P, hpZ (2+2+K)M/P + 2M alpha/P, with K = 12. The paper says hpZ uses
    8.9x ZeRO-3's memory and 114x less than DP; the formula gives 9.0x and 113.8x."""
    got = hpz_example()
    assert got["hpz_group_size"] == 16
    assert (got["dp_bytes"], got["zero3_bytes"], got["hpz_bytes"]) == (1.6e12, 1.5625e9, 14.0625e9)
    assert round(got["dp_over_hpz"]) == 114
    assert got["hpz_over_zero3"] == 9.0 == 1 + 2 * 64 / 16  # paper: 8.9 (Fig. 4's own figures are an image)


# -- ZeRO-R: partitioned activation checkpoints (SC20 §6.1, §8) ----------------------------------------


def test_pa_example_sc20_section_6_1():
    """'Consider training a 100B model shown in Table 4 with a batch size of 32, sequence length of 1024
    and a MP degree of 16. If we checkpoint a single activation for each transformer layer, it would
    require about 33 GB of memory per GPU [...] with Pa [...] about 2 GB per GPU [...] offloaded to the
    CPU reducing the memory footprint for activations to nearly zero.' Table 4: 100B = 125 layers of
    hidden 8192. The paper's 33 and 2 are the element counts (b s h L = 33.55G, /16 = 2.10G); in fp16
    bytes they are twice that, 67.1 GB = 62.5 GiB, which is §3.2's 'a GPT-like model with 100 billion
    parameters requires around 60 GB of memory for batch size 32, even when using activation
    checkpointing'."""
    got = pa_example()
    assert abs(got["params"] / 1e11 - 1) < 0.01  # 12 h^2 L = 100.7B
    elements, stored = got["checkpoint_elements"], got["checkpoint_bytes"]
    assert elements["without Pa"] == 32 * 1024 * 8192 * 125 and int(elements["without Pa"] / 1e9) == 33
    assert elements["Pa"] * 16 == elements["without Pa"] and round(elements["Pa"] / 1e9) == 2
    assert stored["without Pa"] == 2 * elements["without Pa"] and round(stored["without Pa"] / 2**30, -1) == 60
    assert stored["Pa"] * 16 == stored["without Pa"]  # Pa divides by the MP degree
    assert stored["Pa+cpu"] == 0 and stored["Pa+cpu host"] == stored["Pa"]


def test_pa_adds_under_a_tenth_to_tensor_parallel_traffic():
    """SC20 §8: per block, Megatron with checkpointing all-reduces b s h six times (12 b s h moved), Pa
    all-gathers it once (b s h): 1/12 < 1/10. In the ring model both carry (t-1)/t."""
    got = pa_example()
    bsh, ring = 32 * 1024 * 8192 * 2, 15 / 16
    assert got["pa_bytes_per_step"] == 125 * bsh * ring
    assert got["tensor_parallel_bytes_per_step"] == 125 * 12 * bsh * ring
    assert got["pa_over_tensor_parallel"] == 1 / 12 < 0.1


@pytest.mark.parametrize("tp", [2, 4])
def test_estimate_activation_checkpoints_and_tensor_parallel_traffic(tp):
    model = ModelConfig(preset="small")
    gpt, micro = PRESETS["small"], 3
    bsh = micro * gpt.block_size * gpt.d_model
    zero = ZeroConfig(stage=3, gradient_accumulation_steps=2)

    def run(**switches):
        acts = gpt_activations(model, micro, **switches)
        return estimate(gpt_unit_numels(model, tp), 8, 2, zero, tensor_parallel=tp, activations=acts)

    plain, checkpointed = run(), run(activation_checkpointing=True)
    pa = run(activation_checkpointing=True, partition_activations=True)
    cpu = run(activation_checkpointing=True, partition_activations=True, cpu_checkpointing=True)
    per_block = tensor_parallel.megatron_bytes_per_block(micro, gpt.block_size, gpt.d_model, tp, 4)
    assert plain.bytes_of("tp") == 2 * gpt.n_layer * per_block  # 2 micro-batches
    assert checkpointed.bytes_of("tp") == plain.bytes_of("tp") * 6 / 4  # recomputation all-reduces again
    assert plain.bytes_of("pa") == checkpointed.bytes_of("pa") == 0
    assert pa.bytes_of("pa") == 2 * gpt.n_layer * ring_bytes(4 * bsh, tp) == pa.bytes_of("tp") / 12
    assert plain.activation_checkpoint_bytes() == 0
    assert checkpointed.activation_checkpoint_bytes() == gpt.n_layer * bsh * 4
    assert pa.activation_checkpoint_bytes() == gpt.n_layer * bsh * 4 // tp
    assert (
        cpu.activation_checkpoint_bytes() == 0
        and cpu.activation_checkpoint_bytes("host") == gpt.n_layer * bsh * 4 // tp
    )
    for est in (plain, checkpointed, pa, cpu):  # all inside a node; ZeRO's bytes as without tensor-parallel traffic
        assert (
            est.ledger().total(op="tp.all_reduce", link="inter")
            == est.ledger().total(op="pa.all_gather", link="inter")
            == 0
        )
        assert est.model_state_bytes == plain.model_state_bytes
    with pytest.raises(
        ConfigError, match="zero.partition_activations = True is not allowed without zero.activation_checkpointing"
    ):
        Activations(1, 1, 1, 1, partition_activations=True)


# -- zeropp's own byte models ---------------------------------------------------------------------------


def test_gpt_units_are_the_engines():
    for preset, config in PRESETS.items():
        numels = gpt_unit_numels(ModelConfig(preset=preset))
        d = config.d_model
        assert numels[:-1] == [12 * d * d + 13 * d] * config.n_layer  # one unit per block, the root last
        assert sum(numels) == config.param_count


@pytest.mark.parametrize("precision,accumulation,threshold", [("fp32", 1, 0), ("bf16", 2, 0), ("bf16", 1, 10**6)])
def test_zero3_estimate_equals_zero3_step_bytes(precision, accumulation, threshold):
    numels = gpt_unit_numels(ModelConfig(preset="small"))
    zero = ZeroConfig(
        stage=3, precision=precision, gradient_accumulation_steps=accumulation, persistence_threshold=threshold
    )
    est = estimate(numels, 4, 2, zero)
    mean = est.ledger()
    baseline = zero3_step_bytes([(u.padded, u.resident) for u in est.units], Layout(4, 2), zero)
    assert est.zero3_bytes() == baseline
    for phase, links in baseline.items():
        for link, expected in links.items():  # the estimate also has the step's grad-norm all-reduce
            got = mean.total(phase=phase, link=link) - mean.total(op="all_reduce", phase=phase, link=link)
            assert got == expected, (phase, link, got, expected)
    assert mean.total(op="all_reduce") == ring_bytes(4, 4, 2)  # one fp32 number, all-reduced


def test_zero_section_7_volumes_and_the_ledger_bounds_of_test_zeropp():
    """Stages 0-2 send 2Ψ per rank and stage 3 3Ψ (x (N-1)/N); ZeRO++ on test_zeropp's GPT stays
    within the bounds that test_ledger_shows_zeropp_table_1_and_hpz_memory asserts on the ledger."""
    psi = 2**20
    sent = {s: estimate(psi, 4, 2, ZeroConfig(stage=s)).ledger() for s in range(4)}
    for stage, ledger in sent.items():
        big = ledger.total() - ledger.total(op="all_reduce", phase="step")
        assert big == (3 if stage == 3 else 2) * 4 * psi * 3 / 4
    model = ModelConfig(preset="tiny", block_size=32)
    numels = gpt_unit_numels(model)
    z3 = estimate(numels, 4, 2, ZeroConfig(stage=3, precision="bf16")).ledger()
    zpp = estimate(numels, 4, 2, ZeroConfig(stage=3, precision="bf16", **ZEROPP_SWITCHES)).ledger()
    overhead = 4 / (2 * 256)
    forward = zpp.total(phase="forward", link="inter") / z3.total(phase="forward", link="inter")
    assert 0.5 <= forward <= 0.5 + overhead + 1e-3
    assert zpp.total(op="all_gather", phase="backward", link="inter") == 0
    gradients = zpp.total(op="all_to_all", link="inter") / z3.total(op="reduce_scatter", link="inter")
    assert 0 < gradients <= 0.25 + overhead / 2


def test_qgz_and_qwz_bytes_by_hand():
    """One unit of 2^16 elements on 2 nodes x 2, bf16, blocks of 256, one bucket, 2 pipeline chunks."""
    zero = ZeroConfig(stage=3, precision="bf16", **ZEROPP_SWITCHES, qgz_pipeline_chunks=2)
    ledger = estimate(2**16, 4, 2, zero).ledger(rank=0)
    shard, chunk = 2**14, 2**13
    # qwZ: int8 shard + 64 scales, ring over 4 ranks; rank 0's successor is on its node
    assert ledger.total(op="all_gather", phase="forward", link="intra") == 3 * (shard + 4 * shard // 256)
    # hpZ: the bf16 weights gathered inside the node (2 ranks)
    assert ledger.total(op="all_gather", phase="backward", link="intra") == 2 * 2**16 // 2
    # qgZ per chunk: hop 1 sends 1 of 2 node-peers 2 rows (4 rows / 2), hop 2 one row to the other node
    row = chunk // 2 + 4 * chunk // 256
    assert ledger.total(op="all_to_all", link="intra") == 2 * (1 * 2 * row)
    assert ledger.total(op="all_to_all", link="inter") == 2 * (1 * row)


def test_time_model_is_the_busiest_link_of_each_kind_without_overlap():
    est = estimate(2**20, 8, 2, ZeroConfig(stage=3))
    ring = ring_bytes(4 * 2**20, 8)
    edge, inner = est.ledger(rank=3), est.ledger(rank=0)  # local rank 3 of 4 sends every ring off the node
    assert edge.total(link="intra") == 0 and inner.total(link="inter") == 0
    assert est.node_inter_bytes() == edge.total(link="inter") == 3 * ring + ring_bytes(4, 8, 2)
    assert est.busiest_intra_bytes() == inner.total(link="intra")
    seconds = est.seconds(intra_bits_per_s=8e9, inter_bits_per_s=8e6)
    assert seconds["intra"] == pytest.approx(est.busiest_intra_bytes() / 1e9)
    assert seconds["inter"] == pytest.approx(est.node_inter_bytes() / 1e6)
    assert seconds["total"] == seconds["intra"] + seconds["inter"]


def test_parse_bandwidth():
    assert parse_bandwidth("200mbit") == 200e6
    assert parse_bandwidth("100Gbit") == 100e9
    assert parse_bandwidth("1.5kbit/s") == 1500
    assert parse_bandwidth("25GB") == 200e9  # bytes per second
    assert parse_bandwidth("3MB") == 24e6
    for bad in ("200", "fast", "0mbit", "200mbps", "-1gbit"):
        with pytest.raises(Exception, match="is not allowed"):
            parse_bandwidth(bad)


# -- against the engine's ledger on 4 real ranks -------------------------------------------------------

MEASURED_SCENARIOS = {
    "stage0-fp16": dict(stage=0, precision="fp16", loss_scale=LossScaleConfig(initial_scale=256.0)),
    "stage1-bf16-accumulate": dict(stage=1, precision="bf16", gradient_accumulation_steps=2),
    "stage2-fp16": dict(stage=2, precision="fp16", loss_scale=LossScaleConfig(initial_scale=256.0)),
    "zero3-bf16": dict(stage=3, precision="bf16"),
    "zeropp-bf16": dict(stage=3, precision="bf16", **ZEROPP_SWITCHES),
    "zeropp-bf16-two-level-hadamard-loco": dict(
        stage=3, precision="bf16", **ZEROPP_SWITCHES, gradient_intra_node_bits=8, gradient_hadamard=True,
        gradient_error_feedback="loco",
    ),
    "zeropp-fp32-accumulate-resident-root": dict(
        stage=3, gradient_accumulation_steps=2, persistence_threshold=10_000, quantized_weights=True, weight_bits=4,
        weight_quantization="tensor", hpz_partition_size=2, quantized_gradients=True, gradient_bits=8,
        qgz_pipeline_chunks=3, reduce_bucket_numel=1000,
    ),
}  # fmt: skip
MEASURED_NODES = (2, 1, 4)
STEPS = 2


def ledger_worker() -> dict:
    from zeropp import ZeroEngine
    from zeropp.models.gpt import GPT, GPTConfig
    from zeropp.topology import build_topology, init_topology

    first = init_topology()
    out = {}
    for nodes in MEASURED_NODES:  # one process group, three node layouts
        topo = build_topology(Layout(4, nodes), first.rank, first.device)
        for name, zero in MEASURED_SCENARIOS.items():
            torch.manual_seed(0)
            model = GPT(GPTConfig(block_size=16, n_layer=2, n_head=2, d_model=32))
            engine = ZeroEngine(model, torch.optim.AdamW, dict(lr=1e-3), ZeroConfig(**zero), topo)
            engine.comm.ledger.reset()
            for step in range(STEPS):
                for micro in range(engine.config.gradient_accumulation_steps):
                    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(10 * step + micro))
                    engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
                assert engine.step(), "a skipped step sends no updated weights"
            out[nodes, name] = dict(
                ledger=engine.comm.ledger.as_dict(),
                steps=engine.comm.ledger.steps,
                memory=engine.measured_model_state_bytes,
                units=[(u.layout.numel, u.layout.padded_numel, u.resident) for u in engine.units],
            )
    return out


def test_estimate_equals_the_measured_ledger_and_memory_of_every_rank():
    per_rank = run_ranks(ledger_worker, 4, nodes=2)
    for (nodes, name), first in per_rank[0].items():
        est = estimate([numel for numel, _, _ in first["units"]], 4, nodes, ZeroConfig(**MEASURED_SCENARIOS[name]))
        assert [(u.numel, u.padded, u.resident) for u in est.units] == first["units"], name
        measured = []
        for rank, results in enumerate(per_rank):
            got = results[nodes, name]
            assert got["steps"] == STEPS
            per_step = {
                op: {phase: {link: b / STEPS for link, b in links.items()} for phase, links in phases.items()}
                for op, phases in got["ledger"].items()
            }
            assert per_step == est.ledger(rank).as_dict(), f"{nodes} node(s), {name}, rank {rank}"
            assert got["memory"] == est.model_state_bytes, f"{nodes} node(s), {name}, rank {rank}"
            measured.append(per_step)
        mean = est.ledger()
        for phase in ("forward", "backward", "step"):
            for link in ("intra", "inter"):
                got = sum(sum(p.get(phase, {}).get(link, 0) for p in m.values()) for m in measured) / 4
                assert got == mean.total(phase=phase, link=link), (nodes, name, phase, link)


# -- command line ----------------------------------------------------------------------------------------


def test_cli_examples(capsys, tmp_path):
    assert main(["--params", "7.5e9", "--world", "64", "--stage", "3"]) == 0
    assert "model states per rank" in capsys.readouterr().out
    out = tmp_path / "estimate.json"
    argv = [
        "--preset", "small", "--world", "4", "--nodes", "2", "--stage", "3", "--quantized-weights",
        "--hpz-partition-size", "0", "--quantized-gradients", "--precision", "bf16",
        "--inter-node-bandwidth", "200mbit", "--json", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "qwZ int8, hpZ (groups of 2), qgZ int4" in text and "vs ZeRO-3" in text
    result = json.loads(out.read_text())
    est = estimate(
        gpt_unit_numels(ModelConfig(preset="small")), 4, 2, ZeroConfig(stage=3, precision="bf16", **ZEROPP_SWITCHES)
    )
    assert result["model_state_bytes_per_rank"] == est.model_state_bytes
    assert result["inter_node_bytes_per_step"] == est.ledger().total(link="inter")
    assert result["ledger"]["all_gather"]["backward"]["inter"] == 0
    seconds = result["predicted_comm_seconds_per_step"]
    assert seconds["inter"] == pytest.approx(8 * est.node_inter_bytes() / 200e6)
    assert result["bandwidth_bits_per_s"] == {"intra": 100e9, "inter": 200e6}


def test_cli_tensor_parallel_and_zero_r(capsys, tmp_path):
    out = tmp_path / "trillion.json"
    mesh = ["--world", "1024", "--nodes", "64", "--tensor-parallel", "16", "--stage", "3", "--precision", "fp16"]
    assert main(["--params", "1e12", *mesh, "--json", str(out)]) == 0
    assert "64 data-parallel x 16 tensor-parallel" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["model_state_bytes_per_rank"] == trillion_example()["bytes_per_gpu"]["Pos+g+p"]
    assert (result["tensor_parallel_size"], result["data_parallel_size"]) == (16, 64)
    assert result["tensor_parallel_bytes_per_step"] is None and result["activations"] is None  # no shape given
    # SC20 §6.1's 100B model (Table 4), batch 32, sequence 1024, MP 16: Pa's checkpoints and all-gathers
    shape = ["--n-layer", "125", "--d-model", "8192", "--block-size", "1024", "--micro-batch-size", "32"]
    zero_r = ["--activation-checkpointing", "--partition-activations"]
    assert main(["--params", str(12 * 8192**2 * 125), *mesh, *shape, *zero_r, "--json", str(out)]) == 0
    assert "Pa's all-gathers" in capsys.readouterr().out
    result, example = json.loads(out.read_text()), pa_example()
    assert result["activation_checkpoint_bytes_per_rank"] == example["checkpoint_bytes"]["Pa"]
    assert result["tensor_parallel_bytes_per_step"] == example["tensor_parallel_bytes_per_step"]
    assert result["partitioned_activation_bytes_per_step"] * 12 == result["tensor_parallel_bytes_per_step"]
    assert (
        main(["--preset", "small", "--world", "8", "--nodes", "2", "--tensor-parallel", "2", "--json", str(out)]) == 0
    )
    result = json.loads(out.read_text())
    assert result["unit_numels"] == gpt_unit_numels(ModelConfig(preset="small"), 2)
    assert result["ledger"]["tp.all_reduce"]["forward"]["inter"] == 0 and result["tensor_parallel_bytes_per_step"] > 0


def test_cli_tables(capsys, tmp_path):
    out = tmp_path / "tables.json"
    assert main(["--zero-table", "--zeropp-table", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "ZeRO Table 1" in text and "4187" in text and "0.12" in text
    assert "ZeRO++ Table 1" in text and "113.8x" in text
    result = json.loads(out.read_text())
    assert result["hpz_example"]["hpz_over_zero3"] == 9.0
    assert math.isclose(result["zeropp_table_1"]["ratios"][0], 0.5 * (1 + SCALES_INT8), rel_tol=1e-6)
    assert main(["--zeropp-table", "--world", "16", "--ranks-per-node", "4"]) == 0
    assert "4 nodes x 4 ranks" in capsys.readouterr().out
    assert main(["--zero-table", "--tensor-parallel", "16", "--zero-r-example", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "model parallelism 16" in text and "ZeRO Table 2" in text and "fits 32 GB" in text and "0.0833" in text
    result = json.loads(out.read_text())
    assert (
        result["zero_table_1_mp"] == 16 and result["zero_table_1_gb"]["1T"]["Pos+g+p"]["64"] == 1e12 * 16 / 1024 / 1e9
    )
    assert result["zero_r_pa_example"] == pa_example()


@pytest.mark.parametrize(
    "argv,names",
    [
        (["--world", "4", "--stage", "5"], "--stage = 5"),
        (["--world", "4", "--precision", "fp8"], "--precision"),
        (["--world", "4", "--nodes", "3"], "--nodes = 3"),
        (["--world", "0"], "--world"),
        (["--params", "abc", "--world", "4"], "--params"),
        (["--params", "1.5", "--world", "4"], "--params"),
        (["--world", "4", "--inter-node-bandwidth", "200mbps"], "--inter-node-bandwidth"),
        (["--world", "4", "--stage", "2", "--quantized-weights"], "--quantized-weights = True"),
        (["--world", "8", "--nodes", "2", "--hpz-partition-size", "3"], "--hpz-partition-size = 3"),
        (["--world", "8", "--ranks-per-node", "3"], "--ranks-per-node"),
        (["--stage", "3"], "--world"),
        (["--zeropp-table", "--world", "8"], "--nodes"),
        (["--world", "4", "--config", "missing.toml"], "--config"),
        (["--world", "4", "--optimizer-state-bytes", "-1"], "--optimizer-state-bytes"),
        (["--world", "8", "--nodes", "2", "--tensor-parallel", "3"], "--tensor-parallel-size = 3"),
        (["--world", "8", "--tensor-parallel", "8"], "--tensor-parallel-size = 8 is not allowed with --n-head = 4"),
        (
            ["--world", "4", "--partition-activations"],
            "--partition-activations = True is not allowed without --activation",
        ),
        (["--world", "4", "--activation-checkpointing", "--cpu-checkpointing"], "--cpu-checkpointing = True"),
        (["--params", "1e9", "--world", "4", "--activation-checkpointing"], "--n-layer, --d-model, --block-size"),
        (["--params", "1e9", "--world", "4", "--n-layer", "2"], "--d-model, --block-size"),
    ],
)
def test_cli_bad_input_is_one_line_naming_the_flag(capsys, argv, names):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("zeropp estimate: error: ") and names in err, err
    assert "allowed" in err or "expected" in err or "required" in err or "choose from" in err, err
