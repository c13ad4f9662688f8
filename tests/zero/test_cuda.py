"""The engine's CUDA-only branches, on one GPU (skipped without CUDA; ``pytest -m gpu``, ``zeropp bench gpu``).

Each test runs one rank in a spawned process (NCCL, cuda:0). The workers return facts and weights so
the assertions stay here; on CPU they run on gloo too (how they were developed).
"""

from __future__ import annotations

import pytest
import torch
from launcher import run_ranks
from models import global_batch, loss_of, make_model, rows
from test_exactness import ADAM_EPS

pytestmark = pytest.mark.gpu

STEPS, LR = 5, 1e-2
OPTIM = dict(lr=LR, eps=ADAM_EPS, weight_decay=0.01)


def _on(device: torch.device, batch: tuple) -> tuple:
    return tuple(t.to(device) for t in batch)


def plain_state(device: torch.device) -> dict[str, torch.Tensor]:
    """Plain PyTorch on `device`: the weights after STEPS AdamW steps on the world-1 batches."""
    model = make_model("gpt").to(device)
    optimizer = torch.optim.AdamW(model.parameters(), **OPTIM)
    for step in range(STEPS):
        optimizer.zero_grad()
        loss_of("gpt", model, *_on(device, global_batch("gpt", step, 0, 1))).backward()
        optimizer.step()
    return {k: v.detach().float().cpu() for k, v in model.state_dict().items()}


def train_engine(topology, steps: int = STEPS, **zero) -> tuple:
    """A stage-3 engine on the topology's device after `steps` steps: (engine, weights, losses)."""
    from zeropp import ZeroConfig, ZeroEngine

    device = topology.device
    engine = ZeroEngine(make_model("gpt").to(device), torch.optim.AdamW, OPTIM, ZeroConfig(stage=3, **zero), topology)
    losses = []
    for step in range(steps):
        x, y = _on(device, rows(global_batch("gpt", step, 0, 1), 0))
        loss = loss_of("gpt", engine, x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return engine, {k: v.float().cpu() for k, v in engine.full_state_dict().items()}, losses


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in b)


def stage3_worker() -> dict:
    from zeropp.topology import init_topology

    topology = init_topology()
    _, ours, _ = train_engine(topology)
    return {"device": topology.device.type, "diff": max_diff(ours, plain_state(topology.device))}


def test_stage3_on_cuda_trains_like_plain_pytorch():
    result = run_ranks(stage3_worker, 1, start="spawn")[0]
    assert result["device"] == "cuda" and result["diff"] <= 1e-5, result


def qwz_stream_worker() -> dict:
    """qwZ gathers on its side stream: offloaded parameters keep the units gathered at world 1."""
    from zeropp.topology import init_topology

    topology = init_topology()
    offload = dict(offload_optimizer="cpu", offload_params="cpu")
    engine, quantized, losses = train_engine(topology, quantized_weights=True, **offload)
    _, plain, plain_losses = train_engine(topology, **offload)
    stream = engine.units[0].options.quant_stream
    return {
        "stream": type(stream).__name__,
        "gathered": any(not unit.resident for unit in engine.units),
        "loss_gap": max(abs(a - b) for a, b in zip(losses, plain_losses, strict=True)),
        "finite": all(torch.isfinite(v).all() for v in quantized.values()),
    }


def test_qwz_quantizes_and_gathers_on_a_side_stream():
    result = run_ranks(qwz_stream_worker, 1, start="spawn")[0]
    assert result["stream"] == "Stream" and result["gathered"] and result["finite"], result
    assert result["loss_gap"] < 0.05, result  # int8 weights: the losses stay close to the unquantized run's


def offload_worker() -> dict:
    from zeropp.topology import init_topology

    topology = init_topology()
    engine, offloaded, _ = train_engine(topology, offload_optimizer="cpu")
    _, on_device, _ = train_engine(topology)
    masters = [unit.master for unit in engine.units]
    return {
        "master_devices": sorted({m.device.type for m in masters}),
        "pinned": all(m.is_pinned() for m in masters),
        "diff": max_diff(offloaded, on_device),
    }


def test_offloaded_optimizer_keeps_pinned_masters_and_trains_the_same():
    result = run_ranks(offload_worker, 1, start="spawn")[0]
    assert result["master_devices"] == ["cpu"] and result["pinned"] and result["diff"] <= 1e-6, result


def offloaded_parameters_worker() -> dict:
    """DeepSpeed's offload_param alone: the compute shards on the host, the masters on the device."""
    from zeropp.topology import init_topology

    topology = init_topology()
    engine, offloaded, _ = train_engine(topology, offload_params="cpu")
    _, on_device, _ = train_engine(topology)
    sharded = [unit for unit in engine.units if unit.compute_shard is not None]
    return {
        "master_devices": sorted({unit.master.device.type for unit in engine.units}),
        "shard_devices": sorted({unit.compute_shard.device.type for unit in sharded}),
        "diff": max_diff(offloaded, on_device),
    }


def test_offloaded_parameters_alone_keep_their_shards_on_the_host_and_train_the_same():
    result = run_ranks(offloaded_parameters_worker, 1, start="spawn")[0]
    assert result["master_devices"] == ["cuda"] and result["shard_devices"] == ["cpu"], result
    assert result["diff"] <= 1e-6, result


def pa_cpu_worker() -> dict:
    """Pa+cpu: every block input goes to pinned host memory in forward and comes back in backward."""
    from zeropp.topology import init_topology

    topology = init_topology()
    checkpointing = dict(activation_checkpointing=True, partition_activations=True, cpu_checkpointing=True)
    engine, ours, _ = train_engine(topology, **checkpointing)
    pieces = engine.activation_checkpointing.pieces
    return {"home": pieces.device.type, "pinned": pieces.pinned, "diff": max_diff(ours, plain_state(topology.device))}


def test_pa_cpu_checkpoints_in_pinned_host_memory_train_the_same():
    result = run_ranks(pa_cpu_worker, 1, start="spawn")[0]
    assert result["home"] == "cpu" and result["pinned"] and result["diff"] <= 1e-5, result


def generator_worker(root: str) -> bool:
    """A checkpoint holds the device's generator: after loading it, dropout draws what it drew after saving."""
    from zeropp.checkpoint.dcp import load_checkpoint, save_checkpoint
    from zeropp.topology import init_topology

    topology = init_topology()
    engine, _, _ = train_engine(topology, steps=1)
    path = save_checkpoint(engine, root, step=1)
    expected = torch.nn.functional.dropout(torch.ones(64, device=topology.device), 0.5)
    torch.rand(7, device=topology.device)  # move the generator on
    load_checkpoint(engine, path)
    return torch.equal(torch.nn.functional.dropout(torch.ones(64, device=topology.device), 0.5), expected)


def test_a_stage3_checkpoint_restores_the_cuda_generator(tmp_path):
    assert run_ranks(generator_worker, 1, start="spawn", root=str(tmp_path)) == [True]


def disk_tier_worker(path: str) -> dict:
    """The disk tier on CUDA: masters in pinned host memory swapped to files and back each step."""
    from zeropp.topology import init_topology

    topology = init_topology()
    engine, ours, _ = train_engine(topology, offload_optimizer="nvme", offload_path=path, max_grad_norm=1.0)
    _, host, _ = train_engine(topology, offload_optimizer="cpu", max_grad_norm=1.0)
    return {"device": topology.device.type, "vs_host_offload": max_diff(ours, host), "read": engine.disk.bytes_read}


def test_the_disk_tier_on_cuda_trains_like_host_offload(tmp_path):
    r = run_ranks(disk_tier_worker, 1, start="spawn", path=str(tmp_path))[0]
    assert r["device"] == "cuda" and r["read"] > 0
    assert r["vs_host_offload"] == 0.0, r
