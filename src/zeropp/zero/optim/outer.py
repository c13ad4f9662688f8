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

Streaming DiLoCo (``outer_fragments`` F): the units are cut into F contiguous fragments of about equal
shard numel (:func:`~zeropp.index.flat.outer_fragments`, which the memory formula and the estimator
cut alike), and fragment f is synchronized after the inner steps t with t % H == ((f + 1) H // F) % H
(:meth:`~zeropp.config.policies.OuterLoop.synced_after`): every fragment once in H steps, the last on
plain DiLoCo's schedule, at most one a step, so a synchronization exchanges about 1/F of the model. A
fragment's synchronization is the one above over its units alone, with residuals of its own (chunks
of its own size); the one SGD over every anchor steps the fragment's alone, since torch's SGD skips a
parameter without a gradient, its momentum untouched, so each anchor's Nesterov momentum is that of
an SGD stepped once every H steps. F = 1 is plain DiLoCo, bit for bit.
"""

from __future__ import annotations

import torch

from zeropp.comm.communicator import Communicator
from zeropp.comm.feedback import ErrorFeedback
from zeropp.comm.quantized import gather_rows, reduce_scatter_quantized
from zeropp.config.sections import ZeroConfig
from zeropp.errors import ConfigError
from zeropp.index.flat import node_chunk_numel, outer_fragments
from zeropp.quant.backends import kernels_for
from zeropp.quant.spec import Quantized, QuantSpec
from zeropp.topology import Group, ShardGroups
from zeropp.zero.unit import FlatUnit

# the residuals' hops: what the all-to-all of this rank's chunks dropped (qgZ's inter-node hop), and
# what the all-gather of the mean chunk it owns dropped
HOPS = ("inter", "gather")


class OuterStep:
    """The anchors (the weights of the last synchronization, fp32, beside each unit's master) and the
    outer optimizer over them; with ``outer_fragments`` F the units in F fragments
    (:func:`~zeropp.index.flat.outer_fragments`), each synchronized on its own schedule
    (:meth:`~zeropp.config.policies.OuterLoop.synced_after`) with residuals of its own."""

    def __init__(self, units: list[FlatUnit], comm: Communicator, peers: Group, config: ZeroConfig) -> None:
        policy = config.outer
        self.units, self.comm, self.peers, self.policy = units, comm, peers, policy
        self.device = comm.topology.device  # where the exchange runs (the masters may be in host memory)
        self.anchors = [unit.master.detach().to(torch.float32, copy=True) for unit in units]
        self.spec = QuantSpec(policy.bits, policy.block_size) if policy.bits else None
        self.kernels = kernels_for(self.device, config.quant_backend) if policy.bits else None
        self.fragments = outer_fragments([anchor.numel() for anchor in self.anchors], policy.fragments)
        numels = [sum(self.anchors[i].numel() for i in fragment) for fragment in self.fragments]
        # values per node's chunk of each fragment's exchange, and its residuals by hop (beside the masters):
        # [nodes, chunk] and [1, chunk]
        self.chunks = [node_chunk_numel(numel, peers.size, policy.block_size) for numel in numels]
        self.feedback = [None if self.spec is None else ErrorFeedback(beta=0.0) for _ in self.fragments]
        for feedback, chunk in zip(self.feedback, self.chunks, strict=True):
            for hop, rows in zip(HOPS, (peers.size, 1), strict=True) if feedback is not None else ():
                feedback.residuals[hop] = torch.zeros(rows, chunk, device=units[0].master.device)
        # one SGD over every anchor: torch's SGD skips (and keeps the momentum of) those without a gradient
        self.optimizer = torch.optim.SGD(self.anchors, lr=policy.lr, momentum=policy.momentum, nesterov=policy.nesterov)

    def residuals(self) -> dict[str, torch.Tensor]:
        """The quantized exchange's residuals by hop (``inter``, ``gather``), with fragments by
        ``fragment<f>.<hop>`` (none in fp32)."""
        many = len(self.fragments) > 1
        return {
            (f"fragment{f}." if many else "") + hop: residual
            for f, feedback in enumerate(self.feedback)
            if feedback is not None
            for hop, residual in feedback.residuals.items()
        }

    def tensors(self) -> list[torch.Tensor]:
        """What it keeps: the anchors, the outer momentum and the residuals (model states: 8 bytes per
        parameter, and 4 (nodes + 1) per value of each fragment's chunk:
        :func:`~zeropp.costs.memory.outer_state_bytes`)."""
        momentum = (v for state in self.optimizer.state.values() for v in state.values())
        return [*self.anchors, *self.residuals().values(), *momentum]

    def restart(self) -> None:
        """Take the masters as the last synchronization's weights (after a load), the outer momentum from
        zero; a checkpoint's outer state is read over them (:mod:`zeropp.checkpoint.replicas`)."""
        for anchor, unit in zip(self.anchors, self.units, strict=True):
            anchor.copy_(unit.master.detach())
        self.optimizer.state.clear()

    def after_step(self, step: int) -> bool:
        """After inner step `step` (counted from 1): synchronize the fragments due (every fragment each
        sync_every steps, staggered); return whether one was."""
        synced = self.policy.synced_after(step)
        for fragment in synced:
            self._synchronize(fragment)
        return bool(synced)

    def _synchronize(self, fragment: int) -> None:
        """Plain DiLoCo's synchronization over the units of `fragment`: their change averaged over the
        nodes, the outer SGD stepped on their anchors alone, the anchors copied into their masters and
        published."""
        units = [self.units[i] for i in self.fragments[fragment]]
        anchors = [self.anchors[i] for i in self.fragments[fragment]]
        changes = [
            (anchor - unit.master.detach().float()).to(self.device) for anchor, unit in zip(anchors, units, strict=True)
        ]
        if self.spec is None:
            self.comm.all_reduce_coalesced(changes, self.peers)  # the mean over the nodes
        else:
            changes = self._quantized_mean(changes, fragment)
        for anchor, change in zip(anchors, changes, strict=True):
            anchor.grad = change.to(anchor.device)
        self.optimizer.step()
        for anchor, unit in zip(anchors, units, strict=True):
            anchor.grad = None
            unit.master.data.copy_(anchor)
            unit.publish_master()

    def _quantized_mean(self, changes: list[torch.Tensor], fragment: int) -> list[torch.Tensor]:
        """The nodes' mean of `changes` (of `fragment`'s units) as every rank dequantizes it; this rank's
        residuals of that fragment updated.

        The reduce-scatter is qgZ's with one rank a node on its first hop (this rank alone: nothing
        quantized or sent), its second hop the all-to-all of the chunks; the residuals move to the
        exchange's device for it and back."""
        feedback = self.feedback[fragment]
        assert self.spec is not None and self.kernels is not None and feedback is not None
        n, chunk, numel = self.peers.size, self.chunks[fragment], sum(c.numel() for c in changes)
        full = torch.zeros(n * chunk, device=self.device)  # the change, chunk j for peer j
        torch.cat(changes, out=full[:numel])
        home = feedback.residuals
        feedback.residuals = {hop: residual.to(self.device) for hop, residual in home.items()}
        mean = full.new_empty(chunk)  # this rank's chunk of the mean
        groups = ShardGroups(self.peers, Group(None, (self.comm.topology.rank,), 0), self.peers)
        reduce_scatter_quantized(
            self.comm, mean, full, self.spec, self.kernels, groups,
            chunks=1, bucket_numel=chunk, intra_spec=None, feedback=feedback,
        ).wait()  # fmt: skip
        quantized = feedback.quantize(self.kernels, HOPS[1], mean.view(1, -1), self.spec, 0, chunk)

        def land(rows: Quantized) -> None:  # every node's mean chunk, into `full` (read no more)
            self.kernels.dequantize(rows, torch.float32, out=full.view(n, chunk))

        gather_rows(self.comm, quantized, self.peers, land, bucket_numel=full.numel())
        for hop, residual in home.items():
            residual.copy_(feedback.residuals[hop])  # the same tensor where the exchange runs beside them
        feedback.residuals = home
        return list(full[:numel].split([c.numel() for c in changes]))


def runs_outer_loop(config: ZeroConfig, nodes: int, path: str) -> bool:
    """Whether DiLoCo's outer loop runs: asked for, on more than one node (one node is plain zeropp).
    What it cannot reach yet is refused in one line before any collective: the masters of the
    whole-parameter optimizer `path` live on their owners, and the disk tiers' in files (the
    parameters' tier writes each compute shard out after the inner step's publish; a synchronization
    publishing into it again crashed the ranks), and a delayed update's masters are a step ahead of the weights."""
    if not config.outer.enabled or nodes == 1:
        return False
    key = config.key("outer")("sync_every")
    every = config.outer.sync_every
    if path == "whole":
        raise ConfigError(
            f"{key} = {every}: DiLoCo steps the shards of element-wise optimizers only (this optimizer takes the "
            "whole-parameter path); expected 0, or an element-wise optimizer (AdamW, Adam, SGD, ...)", key, every,
        )  # fmt: skip
    for tier in ("optimizer", "params"):
        if getattr(config.offload, tier) == "nvme":
            raise ConfigError(
                f"{key} = {every} is not allowed with zero.offload_{tier} = 'nvme'; expected 0, or 'none' or 'cpu'",
                key, every,
            )  # fmt: skip
    if config.offload.delayed_update:  # the synchronization reads the masters right after the inner step
        delayed = config.key("offload")("delayed_update")
        raise ConfigError(
            f"{key} = {every} is not allowed with {delayed} = true; expected 0, or {delayed} = false", key, every
        )
    return True


def refuse_fragments(config: ZeroConfig, trainable_units: int) -> None:
    """Streaming DiLoCo's fragments are whole units: more of them than the model's units that hold
    trainable parameters is refused in one line (before any collective)."""
    fragments = config.outer.fragments
    if fragments > trainable_units:
        key = config.key("outer")("fragments")
        raise ConfigError(
            f"{key} = {fragments}: a fragment is whole units and {trainable_units} unit(s) hold trainable "
            f"parameters; expected at most {trainable_units}", key, fragments,
        )  # fmt: skip
