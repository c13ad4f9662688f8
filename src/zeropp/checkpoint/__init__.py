"""Saved training states ("checkpoints"; activation checkpointing lives in :mod:`zeropp.runtime`).

- :mod:`~zeropp.checkpoint.per_parameter`: a saved state as per-parameter tensors, independent of the mesh
  (sharded state dict, load template, full state dict) that checkpoints, ``full_state_dict`` and
  export share;
- :mod:`~zeropp.checkpoint.dcp`: DCP sharded checkpoints on top of it: save, atomic publish,
  sha256 per file, load with resharding, export;
- :mod:`~zeropp.checkpoint.replicas`, :mod:`~zeropp.checkpoint.residuals`: what differs between nodes
  (DiLoCo's replicas) and between ranks (error-feedback residuals);
- :mod:`~zeropp.checkpoint.adapters`: a frozen base referenced by path and hash, peft's adapter names;
- :mod:`~zeropp.checkpoint.pretrained`: safetensors files and Hugging Face folders read slice by
  slice into the shards;
- :mod:`~zeropp.checkpoint.deepspeed_files`, :mod:`~zeropp.checkpoint.deepspeed_import`: a DeepSpeed
  ZeRO checkpoint read without unpickling code, and written as a zeropp checkpoint.
"""

from zeropp.checkpoint.dcp import (
    CheckpointError,
    export_checkpoint,
    find_latest,
    load_checkpoint,
    read_meta,
    save_checkpoint,
)
from zeropp.checkpoint.deepspeed_files import DeepSpeedCheckpointError
from zeropp.checkpoint.deepspeed_import import import_deepspeed
from zeropp.checkpoint.pretrained import PretrainedError, load_pretrained

__all__ = [
    "CheckpointError",
    "DeepSpeedCheckpointError",
    "PretrainedError",
    "export_checkpoint",
    "find_latest",
    "import_deepspeed",
    "load_checkpoint",
    "load_pretrained",
    "read_meta",
    "save_checkpoint",
]
