"""Mixture of experts where routing differs by rank: Mixtral's router forced (by its weights) to send
rank 1's tokens away from expert 0 trains exactly and without a hang at stages 0-3; a grouping that
makes an expert a unit of its own is refused at construction."""

from __future__ import annotations

import pytest
import torch
from launcher import run_ranks
from torch import nn
from zoo import VOCAB, zoo_batch, zoo_loss, zoo_model, zoo_reference

pytest.importorskip("transformers")

STEPS, AVOIDED = 3, 0  # the expert rank 1's tokens never reach


def routed_model() -> nn.Module:
    """Mixtral whose hidden dimension 0 says which half of the vocabulary a token is from (+-10: it
    dominates the normed hidden state), and whose routers score expert 0 by it alone: tokens of the
    lower half always reach expert 0, of the upper half never."""
    model = zoo_model("mixtral")
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = torch.where(torch.arange(VOCAB) < VOCAB // 2, 10.0, -10.0)
        for layer in model.model.layers:
            layer.mlp.gate.weight[:, 0] = 0.0
            layer.mlp.gate.weight[AVOIDED, 0] = 100.0
    return model


def routed_batch(step: int, world: int) -> torch.Tensor:
    """Rank 0's rows from the lower half of the vocabulary, rank 1's from the upper half."""
    tokens = zoo_batch(step, world) % (VOCAB // 2)
    half = tokens.shape[0] // 2
    return torch.cat([tokens[:half].clamp(min=2), tokens[half:] + VOCAB // 2])


def routing_worker(reference: dict) -> dict:
    from zoo import OPTIM

    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.topology import init_topology

    topology = init_topology()
    rank, out = topology.rank, {}
    for stage in (0, 1, 2, 3):
        model, reached = routed_model(), set()
        for layer in model.model.layers:
            layer.mlp.experts.register_forward_hook(
                lambda m, args, o, seen=reached: seen.update(args[1].unique().tolist())
            )
        engine = ZeroEngine(model, torch.optim.AdamW, OPTIM, ZeroConfig(stage=stage), topology)
        for step in range(STEPS):
            engine.backward(zoo_loss(engine, routed_batch(step, 2).chunk(2)[rank]))
            assert engine.step()
        ours = engine.full_state_dict()
        out[stage] = dict(error=max((ours[k] - reference[k]).abs().max().item() for k in reference), reached=reached)
    return out


def test_routing_that_differs_by_rank_trains_exactly_at_every_stage():
    reference = zoo_reference("mixtral", STEPS, 2, model=routed_model(), batch=routed_batch)[0]
    for rank, results in enumerate(run_ranks(routing_worker, 2, reference=reference)):
        for stage, result in results.items():
            assert result["error"] <= 1e-5, (rank, stage, result["error"])
            assert (AVOIDED in result["reached"]) == (rank == 0), (rank, stage, result["reached"])


def test_an_expert_in_a_unit_of_its_own_is_refused_in_one_line():
    from zeropp import ConfigError
    from zeropp.zero.grouping import refuse_expert_units

    model = nn.Module()
    model.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
    refuse_expert_units(model, [model.experts, model])  # the container is called on every rank
    with pytest.raises(ConfigError) as error:
        refuse_expert_units(model, [model.experts[1]])
    assert "\n" not in str(error.value) and "unit experts.1 is not allowed" in str(error.value)
