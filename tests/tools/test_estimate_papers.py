"""The papers' published numbers, recomputed by zeropp estimate's models.

ZeRO (Rajbhandari et al., arXiv 1910.02054): Table 1, also at model parallelism 16, Table 2, §7's
and §8's examples with model parallelism; its SC20 version: ZeRO-R's Pa example (§6.1, Table 4's
100B model) and communication analysis (§8). ZeRO++ (Wang et al., arXiv 2306.10209): Table 1 and
the hpZ memory example of section 3.2.2 / Fig. 4. Derivations and differences: docs/estimate.md.
"""

from __future__ import annotations

import math

import pytest

from zeropp.tools.estimate import (
    ZERO_TABLE_DP,
    hpz_example,
    max_model_table,
    mp_example,
    pa_example,
    paper_gb,
    trillion_example,
    zero_table,
    zeropp_table,
)

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
