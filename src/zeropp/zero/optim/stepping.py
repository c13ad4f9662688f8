"""The optimizer step on the masters: which masters each ``optimizer.step()`` updates, the gradient
statistics a step needs first (overflow, norm), and the step itself.

A master is a unit's flat fp32 shard, pieces of several parameters end to end, so only an
optimizer that updates every element from that element's own gradient and state alone (an
element-wise one) computes on it what it computes on the parameters. One that reads a parameter's
shape or norm (Adafactor's factored moments, Muon's orthogonalized matrices, LAMB's trust ratio)
would train silently wrong on the shards: it steps whole parameters instead (See [Note: the
whole-parameter step]).

A step hands every master its fp32 gradient and runs the optimizer. Done for the whole shard at
once, the step's peak holds an fp32 gradient of the whole shard (4 bytes per parameter over the
16 of Table 1's model states) and, with torch's foreach implementations, temporaries of about as
much again. Element-wise optimizers update each parameter from its own gradient and state alone, so
stepping torch's one unit at a time (the units without a gradient are skipped by ``step()``) gives
the same weights while bounding both extras by the largest unit: DeepSpeed's ``sub_group_size``,
with the unit as the group. A user's own element-wise optimizer (``elementwise = True`` on its
class: we cannot vouch for its ``step``) is stepped once over all masters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeVar

import torch

from zeropp.zero.precision import LossScaler

if TYPE_CHECKING:
    from zeropp.zero.offload.disk import DiskTier
    from zeropp.zero.offload.disk_params import ParamFiles
    from zeropp.zero.unit import FlatUnit

# torch's element-wise optimizers, the classes themselves (a subclass may read more in its own step)
ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
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
    torch.optim.ASGD,
)

Unit = TypeVar("Unit")


def is_elementwise(cls: type) -> bool:
    """Whether optimizer class `cls` is exact on flat shards: one of :data:`ELEMENTWISE_OPTIMIZERS`, or
    marked ``elementwise = True`` by its author."""
    return cls in ELEMENTWISE_OPTIMIZERS or getattr(cls, "elementwise", False) is True


def steps_unit_by_unit(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` is one of torch's element-wise optimizers itself, whose ``step`` we know
    steps the masters it is given and no others."""
    return type(optimizer) in ELEMENTWISE_OPTIMIZERS


def step_batches(optimizer: torch.optim.Optimizer, units: Sequence[Unit]) -> list[Sequence[Unit]]:
    """The units whose masters each ``optimizer.step()`` call updates, in order."""
    return [[unit] for unit in units] if steps_unit_by_unit(optimizer) else [units]


def gradient_statistics(
    units: Sequence[FlatUnit], scaler: LossScaler, device: torch.device, count_whole: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Whether this rank's gradients are all finite (checked under fp16 only), and the sum of their
    squares (parameters whole on every tensor-parallel rank counted where `count_whole`), in one pass
    over the units' reduced gradients that holds one unit's fp32 gradient at a time. Device tensors."""
    finite = torch.ones((), dtype=torch.bool, device=device)
    squares = torch.zeros(1, dtype=torch.float32, device=device)
    for unit in units:
        grad = unit.reduced_gradient().to(torch.float32)  # the buffer itself where it is fp32: not written
        if scaler.enabled:
            grad = grad / scaler.scale
            finite &= torch.isfinite(grad).all()
        squares += unit.grad_squares(grad, count_whole)
    return finite, squares


def clip_coefficient(norm: torch.Tensor, max_norm: float | None) -> torch.Tensor | None:
    """The factor clip_grad_norm_ would scale the gradients by (a device tensor: no host
    synchronization), None without clipping."""
    return None if max_norm is None else torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def step_units(
    units: Sequence[FlatUnit],
    optimizer: torch.optim.Optimizer,
    scaler: LossScaler,
    coefficient: torch.Tensor | None,
    host_copies: bool,
    disk: DiskTier | None,
    params: ParamFiles | None = None,
) -> None:
    """Hand each master its gradient in the master's dtype (unscaled, clipped) and step the optimizer over the batches
    of :func:`step_batches`, publishing each unit's weights after its step. `host_copies`: the masters
    live in host memory, and every unit's gradient copy there is issued before any is waited for.
    `disk`: the states stream through the disk tier, `params`: the compute shards are written back to
    theirs (See [Note: the disk tier's ring])."""
    copies: dict[int, torch.Tensor] = {}
    device = units[0].options.device if units else None
    if host_copies:
        copies = {id(u): u.reduced_gradient().to(u.master.device, u.master.dtype, non_blocking=True) for u in units}
        if device is not None and device.type == "cuda":
            # the host optimizer reads these copies next: ZeRO-Offload's one blocking wait of a step
            torch.cuda.current_stream(device).synchronize()
    batches = step_batches(optimizer, units)
    if disk is not None:
        index = {id(unit): i for i, unit in enumerate(units)}
        batches = (
            [units[i] for i in indices] for indices in disk.streamed([[index[id(u)] for u in b] for b in batches])
        )
    for batch in batches:
        for unit in batch:
            grad = copies.pop(id(unit), None)
            if grad is None:  # the reduced buffer itself where it has the master's dtype: its last use
                grad = unit.reduced_gradient().to(unit.master.device, unit.master.dtype)
            if scaler.enabled:
                grad.div_(scaler.scale)
            if coefficient is not None:
                grad.mul_(coefficient.to(grad.device))
            unit.master.grad = grad
        optimizer.step()
        for unit in batch:
            unit.master.grad = None
            if params is not None:
                params.publish(unit)
            else:
                unit.publish_master()
    if params is not None:
        params.flush()
