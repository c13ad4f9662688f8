"""Which masters the optimizer steps together.

A step hands every master its fp32 gradient and runs the optimizer. Done for the whole shard at
once, the step's peak holds an fp32 gradient of the whole shard (4 bytes per parameter over the
16 of Table 1's model states) and, with torch's foreach implementations, temporaries of about as
much again. The optimizers below update each parameter from its own gradient and state alone, so
stepping them one unit at a time (the units without a gradient are skipped by ``step()``) gives the
same weights while bounding both extras by the largest unit: DeepSpeed's ``sub_group_size``, with
the unit as the group. Any other optimizer (one that reads across parameters, or one we cannot
vouch for) is stepped once over all masters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch

PER_PARAMETER_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.RMSprop,
    torch.optim.Rprop,
    torch.optim.Adafactor,
)

Unit = TypeVar("Unit")


def steps_unit_by_unit(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` is one of torch's per-parameter optimizers itself (a subclass may read
    across parameters in its own ``step``)."""
    return type(optimizer) in PER_PARAMETER_OPTIMIZERS


def step_batches(optimizer: torch.optim.Optimizer, units: Sequence[Unit]) -> list[Sequence[Unit]]:
    """The units whose masters each ``optimizer.step()`` call updates, in order."""
    return [[unit] for unit in units] if steps_unit_by_unit(optimizer) else [units]
