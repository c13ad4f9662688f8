"""Checkpoints of an expert-parallel run keep each rank's experts sharded and place them in the whole
stacked weights, so a run saved at E 2 resumes at E 1 and at E 4 (world 2 and 4) and trains on to
the weights of the run that went straight on (the same global batch of 4 rows each step)."""

from __future__ import annotations

import pytest
import torch
from launcher import run_ranks
from models import TOLERANCE, global_batch, rows
from test_experts import OPTIM, moe_model

SAVED_AT, STEPS = 2, 3


def run_worker(folder: str, ep: int, resume: bool, tp: int = 1) -> dict:
    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.checkpoint.dcp import find_latest, load_checkpoint, save_checkpoint
    from zeropp.config.sections import TopologyConfig
    from zeropp.tensor_parallel.apply import parallelize
    from zeropp.topology import init_topology

    topology = init_topology(TopologyConfig(expert_parallel_size=ep, tensor_parallel_size=tp, nodes=1))
    dp = topology.data_parallel  # tensor-parallel ranks read the same rows
    engine = ZeroEngine(parallelize(moe_model(), topology), torch.optim.AdamW, OPTIM, ZeroConfig(stage=3), topology)
    start = 0
    if resume:
        load_checkpoint(engine, find_latest(folder))
        start = SAVED_AT
    for step in range(start, STEPS):
        engine.backward(engine(*rows(global_batch("gpt", step, 0, 2), dp.rank, 4 // dp.size)))
        engine.step()
        if not resume and step + 1 == SAVED_AT:
            save_checkpoint(engine, folder, SAVED_AT)
    return engine.full_state_dict()


@pytest.mark.parametrize("world,ep", [(2, 1), (4, 4), (4, 2)], ids=["to-e1", "to-e4-world4", "to-e2-world4"])
def test_a_checkpoint_saved_at_e2_resumes_at_another_expert_parallel_size(tmp_path, world, ep):
    straight = run_ranks(run_worker, 2, folder=str(tmp_path), ep=2, resume=False)[0]
    for resumed in run_ranks(run_worker, world, folder=str(tmp_path), ep=ep, resume=True):
        error = max((resumed[k] - straight[k]).abs().max().item() for k in straight)
        assert error <= TOLERANCE, error


def hf_save_worker(folder: str) -> dict:
    from zoo import OPTIM as ZOO_OPTIM
    from zoo import zoo_batch, zoo_loss, zoo_model

    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.checkpoint.dcp import save_checkpoint
    from zeropp.config.sections import TopologyConfig
    from zeropp.topology import init_topology

    topology = init_topology(TopologyConfig(expert_parallel_size=2))
    engine = ZeroEngine(zoo_model("mixtral"), torch.optim.AdamW, ZOO_OPTIM, ZeroConfig(stage=3), topology)
    engine.backward(zoo_loss(engine, zoo_batch(0, 2).chunk(2)[topology.rank]))
    engine.step()
    save_checkpoint(engine, folder, 1)
    return engine.full_state_dict()


def test_a_hugging_face_checkpoint_consolidates_to_whole_experts_that_from_pretrained_loads(tmp_path):
    """What ``zeropp export`` writes: the consolidated checkpoint of a Mixtral trained at E 2 holds every
    expert whole, equal to the engine's full state, and transformers loads it as the model."""
    import transformers
    from zoo import zoo_model

    from zeropp.checkpoint.dcp import consolidated_state, find_latest

    whole = run_ranks(hf_save_worker, 2, folder=str(tmp_path / "ckpt"))[0]
    _, state = consolidated_state(find_latest(tmp_path / "ckpt"))
    assert state.keys() == whole.keys()
    assert all(torch.equal(state[k], whole[k]) for k in whole)
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == 4  # every expert
    model = zoo_model("mixtral")
    model.load_state_dict(state)
    model.save_pretrained(tmp_path / "hf")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
