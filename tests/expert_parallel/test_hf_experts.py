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


def forced_mixtral():
    """Mixtral with transformers' eager experts (which return unconnected zeros for no rows) and every
    router zero: each token's top 2 are the tied last experts, 2 and 3, so at E 2 rank 0's experts
    get no rows at all."""
    model = zoo_model("mixtral")
    model.config._experts_implementation = "eager"
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.zero_()
    return model


def edge_worker(folder: str) -> dict:
    from zeropp import ZeroConfig, ZeroEngine, load_pretrained
    from zeropp.config.sections import TopologyConfig
    from zeropp.topology import init_topology

    topology = init_topology(TopologyConfig(expert_parallel_size=2))
    rank, world, out = topology.rank, topology.world_size, {}
    model = forced_mixtral()
    optimizer = torch.optim.AdamW(model.parameters(), **OPTIM)  # an optimizer object, built before the split
    engine = ZeroEngine(model, optimizer, None, ZeroConfig(stage=3, sequence_check_interval=1), topology)
    for step in range(STEPS):
        engine.backward(zoo_loss(engine, zoo_batch(step, world).chunk(world)[rank]))
        assert engine.step()
    out["forced"] = engine.full_state_dict()
    pretrained = ZeroEngine(zoo_model("mixtral", seed=1), torch.optim.AdamW, OPTIM, ZeroConfig(stage=3), topology)
    load_pretrained(pretrained, folder)  # each rank reads its own experts' rows
    out["loaded"] = pretrained.full_state_dict()
    return out


def test_no_rows_for_a_ranks_experts_an_optimizer_object_and_pretrained_weights(tmp_path):
    from safetensors.torch import save_file

    saved = zoo_model("mixtral", seed=2)  # its own keys, the experts stacked (save_pretrained writes them per expert)
    save_file({k: v.contiguous() for k, v in saved.state_dict().items()}, tmp_path / "w.safetensors")
    results = run_ranks(edge_worker, 2, folder=str(tmp_path / "w.safetensors"))
    ref, _ = zoo_reference("mixtral", STEPS, 2, model=forced_mixtral())
    for result in results:
        error = max((result["forced"][k].float() - ref[k]).abs().max().item() for k in ref)
        assert error <= TOLERANCE, error
        assert all(torch.equal(result["loaded"][k], v) for k, v in saved.state_dict().items())
