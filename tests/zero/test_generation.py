"""Generation at stage 3: ``engine.gathered()`` / ``engine.generate`` against the plain model and the
ledger against :func:`zeropp.costs.volume.generation_transfers`."""

from __future__ import annotations

import copy

import pytest
import torch
from launcher import run_ranks
from models import hf_model, make_model

NEW_TOKENS = 6


def generate_worker() -> dict:
    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.costs.volume import generation_transfers
    from zeropp.topology import init_topology

    topology = init_topology()
    torch.manual_seed(0)
    model = hf_model("hf-llama").eval()
    plain = copy.deepcopy(model)
    engine = ZeroEngine(model, torch.optim.AdamW, dict(lr=1e-3), ZeroConfig(stage=3, persistence_threshold=0), topology)
    ids = torch.randint(1, 256, (4, 5), generator=torch.Generator().manual_seed(1))
    kwargs = dict(input_ids=ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    with torch.no_grad():
        expected = plain.generate(**kwargs)
    out, units = {}, [(u.layout.padded_numel, u.resident) for u in engine.units]
    for gathered in (True, False):
        engine.comm.ledger.reset()
        tokens = engine.generate(**kwargs, gathered=gathered)
        transfers = generation_transfers(units, topology.layout, engine.config, 1, NEW_TOKENS, gathered)
        out[gathered] = dict(
            same=torch.equal(tokens, expected),
            bytes=engine.comm.ledger.total(op="all_gather", phase="eval"),
            formula=sum(t.sent for t in transfers),
            sharded=all(u.shard_state.value == "sharded" for u in engine.units),
        )
    with engine.gathered():  # the block holds every unit: the whole model in the compute dtype
        held = sum(u.compute_flat.untyped_storage().nbytes() for u in engine.units)
        expected_held = sum(u.layout.padded_numel * 4 for u in engine.units)
        with torch.no_grad():
            same_inside = torch.equal(model.generate(**kwargs), expected)
    out["held"], out["expected_held"], out["same_inside"] = held, expected_held, same_inside
    return out


def test_gathered_generation_matches_the_plain_model_and_gathers_each_unit_once():
    for result in run_ranks(generate_worker, 2):
        gathered, unit_by_unit = result[True], result[False]
        assert gathered["same"] and unit_by_unit["same"] and result["same_inside"]
        assert gathered["sharded"] and unit_by_unit["sharded"]  # resharded at the block's exit
        assert gathered["bytes"] == gathered["formula"] > 0
        assert unit_by_unit["bytes"] == unit_by_unit["formula"] == NEW_TOKENS * gathered["bytes"]
        assert result["held"] == result["expected_held"]


def zeropp_worker(zero: dict) -> dict:
    """qwZ or hpZ on: both modes give the same tokens, and the ledger matches the formula."""
    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.costs.volume import generation_transfers
    from zeropp.topology import init_topology

    topology = init_topology()
    torch.manual_seed(0)
    config = ZeroConfig(stage=3, persistence_threshold=0, **zero)
    engine = ZeroEngine(hf_model("hf-llama").eval(), torch.optim.AdamW, {}, config, topology)
    ids = torch.randint(1, 256, (4, 5), generator=torch.Generator().manual_seed(1))
    units = [(u.layout.padded_numel, u.resident) for u in engine.units]
    out = {}
    for gathered in (False, True):  # unit by unit first: hpZ's secondary copies are cut then
        engine.comm.ledger.reset()
        for unit in engine.units:  # as after a step: the first gather of each unit goes over the world
            unit.publish_master()
        tokens = engine.generate(
            input_ids=ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, gathered=gathered
        )
        # the first pass is the first gather since construction (qWD: the full weights)
        transfers = generation_transfers(
            units, topology.layout, config, engine.hpz_group_size, NEW_TOKENS, gathered, first=not gathered
        )
        out[gathered] = (
            tokens,
            engine.comm.ledger.total(op="all_gather", phase="eval"),
            sum(t.sent for t in transfers),
        )
    return out


QWD = dict(quantized_weights=True, weight_bits=4, weight_quantization="delta", hpz_partition_size=0)


@pytest.mark.parametrize(
    "zero, world",
    [(dict(quantized_weights=True), 2), (dict(hpz_partition_size=2), 2), (QWD, 4)],
    ids=["qwz", "hpz", "qwd"],
)
def test_with_qwz_or_hpz_both_modes_give_the_same_tokens_and_the_formulas_bytes(zero, world):
    for result in run_ranks(zeropp_worker, world, nodes=world // 2, zero=zero):
        assert torch.equal(result[True][0], result[False][0])
        for _, ledger, formula in result.values():
            assert ledger == formula > 0


def misuse_worker() -> tuple[str, str]:
    from zeropp import ConfigError, ZeroConfig, ZeroEngine
    from zeropp.topology import init_topology

    topology = init_topology()
    engine = ZeroEngine(hf_model("hf-llama"), torch.optim.AdamW, {}, ZeroConfig(stage=3), topology)
    with engine.gathered(), pytest.raises(RuntimeError) as nested, engine.gathered():
        pass
    gpt = ZeroEngine(make_model("gpt"), torch.optim.AdamW, {}, ZeroConfig(stage=3), topology)
    with pytest.raises(ConfigError) as no_generate:
        gpt.generate(torch.zeros(1, 4, dtype=torch.long))
    return str(nested.value), str(no_generate.value)


def test_nested_blocks_and_a_model_without_generate_are_refused_in_one_line():
    nested, no_generate = run_ranks(misuse_worker, 1)[0]
    assert nested == "zeropp: engine.gathered() blocks do not nest"
    assert no_generate == (
        "engine.generate: GPT has no generate method; call your own decoding loop inside engine.gathered()"
    )
