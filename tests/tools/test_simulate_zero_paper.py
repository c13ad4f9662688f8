"""The ZeRO paper's throughput and memory figures against the simulator (docs/simulate.md)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from zeropp.tools.simulate import main
from zeropp.tools.simulate.model import Assumptions
from zeropp.tools.simulate.zero_paper import CELLS, PAPER, samples_per_s, simulate_run, tflops, zero_paper_table

# The paper's figures, pinned to where they are (v1: arXiv 1910.02054v1, ../shared/seeds/001; SC20: the
# SC20 version, its §X and AE appendix). A change to zero_paper.PAPER has to change this too.
PINNED = {
    "sc20.zero100b_8b_100b_pflops": (15.0, "§X.B"),
    "sc20.zero100b_speedup_up_to": (10.0, "§X.B"),
    "sc20.megatron_40b_two_nodes": (5.0, "§I"),
    "sc20.megatron_within_node": (30.0, "§I"),
    "sc20.superlinear_60b": (1.0, "§X.C"),
    "sc20.no_mp_13b_avg": (40.0, "§X.D"),
    "sc20.ddp_1_4b": (20.0, "§X.D"),
    "sc20.turing_nlg": (41.4, "§X.F"),
    "v1.t5.zero_os_8b": (38.0, "Table 5"),
    "v1.t5.zero_os_20b": (27.0, "Table 5"),
    "v1.t5.zero_os_40b": (29.0, "Table 5"),
    "v1.t5.zero_os_60b": (20.0, "Table 5"),
    "v1.t5.zero_os_80b": (17.0, "Table 5"),
    "v1.t5.zero_os_100b": (7.0, "Table 5"),
    "v1.t5.megatron_8b": (23.0, "Table 5"),
    "v1.t5.megatron_20b": (9.0, "Table 5"),
    "v1.t5.megatron_40b_oom": ("OOM", "Table 5"),
    "v1.t5.across_nodes_40b": (4.92, "Table 5"),
    "v1.t5.across_nodes_60b": (6.34, "Table 5"),
    "v1.t5.across_nodes_80b": (4.03, "Table 5"),
    "v1.t5.across_nodes_100b": (2.49, "Table 5"),
    "v1.t6.zero_os_8b": (210.8, "Table 6"),
    "v1.t6.megatron_8b": (129.2, "Table 6"),
    "v1.t6.boost_8b": (1.63, "Table 6"),
    "v1.t6.zero_os_20b": (62.8, "Table 6"),
    "v1.t6.megatron_20b": (21.4, "Table 6"),
    "v1.t6.boost_20b": (2.93, "Table 6"),
    "v1.t6.zero_os_40b": (31.77, "Table 6"),
    "v1.t6.boost_40b": (5.9, "Table 6"),
    "v1.t7.boost_1_5b": (3.75, "Table 7"),
    "v1.t8.zero_os_8b_240": (129.9, "Table 8"),
    "v1.t8.zero_os_20b_128": (24.72, "Table 8"),
    "v1.t4.ddp_1_2b": ("fits", "Table 4"),
    "v1.t4.ddp_1_5b": ("OOM", "Table 4"),
    "v1.t4.zero_os_4b": ("fits", "Table 4"),
    "v1.t4.zero_os_5_9b": ("fits", "Table 4"),
}


@pytest.fixture(scope="module")
def rows():
    return zero_paper_table()


def test_the_papers_numbers_are_pinned_to_their_sources():
    assert {key: (value, quote.split(":")[0].split(",")[0]) for key, (value, quote) in PAPER.items()} == PINNED
    for value, quote in PAPER.values():
        if isinstance(value, float) and value != 1.0:  # the super-linear cell has no number of the paper's
            assert f"{value:g}" in quote.replace("'", ""), quote
    assert {cell.key for cell in CELLS} == set(PAPER)  # every figure is a cell, once
    assert len(CELLS) == len(PAPER)


def test_every_cell_is_computed_or_says_why_not(rows):
    for row in rows:
        if row["unrepresentable"]:
            assert row["simulated"] is None and row["ratio"] is None
            continue
        assert row["memory_gb"] > 0
        if row["quantity"] != "memory":
            assert row["ratio"] == pytest.approx(row["simulated"] / float(row["paper"]))
    simulated = [r for r in rows if r["simulated"] is not None]
    assert len(simulated) >= 20


def test_cells_are_the_simulators_not_stored(rows):
    """A cell is the simulator's value of its configuration, and moves with the assumptions."""
    by_key = {r["key"]: r for r in rows}
    cell = next(c for c in CELLS if c.key == "v1.t5.zero_os_8b")
    assert by_key[cell.key]["simulated"] == pytest.approx(tflops(simulate_run(cell.runs[0], Assumptions())))
    cell = next(c for c in CELLS if c.key == "v1.t6.boost_20b")
    ratio = samples_per_s(simulate_run(cell.runs[0], Assumptions())) / samples_per_s(
        simulate_run(cell.baseline[0], Assumptions())
    )
    assert by_key[cell.key]["simulated"] == pytest.approx(ratio)
    slower = {r["key"]: r for r in zero_paper_table(dataclasses.replace(Assumptions(), compute_efficiency=0.3))}
    assert slower["v1.t5.zero_os_8b"]["simulated"] < by_key["v1.t5.zero_os_8b"]["simulated"]


def test_configurations_follow_the_paper():
    cell = next(c for c in CELLS if c.key == "v1.t6.zero_os_8b")
    (run,) = cell.runs
    sim = simulate_run(run, Assumptions())
    assert (run.mp, run.gpus // run.mp, run.batch) == (4, 100, 24)  # "4x100,bsz=24"
    assert sim.tensor_parallel == 4 and sim.tokens_per_gpu * 4 == 24 * 1024
    assert dict(sim.zero) == {"stage": 1}
    zero_100b = next(c for c in CELLS if c.key == "sc20.zero100b_8b_100b_pflops")
    assert [r.params // 10**9 for r in zero_100b.runs] == [8, 19, 39, 59, 80, 100]
    assert all(dict(simulate_run(r, Assumptions()).zero) == {"stage": 2} for r in zero_100b.runs[:1])


def test_partitioned_activations_cut_the_checkpoints():
    cell = next(c for c in CELLS if c.key == "sc20.superlinear_60b")
    run = cell.runs[-1]
    with_pa = simulate_run(run, Assumptions())
    without = simulate_run(dataclasses.replace(run, system="zero-os"), Assumptions())
    assert with_pa.memory["activation_checkpoints"] * 16 == pytest.approx(
        without.memory["activation_checkpoints"], rel=1e-3
    )
    assert with_pa.tensor_parallel_s["backward"] > 0


def test_cli_prints_the_table(capsys):
    assert main(["--zero-paper-table", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["zero_paper"]
    assert len(rows) == len(CELLS)
    assert main(["--zero-paper-table"]) == 0
    out = capsys.readouterr().out
    assert "| v1 Table 5 | ZeRO-OS 8B |" in out and "not simulated" in out
