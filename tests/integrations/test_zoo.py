"""A zoo of tiny Hugging Face architectures (dense decoders, two MoE, an encoder-decoder) under zeropp:
stage 3 exact at world 2, ZeRO++ on 2 simulated nodes, and every architecture transformers ships a
tensor-parallel plan for exact at dp 1 x tp 2 and dp 2 x tp 2 through the translated plan, its
tensor-parallel bytes the cost model's. One launch per configuration runs every architecture."""

from __future__ import annotations

import math

import pytest
from launcher import run_ranks
from zoo import ZOO, train_zoo, zoo_model, zoo_reference

from zeropp.config.sections import ZEROPP_SWITCHES

pytest.importorskip("transformers")

STEPS, TOLERANCE = 3, 1e-5
# ZeRO++ quantizes weights (int8: the first step's loss) and gradients (int4, whose noise Adam's
# normalized steps carry into the later losses): its losses stay this close to one process's
ZEROPP_FIRST_LOSS, ZEROPP_LOSS = 0.02, 0.2


@pytest.fixture(scope="module")
def planned() -> list[str]:
    from zeropp.tensor_parallel.hf_plans import has_hf_plan

    return [name for name in ZOO if has_hf_plan(zoo_model(name))]


@pytest.fixture(scope="module")
def references() -> dict[int, dict]:
    """{data-parallel size: {name: (state, losses)}}, computed once for the module."""
    return {dp: {name: zoo_reference(name, STEPS, dp) for name in ZOO} for dp in (1, 2)}


def test_every_architecture_trains_exactly_at_stage_3(references):
    states = {name: state for name, (state, _) in references[2].items()}
    for rank, results in enumerate(run_ranks(train_zoo, 2, names=list(ZOO), references=states, steps=STEPS)):
        for key, result in results.items():
            assert result["error"] <= TOLERANCE, (rank, key, result["error"])


def test_every_architecture_trains_under_zeropp_on_two_nodes(references):
    results = run_ranks(train_zoo, 2, nodes=2, names=list(ZOO), references=None, steps=STEPS, zero=ZEROPP_SWITCHES)
    for rank, per_name in enumerate(results):
        for key, result in per_name.items():
            expected = [chunks[rank] for chunks in references[2][key.split("/")[0]][1]]
            assert all(math.isfinite(loss) for loss in result["losses"]), (rank, key)
            assert abs(result["losses"][0] - expected[0]) <= ZEROPP_FIRST_LOSS, (rank, key, result["losses"], expected)
            assert result["losses"] == pytest.approx(expected, abs=ZEROPP_LOSS), (rank, key, result["losses"], expected)


@pytest.mark.parametrize("world", [2, 4], ids=["dp1xtp2", "dp2xtp2"])
def test_every_translated_plan_is_exact_and_priced(world, planned, references):
    assert len(planned) >= 11
    states = {name: references[world // 2][name][0] for name in planned}
    for rank, results in enumerate(run_ranks(train_zoo, world, names=planned, references=states, steps=STEPS, tp=2)):
        for key, result in results.items():
            assert result["error"] <= TOLERANCE, (rank, key, result["error"])
            # per micro-batch (the step's gradient-norm scalar is no part of a plan)
            assert {k: v for k, v in result["ledger"].items() if v and k[1] != "step"} == result["priced"], (rank, key)
