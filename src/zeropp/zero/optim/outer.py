"""DiLoCo's outer step over nodes, on the shards: See [Note: the outer loop] (docs/design.md).

Every node trains a replica of its own, ZeRO sharding inside the node (``Topology.shard_groups(per_node=
True)``), so a rank and its peers at the same place on the other nodes hold the same slice of every unit's
master. Every ``sync_every`` steps each rank takes its slice's change since the last synchronization (the
outer gradient: anchor - master), averages it with those peers (one all-reduce over the inter-node group:
the only bytes that cross a node), and torch's SGD (Nesterov by default) steps the anchor with it; the
anchor becomes every replica's master again, and the inner optimizer's states carry on.

With ``outer_bits`` the change travels block-quantized instead, reduce-scattered over the nodes as qgZ
reduces gradients, then all-gathered: each rank cuts its change into one chunk per node (whole blocks,
the last ones zero-padded), quantizes them and sends chunk j to its peer on node j (one all-to-all),
averages in fp32 the chunks it receives (its chunk's mean over the nodes), quantizes that mean and
all-gathers it, so every rank dequantizes the same mean and the replicas stay identical. Both
quantizations keep an fp32 residual of what they dropped, added to the same values at the next
synchronization (error feedback: delayed, not lost): the n chunks of this rank's change and the mean
chunk it owns, 4 (n + 1) bytes per value of a chunk. A rank sends 2 (n - 1) quantized chunks, about
2 (n - 1) / n x its quantized shard, like the fp32 all-reduce's 2 (n - 1) / n x 4 bytes per value:
int8 is about 4x fewer bytes (int4 7x) on any number of nodes.
"""

from __future__ import annotations

import torch

from zeropp.comm.communicator import Communicator
from zeropp.comm.feedback import ErrorFeedback
from zeropp.comm.quantized import gather_rows, reduce_scatter_quantized
from zeropp.config.sections import ZeroConfig
from zeropp.errors import ConfigError
from zeropp.index.flat import node_chunk_numel
from zeropp.quant.backends import kernels_for
from zeropp.quant.spec import Quantized, QuantSpec
from zeropp.topology import Group, ShardGroups
from zeropp.zero.unit import FlatUnit

# the residuals' hops: what the all-to-all of this rank's chunks dropped (qgZ's inter-node hop), and
# what the all-gather of the mean chunk it owns dropped
HOPS = ("inter", "gather")


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
        self.numel = sum(anchor.numel() for anchor in self.anchors)
        self.chunk = node_chunk_numel(self.numel, peers.size, policy.block_size)  # values per node's chunk
        # the quantized exchange's residuals by hop (beside the masters): [nodes, chunk] and [1, chunk]
        self.feedback = None if self.spec is None else ErrorFeedback(beta=0.0)
        if self.feedback is not None:
            home = units[0].master.device
            for hop, rows in zip(HOPS, (peers.size, 1), strict=True):
                self.feedback.residuals[hop] = torch.zeros(rows, self.chunk, device=home)
        self.optimizer = torch.optim.SGD(self.anchors, lr=policy.lr, momentum=policy.momentum, nesterov=policy.nesterov)

    def residuals(self) -> dict[str, torch.Tensor]:
        """The quantized exchange's residuals by hop (none in fp32)."""
        return {} if self.feedback is None else self.feedback.residuals

    def tensors(self) -> list[torch.Tensor]:
        """What it keeps: the anchors, the outer momentum and the residuals (model states: 8 bytes per
        parameter, and 4 (nodes + 1) per value of a chunk: :func:`~zeropp.costs.memory.outer_state_bytes`)."""
        momentum = (v for state in self.optimizer.state.values() for v in state.values())
        return [*self.anchors, *self.residuals().values(), *momentum]

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
        """The nodes' mean of `changes` as every rank dequantizes it; this rank's residuals updated.

        The reduce-scatter is qgZ's with one rank a node on its first hop (this rank alone: nothing
        quantized or sent), its second hop the all-to-all of the chunks; the residuals move to the
        exchange's device for it and back."""
        assert self.spec is not None and self.kernels is not None and self.feedback is not None
        n, chunk = self.peers.size, self.chunk
        full = torch.zeros(n * chunk, device=self.device)  # the change, chunk j for peer j
        torch.cat(changes, out=full[: self.numel])
        home = self.feedback.residuals
        self.feedback.residuals = {hop: residual.to(self.device) for hop, residual in home.items()}
        mean = full.new_empty(chunk)  # this rank's chunk of the mean
        groups = ShardGroups(self.peers, Group(None, (self.comm.topology.rank,), 0), self.peers)
        reduce_scatter_quantized(
            self.comm, mean, full, self.spec, self.kernels, groups,
            chunks=1, bucket_numel=chunk, intra_spec=None, feedback=self.feedback,
        ).wait()  # fmt: skip
        quantized = self.feedback.quantize(self.kernels, HOPS[1], mean.view(1, -1), self.spec, 0, chunk)

        def land(rows: Quantized) -> None:  # every node's mean chunk, into `full` (read no more)
            self.kernels.dequantize(rows, torch.float32, out=full.view(n, chunk))

        gather_rows(self.comm, quantized, self.peers, land, bucket_numel=full.numel())
        for hop, residual in home.items():
            residual.copy_(self.feedback.residuals[hop])  # the same tensor where the exchange runs beside them
        self.feedback.residuals = home
        return list(full[: self.numel].split([c.numel() for c in changes]))


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
