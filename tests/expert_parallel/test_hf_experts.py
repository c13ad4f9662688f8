"""Expert parallelism on Hugging Face mixture-of-experts models, through transformers' experts
interface: tiny Mixtral, Qwen2-MoE and DeepSeek-V3 (a shared expert beside the routed ones), Qwen3-MoE
and OLMoE train the weights and losses of one process at E 2 (world 2) and E 2 x data parallel 2
(world 4), ZeRO-3, fp32; each rank holds half of every layer's experts."""

from __future__ import annotations

import pytest
import torch
from launcher import run_ranks
from zoo import OPTIM, zoo_batch, zoo_loss, zoo_model, zoo_reference

pytest.importorskip("transformers")

STEPS, TOLERANCE = 3, 1e-5
MODELS = ("mixtral", "qwen2-moe", "qwen3-moe", "olmoe", "deepseek-v3")


def hf_experts_worker() -> dict:
    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.config.sections import TopologyConfig
    from zeropp.expert_parallel.apply import hf_experts
    from zeropp.topology import init_topology

    topology = init_topology(TopologyConfig(expert_parallel_size=2))
    rank, world, out = topology.rank, topology.world_size, {}
    for name in MODELS:
        engine = ZeroEngine(zoo_model(name), torch.optim.AdamW, OPTIM, ZeroConfig(stage=3, prefetch=2), topology)
        losses = []
        for step in range(STEPS):
            loss = zoo_loss(engine, zoo_batch(step, world).chunk(world)[rank])
            engine.backward(loss)
            assert engine.step()
            losses.append(loss.item())
        held = [tuple(p.shape) for m in hf_experts(engine.module) for p in m.parameters()]
        out[name] = dict(state=engine.full_state_dict(), losses=losses, held=held)
    return out


@pytest.mark.parametrize("world", [2, 4], ids=["e2", "e2xdp2"])
def test_hugging_face_experts_train_as_one_process(world):
    per_rank = run_ranks(hf_experts_worker, world)
    for name in MODELS:
        ref, ref_losses = zoo_reference(name, STEPS, world)
        for result in (r[name] for r in per_rank):
            error = max((result["state"][k].float() - ref[k]).abs().max().item() for k in ref)
            assert error <= TOLERANCE, (name, error)
            assert all(shape[0] == 2 for shape in result["held"]), (name, result["held"])  # 2 of 4 experts
        for step in range(STEPS):
            mean = sum(r[name]["losses"][step] for r in per_rank) / world
            assert mean == pytest.approx(sum(ref_losses[step]) / world, rel=1e-5), (name, step)
