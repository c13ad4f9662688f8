"""Digest of what training does, for checking that a refactor changed no behaviour.

Trains the embedded GPT at world 4 (2 nodes x 2, gloo) under many configurations and writes, per
configuration and rank: every loss (exact float hex), the sha256 of the final full state dict and
of the rank's sharded state, every ledger entry (bytes and calls) and the model-state bytes. Run it
on two trees and diff the JSON files:

    PYTHONPATH=<tree>/src python dev/behaviour_digest.py OUT.json
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import socket
import sys
import traceback

import torch

CONFIGS: dict[str, dict] = {
    "stage0": dict(zero=dict(stage=0)),
    "stage1": dict(zero=dict(stage=1)),
    "stage2-accum-clip": dict(zero=dict(stage=2, gradient_accumulation_steps=2, max_grad_norm=0.5)),
    "stage3": dict(zero=dict(stage=3)),
    "stage3-hpz": dict(zero=dict(stage=3, hpz_partition_size=0)),
    "stage3-qwz": dict(zero=dict(stage=3, quantized_weights=True, weight_block_size=64)),
    "stage3-qgz-loco": dict(
        zero=dict(stage=3, quantized_gradients=True, gradient_block_size=64, gradient_error_feedback="loco")
    ),
    "zeropp-bf16": dict(
        zero=dict(
            stage=3, precision="bf16", quantized_weights=True, hpz_partition_size=0, quantized_gradients=True,
            weight_block_size=64, gradient_block_size=64, max_grad_norm=1.0,
        )
    ),
    "stage3-fp16": dict(zero=dict(stage=3, precision="fp16")),
    "stage2-fp16-accum": dict(zero=dict(stage=2, precision="fp16", gradient_accumulation_steps=2)),
    "stage3-offload": dict(zero=dict(stage=3, offload_optimizer="cpu", offload_params="cpu")),
    "stage1-offload": dict(zero=dict(stage=1, offload_optimizer="cpu")),
    "stage3-tp2": dict(zero=dict(stage=3), tp=2),
    "stage3-tp2-sp": dict(zero=dict(stage=3), tp=2, sp=True),
    "stage3-ac-pa-cpu": dict(
        zero=dict(stage=3, activation_checkpointing=True, partition_activations=True, cpu_checkpointing=True), tp=2
    ),
    "stage3-ac-md": dict(zero=dict(stage=3, activation_checkpointing=True, contiguous_memory_optimization=True)),
}
STEPS = 4
WORLD, NODES = 4, 2


def _imports():
    import zeropp

    try:
        from zeropp.app.models.gpt import GPT, GPTConfig
    except ImportError:
        from zeropp.models.gpt import GPT, GPTConfig
    topology_config = getattr(zeropp, "TopologyConfig", None)
    if topology_config is None:
        from zeropp.config import TopologyConfig as topology_config
    return zeropp, GPT, GPTConfig, topology_config


def _sha(tensors: dict) -> str:
    h = hashlib.sha256()
    for key in sorted(tensors, key=str):
        value = tensors[key]
        key = str(key)
        if isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            h.update(key.encode())
            h.update(local.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(value, dict | list | tuple):
            value = value if isinstance(value, dict) else dict(enumerate(value))
            h.update(key.encode())
            h.update(_sha(value).encode())
        else:
            h.update(f"{key}={value!r}".encode())
    return h.hexdigest()


def _run_rank(name: str, spec: dict) -> dict:
    zeropp, GPT, GPTConfig, TopologyConfig = _imports()
    torch.manual_seed(0)
    tp = spec.get("tp", 1)
    topology = zeropp.init_topology(TopologyConfig(tensor_parallel_size=tp, sequence_parallel=spec.get("sp", False)))
    try:
        model = GPT(GPTConfig(block_size=16, n_layer=2, n_head=2, d_model=32, vocab_size=64))
        if tp > 1:
            model = zeropp.parallelize(model, topology)
        config = zeropp.ZeroConfig(**spec["zero"])
        engine = zeropp.ZeroEngine(model, torch.optim.AdamW, dict(lr=1e-2), config, topology)
        gen = torch.Generator().manual_seed(1000 + topology.rank // tp)  # tp ranks are consecutive: one batch each group
        losses = []
        accum = spec["zero"].get("gradient_accumulation_steps", 1)
        for _ in range(STEPS * accum):
            x = torch.randint(0, 64, (2, 16), generator=gen)
            loss = engine(x, x.roll(-1, 1))
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach().float()).hex())
        ledger = engine.comm.ledger
        return dict(
            losses=losses,
            full_state_sha=_sha(engine.full_state_dict()),
            sharded_state_sha=_sha(engine.sharded_state_dict()),
            ledger_bytes={"|".join(k): v for k, v in sorted(ledger.bytes.items())},
            ledger_calls={"|".join(k): v for k, v in sorted(ledger.calls.items())},
            model_state_bytes=engine.model_state_bytes(),
        )
    finally:
        zeropp.shutdown()


def _worker(name, spec, rank, port, queue):
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank % (WORLD // NODES)),
        LOCAL_WORLD_SIZE=str(WORLD // NODES), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    try:
        queue.put((rank, json.dumps(_run_rank(name, spec))))
    except BaseException:
        queue.put((rank, json.dumps(dict(error=traceback.format_exc().splitlines()[-1]))))


def run(name: str, spec: dict) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_worker, args=(name, spec, r, port, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    out = {}
    for _ in range(WORLD):
        rank, text = queue.get(timeout=300)
        out[rank] = json.loads(text)
    for p in procs:
        p.join(timeout=30)
    return [out[r] for r in range(WORLD)]


if __name__ == "__main__":
    results = {}
    for name, spec in CONFIGS.items():
        results[name] = run(name, spec)
        errors = [r["error"] for r in results[name] if "error" in r]
        print(name, "ERROR " + errors[0] if errors else "ok", flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)
