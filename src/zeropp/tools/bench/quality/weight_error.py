"""The weight error of ``zeropp bench convergence``: how far quantized communication moves the weights
from the exact run in a few optimizer steps on one fixed batch.

Each configuration trains the same initial weights for ``steps`` AdamW steps, every step on the
same global batch (the seed's batch of step 0) at a constant learning rate, on 4 ranks as 2
simulated nodes x 2; the exact run is ZeRO-3 (every ZeRO++ switch off, same precision). The error is
``||w - w_exact|| / ||w_exact - w_0||`` over all parameters (fp64 norms of the fp32 masters), w_0
the initial weights: 0 is the exact run, 1 an error as large as the whole update. One batch
removes the data's noise from the comparison: what remains is the quantization's.

One torchrun job runs every configuration in turn (``python -m torch.distributed.run
--nproc-per-node 4 -m zeropp.tools.bench.quality.weight_error SPEC.json OUT.json``, SPEC: ``{"base": config
dict, "configs": {name: zero keys}, "exact": name}``); rank 0 writes ``{name: error}``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from zeropp.app.launch import usable_cpus

WORLD, NODES = 4, 2


class OneBatch:
    """Step 0's batches at every step (a :class:`zeropp.app.data.Batches` seen through one step)."""

    def __init__(self, batches: Any) -> None:
        self.batches = batches

    def local_batch(self, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batches.local_batch(0, micro)


def base_config(preset: str, precision: str, lr: float, steps: int, seed: int, micro_batch: int) -> dict[str, Any]:
    """The config every configuration shares: stage 3, constant `lr`, `steps` steps, 2 simulated nodes."""
    return {
        "model": {"preset": preset},
        "zero": {"stage": 3, "precision": precision},
        "optim": {"lr": lr, "schedule": "constant"},
        "train": {"steps": steps, "seed": seed, "micro_batch_size": micro_batch},
        "topology": {"nodes": NODES},
    }


def relative_errors(
    weights: dict[str, dict[str, torch.Tensor]], initial: dict[str, torch.Tensor], exact: str
) -> dict[str, float]:
    """||w - w_exact|| / ||w_exact - w_0|| per configuration (fp64, over every parameter)."""
    flat = {name: torch.cat([w[k].double().reshape(-1) for k in sorted(w)]) for name, w in weights.items()}
    start = torch.cat([initial[k].double().reshape(-1) for k in sorted(initial)])
    moved = float((flat[exact] - start).norm())
    return {name: float((w - flat[exact]).norm()) / moved for name, w in flat.items()}


def measure(spec: dict[str, Any]) -> dict[str, float]:
    """`spec` (see the module docstring) on 4 ranks as 2 nodes x 2, one torchrun job; {name: error}."""
    with tempfile.TemporaryDirectory() as tmp:
        spec_file, out = Path(tmp) / "spec.json", Path(tmp) / "errors.json"
        spec_file.write_text(json.dumps(spec))
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
            "-m", "zeropp.tools.bench.quality.weight_error", str(spec_file), str(out),
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, usable_cpus() // WORLD))}
        subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def worker(spec_file: str, out: str) -> None:
    from zeropp.app.trainer import Trainer
    from zeropp.config.sections import load_config
    from zeropp.topology import shutdown

    spec = json.loads(Path(spec_file).read_text())
    base = spec["base"]
    initial, weights = None, {}
    for name, zero in spec["configs"].items():
        trainer = Trainer(load_config({**base, "zero": {**base["zero"], **zero}}))
        if initial is None:
            initial = trainer.engine.full_state_dict()
        trainer.train_batches = OneBatch(trainer.train_batches)
        for step in range(trainer.config.train.steps):
            trainer.train_step(step)
        weights[name] = trainer.engine.full_state_dict()
    if trainer.topology.rank == 0:
        Path(out).write_text(json.dumps(relative_errors(weights, initial, spec["exact"])))
    shutdown()


if __name__ == "__main__":
    worker(*sys.argv[1:3])
