"""The segment step: element-wise optimizers over the pieces of parameters a rank's shards hold.

[Note: segments]
A unit's master is one flat fp32 shard: pieces of several parameters end to end, with alignment gaps
and padding between them. The segment step hands the optimizer one tensor per piece, a view of the
master (a *segment*), rather than the master itself, as FSDP2 hands it one shard per parameter. An
element-wise optimizer computes on a segment what it computes on those elements of the parameter,
and what torch keeps per parameter stays per parameter:

- param groups: each segment joins its parameter's group, in the user's optimizer (any number of
  groups and of optimizers over disjoint parameters, each with its own hyperparameters);
- a parameter no data-parallel rank gave a gradient since the last step (an expert no token chose, a
  layer skipped) has none: torch's optimizers skip it, weights, state and step count untouched, where
  a flat master would step its elements with a zero gradient and move them by their momentum and
  weight decay. Which parameters got one is one all-reduce (max) of a byte per parameter a step
  (:func:`~zeropp.zero.optim.stepping.parameters_given_a_gradient`), read on the host;
- step counts (Adam's bias correction) are per parameter, as torch's.

A segment's per-element states are views of one master-shaped buffer per unit and key (after the
segment's first step: :meth:`SegmentStep.home`), so they take the flat path's memory, and checkpoints
read each unit's states as the flat path keeps them (:meth:`SegmentStep.unit_state`): both paths save
and load the same per-parameter entries. Which keys a unit has is read from the optimizers' classes
(:func:`probe_state_keys`), not from the segments a rank holds, so every rank gathers the same ones.
The disk tier and the bf16 optimizer states step the flat master (``zero.optimizer_path = "flat"``,
DeepSpeed's way: a parameter without a gradient is stepped with a zero one).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from zeropp.zero.optim.spec import OptimizerSpec
from zeropp.zero.optim.stepping import Slot, parameters_given_a_gradient
from zeropp.zero.unit import FlatUnit

if TYPE_CHECKING:
    from zeropp.comm.communicator import Communicator
    from zeropp.topology import Group


@dataclass(frozen=True)
class Segment:
    """Parameter `index` of a unit: its elements [start, stop) of the unit's master, and the tensor the
    optimizer steps (a view of them)."""

    index: int
    start: int
    stop: int
    tensor: nn.Parameter


def unit_segments(unit: FlatUnit) -> list[Segment]:
    """The segments of `unit`'s master on this rank, in the layout's order."""
    offset, end = unit.layout.shard_range(unit.groups.shard.rank) if unit.shard_world > 1 else (0, unit.master.numel())
    segments = []
    for index in range(len(unit.params)):
        a, b = unit.layout.param_range(index)
        start, stop = max(a, offset) - offset, min(b, end) - offset
        if start < stop:
            segments.append(
                Segment(index, start, stop, nn.Parameter(unit.master.data[start:stop], requires_grad=False))
            )
    return segments


@dataclass(frozen=True)
class StateKeys:
    """The states an optimizer class keeps for a parameter under one group's hyperparameters."""

    per_element: dict[str, torch.dtype]
    scalars: frozenset[str]


def probe_state_keys(
    cls: type[torch.optim.Optimizer], hyperparameters: dict[str, Any], device: torch.device
) -> StateKeys:
    """What `cls` keeps for a parameter under `hyperparameters`, read from one step of a fresh instance
    on a stand-in of two elements: the same on every rank, whichever parameters it holds."""
    stand_in = nn.Parameter(torch.zeros(2, device=device))
    optimizer = cls([{**hyperparameters, "params": [stand_in]}])
    stand_in.grad = torch.ones(2, device=device)
    optimizer.step()
    state = optimizer.state[stand_in]
    per_element = {k: v.dtype for k, v in state.items() if isinstance(v, torch.Tensor) and v.shape == stand_in.shape}
    return StateKeys(per_element, frozenset(k for k in state if k not in per_element))


class SegmentStep:
    """The segments of every unit and the optimizers over them (See [Note: segments])."""

    def __init__(self, units: Sequence[FlatUnit], spec: OptimizerSpec) -> None:
        self.units = list(units)
        self.segments = [unit_segments(unit) for unit in self.units]
        every = [s.tensor for segments in self.segments for s in segments]
        pairs = zip(self.units, self.segments, strict=True)
        by_param = {id(unit.params[s.index]): s.tensor for unit, segments in pairs for s in segments}
        self.optimizers = [part.cls(part.groups_over(lambda p: by_param.get(id(p)), every)) for part in spec.parts]
        self.optimizer_of = {id(t): o for o in self.optimizers for g in o.param_groups for t in g["params"]}
        self.buffers: list[dict[str, torch.Tensor]] = [{} for _ in self.units]  # per unit: master-shaped states
        # every parameter's state keys, on every rank (checkpoints gather a unit's states key by key)
        device = self.units[0].master.device if self.units else torch.device("cpu")
        probes = {
            (p, g): probe_state_keys(part.cls, hyper, device)
            for p, part in enumerate(spec.parts)
            for g, hyper in enumerate(part.hyperparameters)
        }
        group_of = {
            id(q): (p, g) for p, part in enumerate(spec.parts) for g, qs in enumerate(part.members or []) for q in qs
        }
        self.keys = [[probes[group_of.get(id(q), (0, 0))] for q in unit.params] for unit in self.units]

    def tensors(self, k: int) -> list[nn.Parameter]:
        """What the optimizers step for unit `k`."""
        return [s.tensor for s in self.segments[k]]

    def given_gradients(self, comm: Communicator, group: Group) -> list[set[int]]:
        """Per unit, the parameters some rank of `group` gave a gradient: the others are skipped."""
        return parameters_given_a_gradient(self.units, comm, group)

    def give(self, k: int, grad: torch.Tensor, given: set[int]) -> None:
        """Unit `k`'s segments take their pieces of `grad` (aligned with the master), those of the
        parameters in `given` only; each segment first follows the master's storage (moved by
        ``offload_states`` or a load)."""
        master = self.units[k].master.data
        for s in self.segments[k]:
            s.tensor.data = master[s.start : s.stop]
            s.tensor.grad = grad[s.start : s.stop] if s.index in given else None

    def take(self, k: int) -> None:
        """Unit `k`'s step is over: its segments' gradients dropped, the stepped ones' states homed (a state
        is created at a segment's first step, so only a stepped segment can hold one not yet homed)."""
        stepped = [s for s in self.segments[k] if s.tensor.grad is not None]
        for s in self.segments[k]:
            s.tensor.grad = None
        self.home(k, stepped)

    def _state(self, segment: Segment) -> dict[str, Any]:
        return self.optimizer_of[id(segment.tensor)].state.get(segment.tensor, {})

    def _per_element(self, segment: Segment) -> Iterator[tuple[str, torch.Tensor]]:
        state = self._state(segment)
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == segment.tensor.shape:
                yield key, value

    def home(self, k: int, segments: Sequence[Segment] | None = None) -> None:
        """Unit `k`'s per-element states into one master-shaped buffer per key, each segment's state a
        view of it (zeros in the gaps): the memory of the flat path's states, one tensor per key. Run
        after each step of the unit over the segments it stepped (`segments`; default: all of the unit's)."""
        master, buffers = self.units[k].master, self.buffers[k]
        for s in self.segments[k] if segments is None else segments:
            for key, value in list(self._per_element(s)):
                buffer = buffers.get(key)
                if buffer is None:
                    buffer = buffers[key] = torch.zeros(master.shape, dtype=value.dtype, device=value.device)
                view = buffer[s.start : s.stop]
                if value.data_ptr() != view.data_ptr():
                    view.copy_(value)
                    self._state(s)[key] = view

    def replace_buffer(self, k: int, key: str, tensor: torch.Tensor) -> None:
        """Unit `k`'s state buffer `key` is now `tensor` (moved by ``offload_states``): every segment's
        state follows it."""
        self.buffers[k][key] = tensor
        for s in self.segments[k]:
            state = self._state(s)
            if key in state:
                state[key] = tensor[s.start : s.stop]

    def state_slots(self, units: Sequence[int]) -> Iterator[Slot]:
        """(read, write) of every state tensor of units `units` that holds memory of its own: the buffers,
        and the other states (a step count on the device)."""
        for k in units:
            for key in self.buffers[k]:
                yield (
                    (lambda k=k, key=key: self.buffers[k][key]),
                    (lambda t, k=k, key=key: self.replace_buffer(k, key, t)),
                )
            for s in self.segments[k]:
                state, per_element = self._state(s), dict(self._per_element(s))
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and key not in per_element:
                        yield (lambda st=state, key=key: st[key]), (lambda t, st=state, key=key: st.__setitem__(key, t))

    def unit_state(self, k: int) -> tuple[dict[str, torch.Tensor], dict[str, dict[int, torch.Tensor]]]:
        """Unit `k`'s optimizer state as the flat path keeps it: per-element states as flat tensors
        aligned with the master, one for every key any of its parameters' optimizers keeps, in key order
        (zeros in the gaps, where a parameter has no state, or where this rank holds none of it), scalars
        per parameter index this rank holds (none for a parameter never stepped)."""
        self.home(k)
        master = self.units[k].master
        for key, dtype in sorted({kv for keys in self.keys[k] for kv in keys.per_element.items()}):
            if key not in self.buffers[k]:
                self.buffers[k][key] = torch.zeros(master.shape, dtype=dtype, device=master.device)
        self.buffers[k] = dict(sorted(self.buffers[k].items()))
        scalars: dict[str, dict[int, torch.Tensor]] = {}
        for s in self.segments[k]:
            per_element = dict(self._per_element(s))
            for key, value in self._state(s).items():
                if key not in per_element:
                    scalars.setdefault(key, {})[s.index] = value
        return dict(self.buffers[k]), scalars

    def load_unit_state(
        self, k: int, flat: Mapping[str, torch.Tensor], scalars: Mapping[str, Mapping[int, torch.Tensor]]
    ) -> None:
        """Set unit `k`'s segments' states from the form of :meth:`unit_state`: where the checkpoint has
        step counts, a parameter without one was never stepped and gets no state, as in torch."""
        self.buffers[k] = {key: value.to(self.units[k].master.device, copy=True) for key, value in flat.items()}
        for s in self.segments[k]:
            keys = self.keys[k][s.index]
            state = {key: by_index[s.index] for key, by_index in scalars.items() if s.index in by_index}
            if state.keys() == keys.scalars:
                state |= {key: self.buffers[k][key][s.start : s.stop] for key in keys.per_element}
            else:  # never stepped
                state = {}
            optimizer = self.optimizer_of[id(s.tensor)]
            if state:
                optimizer.state[s.tensor] = state
            else:
                optimizer.state.pop(s.tensor, None)
