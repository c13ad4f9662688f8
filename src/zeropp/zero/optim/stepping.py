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

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch

from zeropp.zero.precision import LossScaler
from zeropp.zero.weights.dtensor_params import is_split

if TYPE_CHECKING:
    from zeropp.comm.communicator import Communicator
    from zeropp.topology import Group
    from zeropp.zero.offload.disk import DiskTier
    from zeropp.zero.offload.disk_gradients import GradientFiles
    from zeropp.zero.offload.disk_params import ParamFiles
    from zeropp.zero.optim.spec import OptimizerSpec
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
    steps the tensors given a gradient and no others."""
    return type(optimizer) in ELEMENTWISE_OPTIMIZERS


def step_batches(optimizers: Sequence[torch.optim.Optimizer], units: Sequence[Unit]) -> list[Sequence[Unit]]:
    """The units whose tensors each round of ``optimizer.step()`` calls updates, in order."""
    return [[unit] for unit in units] if all(map(steps_unit_by_unit, optimizers)) else [units]


def gradient_statistics(
    units: Sequence[FlatUnit], scaler: LossScaler, device: torch.device, on_disk: GradientFiles | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Whether this rank's gradients are all finite (checked under fp16 only), and the sum of their
    squares (parameters whole on every tensor-parallel rank counted on one: :func:`grad_squares`), in one pass
    over the units' reduced gradients that holds one unit's fp32 gradient at a time, but for the units
    whose statistics were computed as their gradients landed (``FlatUnit.known_statistics``: parked in
    `on_disk`, See [Note: gradients on disk], or by the step inside backward with clipping, See [Note:
    the step inside backward]). Device tensors."""
    if on_disk is not None:
        on_disk.settle()
    finite = torch.ones((), dtype=torch.bool, device=device)
    squares = torch.zeros(1, dtype=torch.float32, device=device)
    scale = scaler.scale if scaler.enabled else None
    for unit in units:
        known = unit.known_statistics
        unit_finite, unit_squares = known or unit_statistics(unit, unit.reduced_gradient(), scale)
        if unit_finite is not None:
            finite &= unit_finite.to(device)
        squares += unit_squares.to(device)
    return finite, squares


def unit_statistics(
    unit: FlatUnit, gradient: torch.Tensor, scale: float | None
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """One unit's part of :func:`gradient_statistics` from its reduced `gradient`: whether it is finite
    once the loss `scale` is divided out (None without one) and its sum of squares."""
    grad = gradient.to(torch.float32)  # the buffer itself where it is fp32: not written
    if scale is None:
        return None, grad_squares(unit, grad)
    grad = grad / scale
    return torch.isfinite(grad).all(), grad_squares(unit, grad)


def grad_squares(unit: FlatUnit, grad: torch.Tensor) -> torch.Tensor:
    """Sum of squares of `grad` (this rank's gradient of `unit`, aligned with its master), the parameters
    whole on every tensor-parallel rank (not split by a DTensor plan) included on the first of them
    only, so that a sum over the tensor-parallel ranks counts them once."""
    if unit.comm.topology.tensor_parallel.rank == 0:
        return torch.linalg.vector_norm(grad).square()
    offset = 0 if unit.shard_world == 1 else unit.layout.shard_range(unit.groups.shard.rank)[0]
    total = torch.zeros((), dtype=grad.dtype, device=grad.device)
    for index, param in enumerate(unit.params):
        if is_split(param):
            start, stop = unit.layout.param_range(index)
            start, stop = max(start - offset, 0), min(stop - offset, grad.numel())
            if start < stop:
                total += torch.linalg.vector_norm(grad[start:stop]).square()
    return total


def clip_coefficient(norm: torch.Tensor, max_norm: float | None) -> torch.Tensor | None:
    """The factor clip_grad_norm_ would scale the gradients by (a device tensor: no host
    synchronization), None without clipping."""
    return None if max_norm is None else torch.clamp(max_norm / (norm + 1e-6), max=1.0)


class MasterStep:
    """The flat path: each unit's master is the one tensor its optimizer steps, in one group (the
    counterpart of :class:`~zeropp.zero.optim.segments.SegmentStep`, which says what the methods do)."""

    def __init__(self, units: Sequence[FlatUnit], spec: OptimizerSpec) -> None:
        self.units = list(units)
        self.optimizers = [spec.factory([unit.master for unit in self.units])]

    def tensors(self, k: int) -> list[torch.Tensor]:
        return [self.units[k].master]

    def given_gradients(self, comm: Communicator, group: Group) -> None:
        """None: a flat master is stepped whole, whichever of its parameters got a gradient."""

    def give(self, k: int, grad: torch.Tensor, given: set[int] | None) -> None:
        self.units[k].master.grad = grad

    def take(self, k: int) -> None:
        self.units[k].master.grad = None

    def state_slots(self, units: Sequence[int]) -> Iterator[Slot]:
        return state_slots(self.optimizers[0].state.get(self.units[k].master, {}) for k in units)

    def unit_state(self, k: int) -> tuple[dict[str, torch.Tensor], dict[str, dict[int, torch.Tensor]]]:
        master = self.units[k].master
        state = self.optimizers[0].state.get(master, {})
        flat = {key: v for key, v in state.items() if isinstance(v, torch.Tensor) and v.shape == master.shape}
        every = range(len(self.units[k].params))
        return flat, {key: {i: v for i in every} for key, v in state.items() if key not in flat}

    def load_unit_state(
        self, k: int, flat: Mapping[str, torch.Tensor], scalars: Mapping[str, Mapping[int, torch.Tensor]]
    ) -> None:
        """One step count for the whole master: the first parameter's that has one."""
        state = dict(flat) | {key: next(iter(by_index.values())) for key, by_index in scalars.items() if by_index}
        if state:
            self.optimizers[0].state[self.units[k].master] = state


Slot = tuple[Callable[[], torch.Tensor], Callable[[torch.Tensor], None]]  # read a state tensor, point it elsewhere


def state_slots(states: Iterable[dict[str, Any]]) -> Iterator[Slot]:
    """(read, write) of every tensor of the optimizer states `states` (``offload_states`` moves them)."""
    for state in states:
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                yield (lambda s=state, k=key: s[k]), (lambda t, s=state, k=key: s.__setitem__(k, t))


class Stepper(Protocol):
    """What :func:`step_units` drives: :class:`MasterStep` or :class:`~zeropp.zero.optim.segments.SegmentStep`."""

    units: list[FlatUnit]
    optimizers: list[torch.optim.Optimizer]

    def tensors(self, k: int) -> list[torch.Tensor]: ...
    def given_gradients(self, comm: Communicator, group: Group) -> list[set[int]] | None: ...
    def give(self, k: int, grad: torch.Tensor, given: set[int] | None) -> None: ...
    def take(self, k: int) -> None: ...
    def state_slots(self, units: Sequence[int]) -> Iterator[Slot]: ...
    def unit_state(self, k: int) -> tuple[dict[str, torch.Tensor], dict[str, dict[int, torch.Tensor]]]: ...
    def load_unit_state(
        self, k: int, flat: Mapping[str, torch.Tensor], scalars: Mapping[str, Mapping[int, torch.Tensor]]
    ) -> None: ...


def parameters_given_a_gradient(units: Sequence[FlatUnit], comm: Communicator, group: Group) -> list[set[int]]:
    """Per unit, the indices of the parameters some rank of `group` (the data-parallel ranks, whose
    gradients are reduced together) gave a gradient since the last step: one all-reduce (max) of a byte
    per parameter, read on the host (on CUDA, the step's host synchronization); none on one rank."""
    if group.size == 1:
        return [set(unit.with_grad) for unit in units]
    flags = gradient_flags(units)
    comm.all_reduce(flags, group, reduce="max")
    return given_of(units, flags)


def gradient_flags(units: Sequence[FlatUnit]) -> torch.Tensor:
    """A byte per parameter of `units`, in order: 1 where this rank gave it a gradient since the last step."""
    flags = torch.tensor([i in u.with_grad for u in units for i in range(len(u.params))], dtype=torch.uint8)
    return flags.to(units[0].options.device)


def given_of(units: Sequence[FlatUnit], flags: torch.Tensor) -> list[set[int]]:
    """Per unit, the indices of the parameters whose byte in `flags` (:func:`gradient_flags`) is set."""
    given, values = [], iter(flags.tolist())
    for unit in units:
        given.append({i for i in range(len(unit.params)) if next(values)})
    return given


def host_gradients(units: Sequence[FlatUnit], own: bool = False) -> dict[int, torch.Tensor]:
    """Every unit's reduced gradient in its master's device and dtype, every copy issued before any is
    waited for: ZeRO-Offload's one blocking wait of a step. `own`: a copy even where the buffer already
    has the master's device and dtype (one that outlives the unit's gradient buffers)."""
    copies = {
        k: u.reduced_gradient().to(u.master.device, u.master.dtype, non_blocking=True, copy=own)
        for k, u in enumerate(units)
    }
    device = units[0].options.device if units else None
    if device is not None and device.type == "cuda":  # the host optimizer reads these copies next
        torch.cuda.current_stream(device).synchronize()
    return copies


def step_masters(
    stepper: Stepper,
    optimizers: Sequence[torch.optim.Optimizer],
    copies: dict[int, torch.Tensor],
    scale: float | None,
    coefficient: torch.Tensor | None,
    batches: Iterable[Sequence[int]],
    given: Sequence[set[int]] | Mapping[int, set[int]] | None = None,
    publish: Callable[[int], None] | None = None,
) -> None:
    """Hand each unit of each batch its gradient in the master's dtype (from `copies`, else its reduced
    buffer; divided by the loss `scale`, clipped by `coefficient`; per segment only the parameters in
    `given`: See [Note: segments]), run `optimizers` (the stepper's or stand-ins for them) over the batch and
    `publish(k)` each unit stepped."""
    units = stepper.units
    for batch in batches:
        for k in batch:
            unit = units[k]
            grad = copies.pop(k, None)
            if grad is None:  # the reduced buffer itself where it has the master's dtype: its last use
                grad = unit.reduced_gradient().to(unit.master.device, unit.master.dtype)
            if scale is not None:
                grad.div_(scale)
            if coefficient is not None:
                grad.mul_(coefficient.to(grad.device))
            stepper.give(k, grad, given[k] if given is not None else None)
        for optimizer in optimizers:
            optimizer.step()
        for k in batch:
            stepper.take(k)
            if publish is not None:
                publish(k)


def publish_unit(unit: FlatUnit, params: ParamFiles | None) -> None:
    """Make `unit`'s compute weights follow its stepped master (written back to the parameters' disk
    tier, `params`, where they live there)."""
    if params is not None:
        params.publish(unit)
    else:
        unit.publish_master()


def step_units(
    stepper: Stepper,
    scaler: LossScaler,
    coefficient: torch.Tensor | None,
    host_copies: bool,
    disk: DiskTier | None,
    params: ParamFiles | None = None,
    given: list[set[int]] | None = None,
) -> None:
    """Step the optimizers over the batches of :func:`step_batches` (:func:`step_masters`), publishing
    each unit's weights after its step. `host_copies`: the masters live in host memory
    (:func:`host_gradients`). `disk`: the states stream through the disk tier, `params`: the compute
    shards are written back to theirs (See [Note: the disk tier's ring]); the reduced gradients come
    back from theirs with the states where the disk tier holds them (See [Note: gradients on disk])."""
    units = stepper.units
    copies = host_gradients(units) if host_copies else {}
    order = step_batches(stepper.optimizers, list(range(len(units))))
    batches = order if disk is None else disk.streamed(order)
    if disk is not None and disk.gradients is not None:
        disk.gradients.settle()
        batches = disk.gradients.taken(order, batches, copies)
    scale = scaler.scale if scaler.enabled else None
    step_masters(
        stepper,
        stepper.optimizers,
        copies,
        scale,
        coefficient,
        batches,
        given,
        lambda k: publish_unit(units[k], params),
    )
    if params is not None:
        params.flush()
