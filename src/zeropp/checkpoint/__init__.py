"""Saved training states ("checkpoints"; activation checkpointing lives in :mod:`zeropp.runtime`).

- :mod:`~zeropp.checkpoint.layout`: the per-parameter, mesh-independent layout of a saved state
  (sharded state dict, load template, full state dict) that checkpoints, ``full_state_dict`` and
  export share;
- :mod:`~zeropp.checkpoint.dcp`: DCP sharded checkpoints on top of it: save, atomic publish,
  sha256 per file, load with resharding, export;
- :mod:`~zeropp.checkpoint.pretrained`: safetensors files and Hugging Face folders read slice by
  slice into the shards.
"""

from zeropp.checkpoint.dcp import (
    CheckpointError,
    export_checkpoint,
    find_latest,
    load_checkpoint,
    read_meta,
    save_checkpoint,
)
from zeropp.checkpoint.pretrained import PretrainedError, load_pretrained

__all__ = [
    "CheckpointError",
    "PretrainedError",
    "export_checkpoint",
    "find_latest",
    "load_checkpoint",
    "load_pretrained",
    "read_meta",
    "save_checkpoint",
]
