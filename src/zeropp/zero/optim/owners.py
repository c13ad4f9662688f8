"""The whole-parameter step: any optimizer, stepped on whole parameters, exactly.

See [Note: the whole-parameter step] (docs/design.md): each trainable parameter has an owner rank, which
keeps its fp32 master whole and steps it with the user's optimizers; gradients go to the owners and
updated parameters come back by two uneven all-to-alls a step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from zeropp.comm.communicator import Communicator
from zeropp.config.sections import ZeroConfig
from zeropp.errors import ConfigError
from zeropp.topology import Group
from zeropp.zero.optim.spec import OptimizerSpec
from zeropp.zero.optim.stepping import parameters_given_a_gradient
from zeropp.zero.precision import LossScaler
from zeropp.zero.unit import FlatUnit

Key = tuple[int, int]  # (unit, parameter index in the unit)
Piece = tuple[int, Key, tuple[int, int]]  # (group rank on the other side, parameter, [start, stop) in the flat buffer)
OWNER_OPS = ("to_owners", "from_owners")  # the ledger's names of a step's two exchanges


def balanced_owners(sizes: Sequence[int], ranks: int) -> list[int]:
    """An owner rank for each size: largest first to the least loaded rank (ties: the lower index)."""
    load, owners = [0] * ranks, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        owners[i], load[rank] = rank, load[rank] + sizes[i]
    return owners


class WholeParameterStep:
    """Owners, whole masters and the user's optimizers over them (See [Note: the whole-parameter step])."""

    def __init__(self, units: Sequence[FlatUnit], comm: Communicator, spec: OptimizerSpec, rank: int) -> None:
        self.units, self.comm, self.spec = list(units), comm, spec
        sharded = next((u for u in self.units if u.shard_world > 1), None)
        self.group = sharded.groups.shard if sharded is not None else Group(None, (rank,), 0)
        self.keys: list[Key] = [(k, i) for k, u in enumerate(self.units) for i in range(len(u.params))]
        sizes = [self.units[k].layout.numels[i] for k, i in self.keys]
        self.owner = dict(zip(self.keys, balanced_owners(sizes, self.group.size), strict=True))
        self.mine = [key for key in self.keys if self.owner[key] == self.group.rank]
        self.whole = {key: self._empty_master(key) for key in self.mine}
        self.plan = self._plan()
        self.plan_numel = sum(sizes)  # the elements the group moves one way: the same on every rank
        self.device = self.units[0].master.device if self.units else torch.device("cpu")
        self._versions: list[int] = []
        self._take_masters()
        by_param = {id(self.units[k].params[i]): self.whole[(k, i)] for k, i in self.mine}
        every = [self.whole[key] for key in self.mine]
        self.optimizers = [
            part.cls(part.groups_over(lambda p: by_param.get(id(p)), every)) for part in spec.parts
        ]  # fmt: skip
        self.owned = {self.units[k].names[i]: (k, i) for k, i in self.mine}  # name -> key

    def _take_masters(self) -> None:
        """The whole masters from the master shards (collective): at construction, and whenever the shards
        changed other than by this path's own step (a load of pretrained weights or of a checkpoint bumps
        the units' versions on every rank alike)."""
        wholes = {key: w.data for key, w in self.whole.items()}
        self._exchange(True, [u.master.data for u in self.units], wholes, label="owners.init")
        self._versions = [u.version for u in self.units]

    def _empty_master(self, key: Key) -> nn.Parameter:
        unit, index = self.units[key[0]], key[1]
        shape = unit.layout.shapes[index]
        return nn.Parameter(torch.empty(shape, dtype=torch.float32, device=unit.master.device))

    # -- the two directions of the exchange --------------------------------------------------------

    def _piece(self, key: Key, rank: int) -> tuple[int, int]:
        """[start, stop) of parameter `key` inside group rank `rank`'s shard, in the flat buffer (empty: start >= stop)."""
        layout = self.units[key[0]].layout
        a, b = layout.param_range(key[1])
        s, e = layout.shard_range(rank) if self.units[key[0]].shard_world > 1 else (0, layout.padded_numel)
        return max(a, s), min(b, e)

    def _shard_start(self, key: Key) -> int:
        unit = self.units[key[0]]
        return unit.layout.shard_range(self.group.rank)[0] if unit.shard_world > 1 else 0

    def _plan(self) -> tuple[list[Piece], list[Piece], list[int], list[int]]:
        """The exchanges' fixed plan (layouts and owners never change): this rank's pieces of other
        ranks' parameters by owner, the pieces of its own parameters by holder, and the element counts
        of each side's buffer per group rank."""
        n, me = self.group.size, self.group.rank
        held = [(dest, key, self._piece(key, me)) for dest in range(n) for key in self.keys if self.owner[key] == dest]
        owned = [(src, key, self._piece(key, src)) for src in range(n) for key in self.mine]
        held = [(r, key, (a, b)) for r, key, (a, b) in held if a < b]
        owned = [(r, key, (a, b)) for r, key, (a, b) in owned if a < b]
        held_counts, owned_counts = [0] * n, [0] * n
        for r, _, (a, b) in held:
            held_counts[r] += b - a
        for r, _, (a, b) in owned:
            owned_counts[r] += b - a
        return held, owned, held_counts, owned_counts

    def _exchange(
        self, to_owners: bool, shards: list[torch.Tensor], wholes: dict[Key, torch.Tensor], label: str
    ) -> None:
        """`to_owners`: this rank's pieces of `shards` (one flat shard per unit, aligned with its master)
        go into the owners' `wholes` (one per owned parameter). Otherwise the other way round."""
        held, owned, held_counts, owned_counts = self.plan

        def shard_view(key: Key, a: int, b: int) -> torch.Tensor:
            start = self._shard_start(key)
            return shards[key[0]][a - start : b - start]

        def whole_view(key: Key, a: int, b: int) -> torch.Tensor:
            first = self.units[key[0]].layout.param_range(key[1])[0]
            return wholes[key].view(-1)[a - first : b - first]

        shard_side, owner_side = (held, shard_view, held_counts), (owned, whole_view, owned_counts)
        sending, receiving = (shard_side, owner_side) if to_owners else (owner_side, shard_side)
        (sent, sent_view, in_counts), (received, received_view, out_counts) = sending, receiving
        inp = _cat([sent_view(key, a, b) for _, key, (a, b) in sent], self.device)
        out = torch.empty(sum(out_counts), dtype=torch.float32, device=self.device)
        self.comm.exchange(out, inp, self.group, out_counts, in_counts, label=label, plan_numel=self.plan_numel)
        for (_, key, (a, b)), piece in zip(received, out.split([b - a for _, _, (a, b) in received]), strict=True):
            received_view(key, a, b).copy_(piece)

    # -- the step ----------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, scaler: LossScaler, coefficient: torch.Tensor | None) -> None:
        """Gradients to their owners (unscaled, clipped), the user's optimizers on the whole masters,
        the updated parameters back to the shards, which publish them."""
        if [u.version for u in self.units] != self._versions:
            self._take_masters()
        grads = []
        for unit in self.units:
            grad = unit.reduced_gradient().to(torch.float32)  # the buffer itself where it is fp32: its last use
            if scaler.enabled:
                grad.div_(scaler.scale)
            if coefficient is not None:
                grad.mul_(coefficient.to(grad.device))
            grads.append(grad)
        for whole in self.whole.values():
            whole.grad = torch.empty_like(whole)
        self._exchange(True, grads, {key: w.grad for key, w in self.whole.items()}, label=OWNER_OPS[0])
        for key in self._without_gradient():  # as torch's optimizers skip a parameter whose grad is None
            self.whole[key].grad = None
        self.spec.follow_sources(self.optimizers)
        for optimizer in self.optimizers:
            optimizer.step()
        for whole in self.whole.values():
            whole.grad = None
        wholes = {key: w.data for key, w in self.whole.items()}
        self._exchange(False, [u.master.data for u in self.units], wholes, label=OWNER_OPS[1])
        for unit in self.units:
            unit.publish_master()
        self._versions = [u.version for u in self.units]

    def _without_gradient(self) -> list[Key]:
        """The owned parameters no data-parallel rank gave a gradient this step (an expert no token
        chose, a layer skipped)."""
        given = parameters_given_a_gradient(self.units, self.comm, self.units[0].groups.shard) if self.units else []
        return [(k, i) for k, i in self.mine if i not in given[k]]

    def masters(self) -> list[nn.Parameter]:
        return list(self.whole.values())

    def _optimizer_of(self, whole: nn.Parameter) -> torch.optim.Optimizer:
        return next(o for o in self.optimizers if any(whole is p for g in o.param_groups for p in g["params"]))

    def owned_state(self, name: str) -> dict[str, Any]:
        """The optimizer state of owned parameter `name`, whole, as its optimizer keeps it."""
        whole = self.whole[self.owned[name]]
        return self._optimizer_of(whole).state.get(whole, {})

    def owned_device(self, name: str) -> torch.device:
        return self.whole[self.owned[name]].device

    def load_owned_states(self, states: Mapping[str, dict[str, torch.Tensor]]) -> None:
        """Set each owned parameter's optimizer state (by name); the whole masters follow the loaded
        shards at the next step (their versions changed)."""
        for name, state in states.items():
            whole = self.whole[self.owned[name]]
            self._optimizer_of(whole).state[whole] = dict(state)


def _cat(pieces: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    return torch.cat([p.reshape(-1) for p in pieces]) if pieces else torch.empty(0, device=device)


def refuse_whole_with(described: str, config: ZeroConfig, tensor_parallel_size: int) -> None:
    """What the whole-parameter path (optimizer `described`) does not run with (yet), one line each,
    before any unit is built."""
    places = {"offload_optimizer": config.offload.optimizer, "offload_params": config.offload.params}
    offload = next((f"zero.{k} = {v!r}" for k, v in places.items() if v != "none"), None)
    tp = tensor_parallel_size
    why = offload or (f"topology.tensor_parallel_size = {tp} (a parameter is whole on no rank)" if tp > 1 else None)
    if why:
        raise ConfigError(
            f"optimizer {described} steps whole parameters on owner ranks, which does not run with {why}; "
            "use an element-wise optimizer with one param group (AdamW, SGD, ...) there"
        )
