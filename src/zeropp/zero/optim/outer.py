"""DiLoCo's outer step over nodes, on the shards: See [Note: the outer loop] (docs/design.md).

Every node trains a replica of its own, ZeRO sharding inside the node (``Topology.shard_groups(per_node=
True)``), so a rank and its peers at the same place on the other nodes hold the same slice of every unit's
master. Every ``sync_every`` steps each rank takes its slice's change since the last synchronization (the
outer gradient: anchor - master), averages it with those peers (one all-reduce over the inter-node group:
the only bytes that cross a node), and torch's SGD (Nesterov by default) steps the anchor with it; the
anchor becomes every replica's master again, and the inner optimizer's states carry on.

With ``outer_bits`` the change travels block-quantized instead: each rank quantizes its change plus
what its last quantization dropped (error feedback, kept in fp32), all-gathers the codes with its
peers, and every rank averages the same dequantized rows, so the replicas stay identical. An
all-gather sends (nodes - 1) x the quantized shard per rank, against the fp32 all-reduce's
2 (nodes - 1) / nodes x 4 bytes per value: int8 is about 4x fewer bytes across 2 nodes, 2.3x across 8.
"""

from __future__ import annotations

import torch

from zeropp.comm.communicator import Communicator
from zeropp.comm.quantized import all_gather_quantized
from zeropp.config.sections import ZeroConfig
from zeropp.errors import ConfigError
from zeropp.quant.backends import kernels_for
from zeropp.quant.spec import QuantSpec
from zeropp.topology import Group
from zeropp.zero.unit import FlatUnit


class OuterStep:
    """The anchors (the weights of the last synchronization, fp32, beside each unit's master) and the
    outer optimizer over them."""

    def __init__(self, units: list[FlatUnit], comm: Communicator, peers: Group, config: ZeroConfig) -> None:
        policy = config.outer
        self.units, self.comm, self.peers, self.every = units, comm, peers, policy.sync_every
        self.device = comm.topology.device  # where the exchange runs (the masters may be in host memory)
        self.anchors = [unit.master.detach().to(torch.float32, copy=True) for unit in units]
        self.spec = QuantSpec(policy.bits, policy.block_size) if policy.bits else None
        self.kernels = kernels_for(self.device, config.quant_backend) if policy.bits else None
        numel = sum(anchor.numel() for anchor in self.anchors)
        # what this rank's quantizations dropped, added to its next change (beside the masters)
        self.residual = None if self.spec is None else torch.zeros(numel, device=units[0].master.device)
        self.optimizer = torch.optim.SGD(self.anchors, lr=policy.lr, momentum=policy.momentum, nesterov=policy.nesterov)

    def tensors(self) -> list[torch.Tensor]:
        """What it keeps: the anchors, the outer momentum and the residual (model states: 8 or 12 bytes per
        parameter)."""
        residual = [] if self.residual is None else [self.residual]
        return [*self.anchors, *residual, *(v for state in self.optimizer.state.values() for v in state.values())]

    def restart(self) -> None:
        """Take the masters as the last synchronization's weights (after a load), the outer momentum from
        zero; a checkpoint's outer state is read over them (:mod:`zeropp.checkpoint.replicas`)."""
        for anchor, unit in zip(self.anchors, self.units, strict=True):
            anchor.copy_(unit.master.detach())
        self.optimizer.state.clear()

    def after_step(self, step: int) -> bool:
        """After inner step `step` (counted from 1): synchronize the replicas if it is a multiple of
        sync_every; return whether it was."""
        if step % self.every:
            return False
        pairs = zip(self.anchors, self.units, strict=True)
        changes = [(anchor - unit.master.detach().float()).to(self.device) for anchor, unit in pairs]
        if self.spec is None:
            self.comm.all_reduce_coalesced(changes, self.peers)  # the mean over the nodes
        else:
            changes = self._quantized_mean(changes)
        for anchor, change in zip(self.anchors, changes, strict=True):
            anchor.grad = change.to(anchor.device)
        self.optimizer.step()
        for anchor, unit in zip(self.anchors, self.units, strict=True):
            anchor.grad = None
            unit.master.data.copy_(anchor)
            unit.publish_master()
        return True

    def _quantized_mean(self, changes: list[torch.Tensor]) -> list[torch.Tensor]:
        """The nodes' mean of `changes` as every rank dequantizes them; this rank's residual updated."""
        assert self.spec is not None and self.kernels is not None and self.residual is not None
        mine = torch.cat(changes).add_(self.residual.to(self.device))
        n = self.peers.size
        rows = mine.new_empty(n * mine.numel())
        all_gather_quantized(self.comm, rows, mine, self.spec, self.peers, self.kernels, bucket_numel=rows.numel())
        rows = rows.view(n, -1)
        self.residual = mine.sub_(rows[self.peers.rank]).to(self.residual.device)  # mine is not needed again
        return list(rows.mean(0).split([c.numel() for c in changes]))


def runs_outer_loop(config: ZeroConfig, nodes: int, path: str) -> bool:
    """Whether DiLoCo's outer loop runs: asked for, on more than one node (one node is plain zeropp).
    What it cannot reach yet is refused in one line before any collective: the masters of the
    whole-parameter optimizer `path` live on their owners, and the disk tier's in files."""
    if not config.outer.enabled or nodes == 1:
        return False
    key = config.key("outer")("sync_every")
    every = config.outer.sync_every
    if path == "whole":
        raise ConfigError(
            f"{key} = {every}: DiLoCo steps the shards of element-wise optimizers only (this optimizer takes the "
            "whole-parameter path); expected 0, or an element-wise optimizer (AdamW, Adam, SGD, ...)", key, every,
        )  # fmt: skip
    if config.offload.optimizer == "nvme":
        raise ConfigError(
            f"{key} = {every} is not allowed with zero.offload_optimizer = 'nvme'; expected 0, or 'none' or 'cpu'",
            key, every,
        )  # fmt: skip
    return True
