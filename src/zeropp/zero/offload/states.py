"""Training states moved off the device and back between phases (``engine.offload_states()`` /
``engine.reload_states()``), e.g. while a colocated RLHF job generates.

Three kinds, each a set of tensors the engine keeps between steps:

- ``optimizer``: every tensor of the optimizer's per-master state (Adam's ``exp_avg``, ``exp_avg_sq``
  and ``step`` where it lives on the device);
- ``master``: each unit's fp32 master, where it is a tensor of its own (a master that *is* the
  compute weights, fp32 at stage 0 or 3, stays: forward needs it);
- ``gradients``: the gradient buffers a unit keeps across steps (stages 0-1: ``grad_flat``; at
  stages 2-3 they exist only inside a step and there is nothing to move between steps). With MD the
  arena's buffer stays.

Only tensors on the engine's device move: a state already on the host (ZeRO-Offload's masters and
optimizer state) is left as it is. On CUDA each goes to pinned host memory (one synchronization per call) and its device copy is
freed; where the device is the CPU the move is a no-op in memory, and the accounting still says which
tensors now count as offloaded. Values are not touched, so training continues bit-identically.
From ``offload_states()`` to ``reload_states()`` (even where nothing moved) forward and generation run
(the compute weights stay) and backward, the optimizer step and a second offload are refused in one line.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from zeropp.errors import ConfigError
from zeropp.zero.optim.stepping import Slot, Stepper, state_slots
from zeropp.zero.unit import FlatUnit

KINDS = ("optimizer", "master", "gradients")


@dataclass
class StatesMoved:
    """What one call moved, per kind: tensor count and bytes."""

    tensors: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, tensor: torch.Tensor) -> None:
        self.tensors[kind] = self.tensors.get(kind, 0) + 1
        self.bytes[kind] = self.bytes.get(kind, 0) + tensor.numel() * tensor.element_size()


@dataclass(frozen=True)
class _Slot:
    """Where one state tensor is referenced: read it, or point the reference at a moved copy."""

    kind: str
    read: Callable[[], torch.Tensor]
    write: Callable[[torch.Tensor], None]


class StateOffloader:
    """Moves the states of `units` and `optimizers` (and the whole-parameter path's `masters`) between
    `device` and host memory."""

    def __init__(
        self, units: Sequence[FlatUnit], stepper: Stepper | None, optimizers: Sequence[torch.optim.Optimizer],
        device: torch.device, masters: Sequence[nn.Parameter] = (),
    ) -> None:  # fmt: skip
        """`stepper`: what steps the units' masters (their states' slots), None where `optimizers` step the
        whole-parameter path's `masters`."""
        self.units, self.stepper, self.optimizers = list(units), stepper, list(optimizers)
        self.device, self.masters = device, list(masters)
        self.offloaded: list[_Slot] | None = None  # None: no offload in effect

    def offload(self, include: str | Iterable[str] = KINDS) -> StatesMoved:
        include = (include,) if isinstance(include, str) else tuple(include)
        unknown = sorted(set(include) - set(KINDS))
        if unknown:
            raise ConfigError(f"offload_states: unknown state {unknown[0]!r}; expected some of {', '.join(KINDS)}")
        self.require_on_device("offload_states")
        moved, self.offloaded = StatesMoved(), []
        for slot in self._slots(include):
            tensor = slot.read()
            if tensor.device == self.device:
                slot.write(self._to_host(tensor))
                self.offloaded.append(slot)
                moved.add(slot.kind, tensor)
        self._synchronize()
        return moved

    def reload(self) -> StatesMoved:
        """Bring back what :meth:`offload` moved (nothing if nothing is offloaded)."""
        moved = StatesMoved()
        for slot in self.offloaded or ():
            tensor = slot.read()
            slot.write(tensor.to(self.device, non_blocking=True))
            moved.add(slot.kind, tensor)
        self.offloaded = None
        self._synchronize()
        return moved

    def require_on_device(self, what: str) -> None:
        if self.offloaded is not None:
            raise RuntimeError(f"zeropp: {what} with states offloaded; call engine.reload_states() first")

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return tensor
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return host.copy_(tensor, non_blocking=True)

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _slots(self, include: tuple[str, ...]) -> Iterator[_Slot]:
        for unit in self.units:
            on_host = unit.options.master_device is not None  # ZeRO-Offload: master and optimizer state
            if "master" in include and not on_host and not _is_compute_weights(unit):
                yield _Slot("master", lambda u=unit: u.master.data, lambda t, u=unit: setattr(u.master, "data", t))
            for name in ("grad_flat", "grad_shard") if "gradients" in include else ():
                if getattr(unit, name) is not None:
                    yield _Slot(
                        "gradients", lambda u=unit, n=name: getattr(u, n), lambda t, u=unit, n=name: setattr(u, n, t)
                    )
        for master in self.masters if "master" in include else ():
            yield _Slot("master", lambda m=master: m.data, lambda t, m=master: setattr(m, "data", t))
        for read, write in self._optimizer_states() if "optimizer" in include else ():
            yield _Slot("optimizer", read, write)

    def _optimizer_states(self) -> Iterator[Slot]:
        """(read, write) of each optimizer state tensor, asked at each offload (an optimizer creates its
        states at its first step): ZeRO-Offload's, which live on the host, stay."""
        if self.stepper is None:
            return state_slots(s for o in self.optimizers for s in o.state.values())
        return self.stepper.state_slots([k for k, u in enumerate(self.units) if u.options.master_device is None])


def _is_compute_weights(unit: FlatUnit) -> bool:
    """Whether the unit's master is the storage of its compute weights (fp32, stages 0 and 3)."""
    ptr = unit.master.data_ptr()
    return any(t is not None and t.data_ptr() == ptr for t in (unit.compute_flat, unit.compute_shard))
