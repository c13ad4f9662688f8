"""A stage-3 unit's frozen parameters: sharded like its weights, gathered with them, never optimized.

Frozen parameters (``requires_grad`` False: a LoRA run's base) have no fp32 master, no gradient buffer
and no optimizer state: :class:`FrozenWeights` keeps only this rank's shard of their own padded flat
buffer in the compute dtype, gathers it with its unit's weights (hpZ: from the secondary copy, cut
once, since the values never change; qwZ: quantized) and frees it with them (the storage-resize
trick). A unit may hold frozen parameters only (a frozen embedding in the root). Below stage 3
frozen parameters stay outside the units, whole on every rank, like buffers.

When the unit is released after backward is the runtime's concern: [Note: frozen weights in backward].
"""

from __future__ import annotations

import torch
from torch import nn

from zeropp.comm.communicator import Communicator, Pending
from zeropp.index.flat import FlatLayout, secondary_range
from zeropp.topology import ShardGroups
from zeropp.zero.dtensor_params import local_tensor, point_at
from zeropp.zero.gather import start_weight_gather
from zeropp.zero.options import UnitOptions


class FrozenWeights:
    """Frozen parameters of one unit: ``shard`` (this rank's compute-dtype piece of ``flat``), ``flat``
    (their storage, holding memory only while gathered unless `resident`), hpZ's ``secondary``."""

    def __init__(
        self,
        named_params: list[tuple[str, nn.Parameter]],
        comm: Communicator,
        groups: ShardGroups,
        options: UnitOptions,
        *,
        resident: bool,
        broadcast: bool,
    ) -> None:
        """Take the parameters' values (each rank rank 0's where `broadcast`) and release their own copies."""
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.comm, self.groups, self.options, self.resident = comm, groups, options, resident
        self.layout = FlatLayout(
            tuple(tuple(local_tensor(p).shape) for p in self.params), groups.shard.size, options.alignment
        )
        full = self.layout.join([local_tensor(p).detach() for p in self.params], options.compute_dtype, options.device)
        if broadcast:
            comm.broadcast(full[: self.layout.numel], groups.shard, src=groups.shard.ranks[0])
        start, stop = self.span
        where = options.compute_shard_device
        self.shard = options.host_empty(stop - start, options.compute_dtype, where).copy_(full[start:stop])
        self.secondary: torch.Tensor | None = None
        if groups.secondary is not None and not resident:  # valid for good: frozen values never change
            start, stop = secondary_range(self.layout.padded_numel, groups.secondary.size, groups.secondary.rank)
            self.secondary = full[start:stop].clone()
        self.flat = full if resident else torch.empty_like(full)
        del full
        for p, view in zip(self.params, self.layout.split(self.flat), strict=True):
            point_at(p, view)
        self.release()

    @property
    def span(self) -> tuple[int, int]:
        """[start, stop) of this rank's shard in the flat buffer."""
        return self.layout.shard_range(self.groups.shard.rank)

    def start_gather(self) -> Pending:
        """Re-grow ``flat`` and start gathering into it (see [Note: the storage-resize trick])."""
        self.flat.untyped_storage().resize_(self.layout.padded_numel * self.flat.element_size())
        return start_weight_gather(self.comm, self.options, self.groups, self.flat, self.shard, self.secondary)

    def release(self) -> None:
        if not self.resident:
            self.flat.untyped_storage().resize_(0)

    def whole(self) -> list[torch.Tensor]:
        """Every frozen parameter's whole value (a new tensor each; collective over the shard group)."""
        flat = torch.empty(self.layout.padded_numel, dtype=self.shard.dtype, device=self.options.device)
        self.comm.all_gather(
            flat, self.shard.to(self.options.device), self.groups.shard, bucket_numel=self.options.allgather_bucket
        )
        return [view.clone() for view in self.layout.split(flat)]

    def load(self, tensors: list[torch.Tensor]) -> None:
        """Set the frozen parameters from whole values (every rank the same), one per parameter."""
        full = self.layout.join(tensors, self.shard.dtype, self.options.device)
        self.load_shard(full[slice(*self.span)], full)

    def load_shard(self, shard: torch.Tensor, full: torch.Tensor | None = None) -> None:
        """Set this rank's shard (hpZ's copy and a resident ``flat`` follow: gathered when `full` is not given)."""
        self.shard.copy_(shard)
        if self.secondary is None and not self.resident:
            return
        if full is None:
            full = torch.empty(self.layout.padded_numel, dtype=self.shard.dtype, device=self.options.device)
            self.comm.all_gather(
                full, self.shard.to(self.options.device), self.groups.shard, bucket_numel=self.options.allgather_bucket
            )
        if self.secondary is not None:
            start, stop = secondary_range(
                self.layout.padded_numel, self.groups.secondary.size, self.groups.secondary.rank
            )
            self.secondary.copy_(full[start:stop])
        if self.resident:
            self.flat.copy_(full)

    def state_tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.shard, self.flat, self.secondary) if t is not None]
