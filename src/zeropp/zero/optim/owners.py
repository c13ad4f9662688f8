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
from zeropp.zero.precision import LossScaler
from zeropp.zero.unit import FlatUnit

Key = tuple[int, int]  # (unit, parameter index in the unit)
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

    def _exchange(
        self, to_owners: bool, shards: list[torch.Tensor], wholes: dict[Key, torch.Tensor], label: str
    ) -> None:
        """`to_owners`: this rank's pieces of `shards` (one flat shard per unit, aligned with its master)
        go into the owners' `wholes` (one per owned parameter). Otherwise the other way round."""
        n, me = self.group.size, self.group.rank
        local = []  # (rank, key, flat range) in the order of the shard side's buffer
        for dest in range(n):
            local.extend((dest, key, self._piece(key, me)) for key in self.keys if self.owner[key] == dest)
        remote = [(src, key, self._piece(key, src)) for src in range(n) for key in self.mine]
        local = [(r, key, (a, b)) for r, key, (a, b) in local if a < b]
        remote = [(r, key, (a, b)) for r, key, (a, b) in remote if a < b]
        shard_counts, owner_counts = [0] * n, [0] * n
        for r, _, (a, b) in local:
            shard_counts[r] += b - a
        for r, _, (a, b) in remote:
            owner_counts[r] += b - a
        plan_numel = sum(self.units[k].layout.numels[i] for k, i in self.keys)
        device = self.units[0].master.device if self.units else torch.device("cpu")

        def shard_view(key: Key, a: int, b: int) -> torch.Tensor:
            start = self._shard_start(key)
            return shards[key[0]][a - start : b - start]

        def whole_view(key: Key, a: int, b: int) -> torch.Tensor:
            first = self.units[key[0]].layout.param_range(key[1])[0]
            return wholes[key].view(-1)[a - first : b - first]

        if to_owners:
            inp = _cat([shard_view(key, a, b) for _, key, (a, b) in local], device)
            out = torch.empty(sum(owner_counts), dtype=torch.float32, device=device)
            self.comm.exchange(out, inp, self.group, owner_counts, shard_counts, label=label, plan_numel=plan_numel)
            for (_, key, (a, b)), piece in zip(remote, out.split([b - a for _, _, (a, b) in remote]), strict=True):
                whole_view(key, a, b).copy_(piece)
        else:
            inp = _cat([whole_view(key, a, b) for _, key, (a, b) in remote], device)
            out = torch.empty(sum(shard_counts), dtype=torch.float32, device=device)
            self.comm.exchange(out, inp, self.group, shard_counts, owner_counts, label=label, plan_numel=plan_numel)
            for (_, key, (a, b)), piece in zip(local, out.split([b - a for _, _, (a, b) in local]), strict=True):
                shard_view(key, a, b).copy_(piece)

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
        for part, optimizer in zip(self.spec.parts, self.optimizers, strict=True):
            part.follow_source(optimizer)
            optimizer.step()
        for whole in self.whole.values():
            whole.grad = None
        wholes = {key: w.data for key, w in self.whole.items()}
        self._exchange(False, [u.master.data for u in self.units], wholes, label=OWNER_OPS[1])
        for unit in self.units:
            unit.publish_master()
        self._versions = [u.version for u in self.units]

    def _without_gradient(self) -> list[Key]:
        """The owned parameters no rank gave a gradient this step (an expert no token chose, a layer
        skipped): one max all-reduce of a flag per parameter, read on the host."""
        device = self.units[0].master.device if self.units else torch.device("cpu")
        given = torch.tensor([float(i in self.units[k].with_grad) for k, i in self.keys], device=device)
        self.comm.all_reduce(given, self.group, reduce="max")
        flags = dict(zip(self.keys, given.tolist(), strict=True))
        return [key for key in self.mine if not flags[key]]

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
