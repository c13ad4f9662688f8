"""With fp32 and no quantization every stage trains to the same weights as one process (DESIGN.md 3)."""

from __future__ import annotations

import pytest
import torch
from launcher import run_ranks
from models import ADAM_EPS, STEPS, TOLERANCE, global_batch, loss_of, make_model, reference_state, rows

# (name, model, stage, accumulation, max_grad_norm, extra ZeroConfig fields)
SCENARIOS = [
    *[(f"{kind}-stage{stage}", kind, stage, 1, None, {}) for kind in ("mlp", "gpt") for stage in (0, 1, 2, 3)],
    *[(f"gpt-stage{stage}-accum2-clip", "gpt", stage, 2, 0.05, {}) for stage in (0, 1, 2, 3)],
    (
        "gpt-stage3-small-buckets-prefetch2",
        "gpt",
        3,
        1,
        None,
        dict(reduce_bucket_numel=64, allgather_bucket_numel=64, prefetch=2),
    ),
    ("gpt-stage3-persistent-small-units", "gpt", 3, 1, None, dict(persistence_threshold=2000)),
    *[(f"edge-stage{stage}", "edge", stage, 1, None, {}) for stage in (0, 1, 2, 3)],
]


def train_scenarios(simulated_nodes: int) -> dict[str, float]:
    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.config.sections import TopologyConfig
    from zeropp.topology import init_topology

    topology = init_topology(TopologyConfig(nodes=simulated_nodes))
    world, rank = topology.world_size, topology.rank
    errors = {}
    for name, kind, stage, accumulation, max_norm, extra in SCENARIOS:
        optim_kwargs = dict(lr=1e-2, eps=ADAM_EPS, weight_decay=0.0 if kind == "edge" else 0.01)
        config = ZeroConfig(stage=stage, gradient_accumulation_steps=accumulation, max_grad_norm=max_norm, **extra)
        engine = ZeroEngine(make_model(kind), torch.optim.AdamW, optim_kwargs, config, topology)
        clipped = False
        for step in range(STEPS):
            for micro in range(accumulation):
                x, y = rows(global_batch(kind, step, micro, world), rank)
                engine.backward(loss_of(kind, engine, x, y))
            assert engine.step()
            clipped |= max_norm is not None and engine.last_grad_norm > max_norm
        assert max_norm is None or clipped, f"{name}: clipping never engaged"
        ours = engine.full_state_dict()
        ref = reference_state(kind, STEPS, world, accumulation, max_norm, optim_kwargs)
        assert ours.keys() == ref.keys(), name
        errors[name] = max((ours[k] - ref[k]).abs().max().item() for k in ref)
    return errors


@pytest.mark.parametrize("world,nodes", [(1, 1), (2, 1), (4, 2)], ids=["world1", "world2", "world4-2nodes"])
def test_every_stage_matches_single_process(world, nodes):
    per_rank = run_ranks(train_scenarios, world, nodes=nodes, simulated_nodes=nodes)
    for rank_errors in per_rank:
        bad = {name: err for name, err in rank_errors.items() if not err <= TOLERANCE}
        assert not bad, f"max |w - w_ref| above {TOLERANCE}: {bad}"
    assert len(per_rank[0]) == len(SCENARIOS)


def factory_and_misuse() -> tuple[float, str]:
    from zeropp import ConfigError, ZeroConfig, ZeroEngine
    from zeropp.topology import init_topology

    topology = init_topology()
    optim_kwargs = dict(lr=1e-2, eps=ADAM_EPS, weight_decay=0.01)
    try:
        ZeroEngine(make_model("mlp"), lambda params: torch.optim.SGD(params, lr=0.1), {"lr": 0.1}, None, topology)
        message = "no error"
    except ConfigError as error:
        message = str(error)
    engine = ZeroEngine(
        make_model("mlp"), lambda params: torch.optim.AdamW(params, **optim_kwargs), None, ZeroConfig(stage=3), topology
    )
    for step in range(STEPS):
        engine.backward(loss_of("mlp", engine, *global_batch("mlp", step, 0, 1)))
        engine.step()
    ours, ref = engine.full_state_dict(), reference_state("mlp", STEPS, 1, 1, None, optim_kwargs)
    return max((ours[k] - ref[k]).abs().max().item() for k in ref), message


def test_optimizer_factory_trains_exactly_and_factory_with_kwargs_is_refused():
    error, message = run_ranks(factory_and_misuse, 1)[0]
    assert error <= TOLERANCE
    assert message == "optimizer_kwargs given with an optimizer factory or object; pass them to one or the other"
