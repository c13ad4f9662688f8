"""What the trainer-level tests share: a tiny run's config, a fixed probe batch, the weights of a run."""

from __future__ import annotations

from pathlib import Path

import torch

TINY = {"model": {"preset": "tiny", "block_size": 32}}
PROBE = torch.arange(64).view(2, 32) * 7 % 256


def run_config(checkpoint_dir: Path, steps: int, nodes: int, micro_batch: int = 1, **sections):
    from zeropp.config.sections import load_config

    data = {
        "model": dict(TINY["model"]),
        "train": {"steps": steps, "micro_batch_size": micro_batch, "eval_batches": 1, "eval_interval": 1000},
        "topology": {"nodes": nodes},
        "checkpoint": {"checkpoint_dir": str(checkpoint_dir), "keep_last": 0},
    }
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    return load_config(data)


def weights_of(trainer) -> dict[str, torch.Tensor]:
    return trainer.engine.full_state_dict()
