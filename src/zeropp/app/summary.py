"""The run summary of ``zeropp train``: what rank 0 prints, writes with ``--summary-json``, and what
``zeropp cluster`` and the benchmarks read back.

Its JSON (:meth:`RunSummary.to_json`) has one key per field, in field order, and
:meth:`RunSummary.from_json` reads such a file back. Bytes are per rank and per optimizer step
(mean over ranks unless the name says ``by_rank`` / ``per_rank``); ``ledger`` is the mean over ranks
as ``{op: {phase: {'intra', 'inter'}}}``; ``config`` is the run's ``Config.to_dict()``;
``checkpoints`` lists what the run published (step, path, bytes, seconds).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ZeroppSwitches:
    """The ZeRO++ switches a run had: qwZ, hpZ's secondary group size (1: off), qgZ."""

    quantized_weights: bool
    hpz_group_size: int
    quantized_gradients: bool


@dataclass
class CheckpointRecord:
    """A checkpoint the run published: its step, folder, size on disk and the seconds the save took."""

    step: int
    path: str
    bytes: int
    seconds: float


@dataclass
class RunSummary:
    final_train_loss: float
    final_val_loss: float
    tokens_per_s: float
    median_step_time_s: float
    world_size: int
    nodes: int
    stage: int
    precision: str
    steps: int
    start_step: int
    resumed_from: str | None
    train_losses: list[float]
    param_count: int
    model_state_bytes_per_rank: list[int]
    analytic_model_state_bytes_per_rank: float  # the formula's bytes in memory (a disk tier's files aside)
    peak_memory_bytes_per_rank: list[int]
    intra_node_bytes_per_step: float
    inter_node_bytes_per_step: float
    intra_node_bytes_per_step_by_rank: list[float]
    inter_node_bytes_per_step_by_rank: list[float]
    zero3_intra_node_bytes_per_step: float  # what plain ZeRO-3 would send on the same units
    zero3_inter_node_bytes_per_step: float
    zeropp: ZeroppSwitches
    ledger: dict[str, dict[str, dict[str, float]]]
    config: dict[str, Any]
    skipped_steps: int = 0  # fp16: optimizer steps skipped for overflowing gradients
    checkpoints: list[CheckpointRecord] = field(default_factory=list)  # published by this run, in order
    # peak memory above the process's before the model was built (zeropp.costs.memory.PeakMeter): during
    # model construction and engine set-up (and loading), and during the training steps
    init_peak_memory_bytes_per_rank: list[int] = dataclasses.field(default_factory=list)
    step_peak_memory_bytes_per_rank: list[int] = dataclasses.field(default_factory=list)
    # the disk tier (offload_optimizer = "nvme"): (bytes read, bytes written) per optimizer step, by rank
    disk_bytes_per_step_per_rank: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    # zeropp.app.metrics: tokens_per_s over the world size; 6N + 12LdT; MFU over the device's bf16 peak
    # (None where unknown, e.g. CPU); (step, loss) of every validation; what was trained
    tokens_per_s_per_rank: float = 0.0
    # the first step left out, as in the median; DiLoCo's synchronizations show here, not in the median
    mean_step_time_s: float = 0.0
    flops_per_token: float = 0.0
    mfu: float | None = None
    val_losses: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    model: str = "the embedded GPT"
    # qgZ error feedback's fp32 residuals: the most rank 0 held (while qgZ was on; 0 when off), and the
    # step from which the schedule (quantized_gradients_until) turned qgZ off and freed them (None: held
    # to the end, and part of model_state_bytes_per_rank, measured at the last step)
    qgz_residual_bytes_per_rank: int = 0
    qgz_residuals_freed_at_step: int | None = None
    # the tensor-parallel group's size, whether the activations between its split layers were sharded over
    # the sequence (topology.sequence_parallel), and its bytes per rank and step (the ledger's tp.* ops,
    # mean over ranks)
    tensor_parallel_size: int = 1
    sequence_parallel: bool = False
    tensor_parallel_bytes_per_step: float = 0.0
    # the context-parallel group's size (Ulysses) and its all-to-alls' bytes per rank and step (cp.*, mean over ranks)
    context_parallel_size: int = 1
    context_parallel_bytes_per_step: float = 0.0
    # activation checkpoints (zeropp.runtime.activation_checkpointing) rank 0 stored in its last step, peak: on the
    # compute device (with Pa+cpu only the pieces fetched back in backward, at most two) and on the host
    activation_checkpoint_bytes_per_rank: int = 0
    activation_checkpoint_host_bytes_per_rank: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunSummary:
        """Raises TypeError where a key is missing or unknown (not a zeropp train summary)."""
        checkpoints = [CheckpointRecord(**c) for c in data.get("checkpoints", [])]
        return cls(**{**data, "zeropp": ZeroppSwitches(**data.get("zeropp", {})), "checkpoints": checkpoints})

    @classmethod
    def from_json(cls, text: str) -> RunSummary:
        return cls.from_dict(json.loads(text))
