"""What users would pick instead of zeropp, on the same model, data and optimizer: one rank's
training loop for PyTorch DDP and FSDP2 (``fully_shard``; HSDP over a (nodes, ranks per node)
mesh; ``reshard_after_forward=<ranks per node>``, FSDP2's closest analogue of hpZ), and, when
``deepspeed`` is installed (an optional extra; ``DS_ACCELERATOR=cpu``, gloo), DeepSpeed ZeRO-3,
ZeRO-3 + hpZ and ZeRO++ (qwZ + hpZ + qgZ, which DeepSpeed implements for CUDA only).

Run one process per rank under torchrun (``python -m zeropp.tools.bench.rivals --rival fsdp2 ...``);
rank 0 writes a :class:`RivalSummary` as JSON: ``zeropp train``'s keys where they apply. Rivals have
no ledger: their bytes are what the emulated cluster counts on the wire.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zeropp.app.data.batches import Batches
from zeropp.app.models.gpt import GPT, gpt_config
from zeropp.comm.communicator import Communicator
from zeropp.config.model import ModelConfig
from zeropp.config.sections import TopologyConfig
from zeropp.costs.memory import peak_memory_bytes
from zeropp.topology import init_topology, shutdown
from zeropp.zero.grouping import repeated_blocks
from zeropp.zero.materialize import initialize_model

RIVALS = (
    "ddp",
    "fsdp2",
    "fsdp2-hsdp",
    "fsdp2-reshard-node",
    "deepspeed-zero3",
    "deepspeed-hpz",
    "deepspeed-zeropp",
)


@dataclass
class RivalSummary:
    """A rival's run summary: the fields it shares with :class:`~zeropp.app.summary.RunSummary`, and its name."""

    rival: str
    final_train_loss: float
    train_losses: list[float]
    tokens_per_s: float
    median_step_time_s: float
    world_size: int
    nodes: int
    steps: int
    peak_memory_bytes_per_rank: list[int]

    @classmethod
    def from_dict(cls, data: dict) -> RivalSummary:
        return cls(**data)


def adamw(lr: float) -> dict[str, Any]:
    """The AdamW settings every rival and zeropp variant of the benchmarks trains with."""
    return {"lr": lr, "betas": (0.9, 0.95), "weight_decay": 0.1}


def deepspeed_engine(model: nn.Module, rival: str, ranks_per_node: int, micro_batch: int, lr: float):
    """DeepSpeed's engine for `rival`, with the same AdamW (a torch optimizer: no compiled ops needed)."""
    import deepspeed

    zero = {"stage": 3}
    if rival in ("deepspeed-hpz", "deepspeed-zeropp"):
        zero["zero_hpz_partition_size"] = ranks_per_node
    if rival == "deepspeed-zeropp":
        zero.update(zero_quantized_weights=True, zero_quantized_gradients=True)
    config = {"train_micro_batch_size_per_gpu": micro_batch, "zero_optimization": zero}
    optimizer = torch.optim.AdamW(model.parameters(), **adamw(lr))
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def wrap(model: nn.Module, rival: str, world: int, ranks_per_node: int, mp_policy: Any = None) -> nn.Module:
    """Apply `rival`'s data parallelism to `model` the way its documentation recommends for a GPT (FSDP2's
    mesh on the device of the model's parameters; `mp_policy`: FSDP2's MixedPrecisionPolicy, if any)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    if rival == "pytorch":  # no data parallelism: the single-process baseline
        return model
    if rival == "ddp":
        return DistributedDataParallel(model)
    device = next(model.parameters()).device.type
    if rival == "fsdp2-hsdp":
        mesh = init_device_mesh(
            device, (world // ranks_per_node, ranks_per_node), mesh_dim_names=("replicate", "shard")
        )
        options = {"mesh": mesh}
    else:
        options = {"mesh": init_device_mesh(device, (world,))}
    if mp_policy is not None:
        options["mp_policy"] = mp_policy
        if rival == "fsdp2-reshard-node":
            options["reshard_after_forward"] = ranks_per_node
    for block in model.blocks:
        fully_shard(block, **options)
    fully_shard(model, **options)
    return model


TrainingStep = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def engine_step(engine: Any) -> TrainingStep:
    """The training step of an engine with DeepSpeed's interface (``engine(x, y)`` returns the loss,
    then ``engine.backward(loss)`` and ``engine.step()``): DeepSpeed's engine and zeropp's ZeroEngine."""

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss

    return step


def module_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> TrainingStep:
    """The training step of a module whose forward returns the loss, with a torch optimizer."""

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step


def training_step(
    gpt: nn.Module, rival: str, world: int, ranks_per_node: int, micro_batch: int, lr: float
) -> TrainingStep:
    """`rival`'s whole training step on a batch (forward, backward, optimizer step); returns the loss."""
    if rival.startswith("deepspeed"):
        return engine_step(deepspeed_engine(gpt, rival, ranks_per_node, micro_batch, lr))
    model = wrap(gpt, rival, world, ranks_per_node)
    return module_step(model, torch.optim.AdamW(model.parameters(), **adamw(lr)))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zeropp.tools.bench.rivals", description=__doc__)
    parser.add_argument("--rival", choices=RIVALS, required=True)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--summary-json", type=Path)
    args = parser.parse_args(argv)

    topology = init_topology(TopologyConfig(backend="gloo"))
    comm = Communicator(topology)  # the loss means and peak-memory gather: zeropp's own collectives
    rank, world, ranks_per_node = topology.rank, topology.world_size, topology.ranks_per_node
    config = gpt_config(ModelConfig(preset=args.preset))
    with torch.device("meta"):  # the weights zeropp train starts from (train.seed 0, meta init)
        gpt = GPT(config)
    initialize_model(gpt, repeated_blocks(gpt), seed=0)
    train_step = training_step(gpt, args.rival, world, ranks_per_node, args.micro_batch_size, args.lr)

    batches = Batches("train", config.block_size, args.micro_batch_size, world, rank, seed=0)
    times, losses = [], []
    for step in range(args.steps):
        tick = time.perf_counter()
        x, y = batches.local_batch(step)
        loss = train_step(x, y)
        mean = loss.detach().clone()
        comm.all_reduce(mean, topology.world)
        losses.append(mean.item())
        times.append(time.perf_counter() - tick)
    peak = torch.tensor([float(peak_memory_bytes(torch.device("cpu")))])
    peaks = torch.zeros(world)
    comm.all_gather(peaks, peak, topology.world, bucket_numel=1)
    if rank == 0 and args.summary_json is not None:
        tokens = args.micro_batch_size * config.block_size * world * len(times)
        summary = RivalSummary(
            rival=args.rival,
            final_train_loss=losses[-1],
            train_losses=losses,
            tokens_per_s=tokens / sum(times),
            median_step_time_s=statistics.median(times[1:] or times),
            world_size=world,
            nodes=world // ranks_per_node,
            steps=args.steps,
            peak_memory_bytes_per_rank=[int(p.item()) for p in peaks],
        )
        args.summary_json.write_text(json.dumps(asdict(summary), indent=2))
    shutdown()  # meets the other ranks first
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
