"""The metrics of every training step, as torchtitan users expect them, and where they go: the
progress bar, ``--metrics-jsonl`` (one JSON line a step) and ``--plot`` (a PNG of the loss curves).

Per step: the training loss (mean over ranks), the validation loss when it was measured, the global
gradient norm (before clipping), the learning rate, tokens/s in total (all ranks' tokens over the
step's wall time) and per rank (that divided by the world size), MFU where the device's peak is
known, and the step's peak memory on rank 0 (above what the process used before the model was
built, :class:`zeropp.costs.memory.PeakMeter`).

MFU (model FLOPs utilization), computed as torchtitan and the PaLM paper do: the model's FLOPs per
token are ``6·N + 12·L·d·T`` (N parameters, tied ones once; L layers, width d, sequence length T;
the second term is attention's score and value matmuls), times tokens/s per rank, over the device's
dense bf16 peak (:data:`PEAK_BF16_FLOPS`, whatever the run's precision). Unknown for CPUs and
devices not in the table: then ``mfu`` is null and nothing is shown.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import torch

from zeropp.errors import ConfigError

# dense bf16 tensor-core peak FLOPS by CUDA device name (first match wins; datasheet values)
PEAK_BF16_FLOPS = (
    ("H200", 989e12),
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("A10G", 70e12),
)


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak FLOPS, or None where unknown (CPU, devices not in the table)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in name), None)


def flops_per_token(params: int, n_layer: int, d_model: int, seq_len: int) -> float:
    """Training FLOPs per token: 6·N (forward and backward matmuls) + 12·L·d·T (attention)."""
    return 6 * params + 12 * n_layer * d_model * seq_len


@dataclass
class StepMetrics:
    step: int  # steps done
    loss: float
    val_loss: float | None  # measured after this step, else None
    grad_norm: float | None  # None where fp16 skipped the step
    lr: float
    step_time_s: float
    tokens_per_s: float  # all ranks
    tokens_per_s_per_rank: float
    mfu: float | None  # fraction of the device's peak; None where the peak is unknown
    peak_memory_bytes: int  # rank 0, during the step

    def to_json(self) -> str:
        return json.dumps({k: _finite(v) for k, v in dataclasses.asdict(self).items()})


def _finite(value: float | int | None) -> float | int | None:
    """JSON has no nan or inf: such values are written as null."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


class MetricsLog:
    """Rank 0's record of the steps: the loss curves for the plot, and the JSON lines file."""

    def __init__(self, jsonl: Path | None = None) -> None:
        self.train: list[tuple[int, float]] = []
        self.val: list[tuple[int, float]] = []
        self.file: IO[str] | None = jsonl.open("w") if jsonl is not None else None

    def add(self, metrics: StepMetrics) -> None:
        self.train.append((metrics.step, metrics.loss))
        if metrics.val_loss is not None:
            self.val.append((metrics.step, metrics.val_loss))
        if self.file is not None:
            self.file.write(metrics.to_json() + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError(
            "--plot needs the optional package matplotlib, which is not installed: pip install -e '.[plot]'"
        ) from None


def plot_losses(log: MetricsLog, path: Path, title: str) -> None:
    """A PNG of the training and validation loss against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    for label, points, style in (("train", log.train, "-"), ("validation", log.val, "o-")):
        if points:
            steps, losses = zip(*points, strict=True)
            axes.plot(steps, losses, style, label=label)
    axes.set(xlabel="step", ylabel="loss (cross-entropy, nats/token)", title=title)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
