"""The rivals of ``zeropp bench memory`` and ``zeropp bench largest``: one rank that builds the GPT the
way its library documents for models bigger than one device, trains a few steps, and reports its
construction and step peaks (:class:`zeropp.costs.memory.PeakMeter`, as ``zeropp train`` reports its own).

- **FSDP2 meta**: the model built on the meta device, ``fully_shard`` per block and on the root,
  ``to_empty`` on the host, then each module's ``reset_parameters`` and the GPT's ``_init_weights``.
- **DeepSpeed zero.Init**: the model built inside ``deepspeed.zero.Init`` (each module's parameters
  are partitioned as soon as the module is built), then ``deepspeed.initialize`` with ZeRO-3 and the
  same torch AdamW (``DS_ACCELERATOR=cpu``, gloo; needs the optional ``deepspeed`` package).

Run under torchrun, one process per rank; rank 0 writes {"init": bytes, "step": bytes}, the largest
rank's peaks::

    python -m torch.distributed.run --standalone --nproc-per-node 4 -m zeropp.tools.bench.memory.rivals \\
        "FSDP2 meta" OUT.json --n-layer 12 --d-model 1024 --block-size 256 --steps 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zeropp.app.launch import usable_cpus
from zeropp.app.models.gpt import GPT, GPTConfig, gpt_config
from zeropp.comm.communicator import Communicator
from zeropp.config.model import ModelConfig
from zeropp.config.sections import TopologyConfig
from zeropp.costs.memory import PeakMeter
from zeropp.tools.bench.rivals import TrainingStep, engine_step, module_step
from zeropp.topology import Topology, init_topology, shutdown


def fsdp2(config: GPTConfig, topology: Topology) -> TrainingStep:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = GPT(config)
    mesh = init_device_mesh("cpu", (topology.world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
            GPT._init_weights(module)
    return module_step(model, torch.optim.AdamW(model.parameters(), lr=1e-4))


def deepspeed_zero_init(config: GPTConfig, topology: Topology) -> TrainingStep:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    ds_config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model: nn.Module = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    return engine_step(engine)


RIVALS: dict[str, Callable[[GPTConfig, Topology], TrainingStep]] = {
    "FSDP2 meta": fsdp2,
    "DeepSpeed zero.Init": deepspeed_zero_init,
}


def worker_command(rival: str, out: str, world: int, size: Sequence[str], steps: int) -> list[str]:
    """The torchrun command line of `rival` on `world` ranks; `size`: --n-layer/--d-model/--block-size flags."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
        "-m", "zeropp.tools.bench.memory.rivals", rival, out, *size, "--steps", str(steps),
    ]  # fmt: skip


def worker_env(world: int) -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": str(max(1, usable_cpus() // world)),
        "DS_ACCELERATOR": "cpu",
    }


def run_rival(rival: str, world: int, size: Sequence[str], steps: int, out: Path) -> dict[str, Any]:
    """Run `rival` on `world` ranks of this machine; its peaks (bytes, the largest rank's)."""
    subprocess.run(
        worker_command(rival, str(out), world, size, steps),
        check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=worker_env(world),
    )  # fmt: skip
    return json.loads(out.read_text())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zeropp.tools.bench.memory.rivals")
    parser.add_argument("rival", choices=list(RIVALS))
    parser.add_argument("out", help="where rank 0 writes the peaks (JSON)")
    parser.add_argument("--n-layer", type=int, required=True)
    parser.add_argument("--d-model", type=int, required=True)
    parser.add_argument("--block-size", type=int, required=True)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args(argv)
    topology = init_topology(TopologyConfig(backend="gloo"))
    meter = PeakMeter(torch.device("cpu"))  # from before the model exists
    config = gpt_config(
        ModelConfig(n_layer=args.n_layer, d_model=args.d_model, n_head=args.d_model // 64, block_size=args.block_size)
    )
    step = RIVALS[args.rival](config, topology)
    init = meter.peak()
    meter.reset_peak()
    for _ in range(args.steps):
        x = torch.randint(0, config.vocab_size, (1, config.block_size))
        step(x, x)
    peaks = torch.tensor([float(init), float(meter.peak())])
    rows = torch.zeros(2 * topology.world_size)
    Communicator(topology).all_gather(rows, peaks, topology.world, bucket_numel=2)  # zeropp's door, not the rival's
    if topology.rank == 0:
        init_max, step_max = rows.view(-1, 2).max(dim=0).values.tolist()
        Path(args.out).write_text(json.dumps({"init": init_max, "step": step_max}))
    shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
