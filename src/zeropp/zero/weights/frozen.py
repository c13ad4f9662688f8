"""A stage-3 unit's frozen parameters: sharded like its weights, gathered with them, never optimized.

Frozen parameters (``requires_grad`` False: a LoRA run's base) have no fp32 master, no gradient buffer
and no optimizer state: :class:`FrozenWeights` keeps only this rank's shard of their own padded flat
buffer in the compute dtype, gathers it with its unit's weights (hpZ: from the secondary copy, cut
once, since the values never change; qwZ: quantized) and frees it with them (the storage-resize
trick). A unit may hold frozen parameters only (a frozen embedding in the root). Below stage 3
frozen parameters stay outside the units, whole on every rank, like buffers.

With ``quantized_nontrainable_weights`` (issue 28's MixZ++ part) the shard is stored block-quantized
once (``nontrainable_weight_bits``: int8 or int4), as one ``joined`` data + fp32 scales message
(``message``, no ``shard``), gathered as it is and dequantized into ``flat``: every rank computes
with the same dequantized values, which are also what a resident unit and the saved ``fixed``
tensors hold. hpZ's copy is then the messages of its secondary range's rows (each rank's row as that
rank stores it), gathered inside the secondary group and dequantized the same way.

When the unit is released after backward is the runtime's concern: [Note: frozen weights in backward].
"""

from __future__ import annotations

import torch
from torch import nn

from zeropp.comm.communicator import Communicator, Pending
from zeropp.comm.quantized import all_gather_message, joined
from zeropp.index.flat import FlatLayout, secondary_range
from zeropp.topology import ShardGroups
from zeropp.zero.options import UnitOptions
from zeropp.zero.weights.dtensor_params import local_tensor, point_at
from zeropp.zero.weights.gather import start_weight_gather


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
        shapes, block = tuple(tuple(local_tensor(p).shape) for p in self.params), options.frozen_quant
        # quantized, each parameter's blocks hold its own values alone
        aligned = block.block_size if block is not None and block.block_size else 1
        self.layout = FlatLayout(shapes, groups.shard.size, options.alignment, aligned)
        full = self.layout.join([local_tensor(p).detach() for p in self.params], options.compute_dtype, options.device)
        if broadcast:
            comm.broadcast(full[: self.layout.end], groups.shard, src=groups.shard.ranks[0])
        self.shard: torch.Tensor | None = None
        self.message: torch.Tensor | None = None
        self.secondary: torch.Tensor | None = None  # hpZ's copy (valid for good: frozen values never change)
        if options.frozen_quant is not None:  # every rank's row quantized here (rows are independent)
            full = self._quantize(full)  # what every rank computes with
        else:
            where = options.compute_shard_device
            self.shard = options.host_empty(self.layout.shard_numel, options.compute_dtype, where)
            self.shard.copy_(full[slice(*self.span)])
            if groups.secondary is not None and not resident:
                self.secondary = full[slice(*self._secondary_span)].clone()
        self.flat = full if resident else torch.empty_like(full)
        del full
        for p, view in zip(self.params, self.layout.split(self.flat), strict=True):
            point_at(p, view)
        self.release()

    @property
    def span(self) -> tuple[int, int]:
        """[start, stop) of this rank's shard in the flat buffer."""
        return self.layout.shard_range(self.groups.shard.rank)

    @property
    def _secondary_span(self) -> tuple[int, int]:
        """[start, stop) of the flat buffer that hpZ's copy holds."""
        return secondary_range(self.layout.padded_numel, self.groups.secondary.size, self.groups.secondary.rank)

    def _quantize(self, full: torch.Tensor) -> torch.Tensor:
        """Keep this rank's row of `full` (every rank's shard a row) quantized in ``message`` (and hpZ's
        copy, its secondary range's rows, in ``secondary``); return the dequantized values of every row."""
        options, rows = self.options, full.view(self.groups.shard.size, -1)
        quantized = options.kernels.quantize(rows, options.frozen_quant)
        rank, where = self.groups.shard.rank, options.compute_shard_device
        mine = joined(quantized[rank : rank + 1])[0]
        self.message = options.host_empty(mine.numel(), torch.uint8, where).copy_(mine)
        if self.groups.secondary is not None and not self.resident:  # whole rows: the group size divides the world
            start, stop = (i // self.layout.shard_numel for i in self._secondary_span)
            self.secondary = joined(quantized[start:stop]).reshape(-1)
        return options.kernels.dequantize(quantized, full.dtype).reshape(-1)

    def start_gather(self) -> Pending:
        """Re-grow ``flat`` and start gathering into it (see [Note: the storage-resize trick])."""
        self.flat.untyped_storage().resize_(self.layout.padded_numel * self.flat.element_size())
        if self.message is None:
            return start_weight_gather(self.comm, self.options, self.groups, self.flat, self.shard, self.secondary)
        if self.secondary is not None:  # hpZ: the stored messages of the secondary range, inside its group
            return self._gather_message(self.flat, self.secondary, self.groups.secondary)
        return self._gather_message(self.flat, self.message, self.groups.shard)

    def _gather_message(self, out: torch.Tensor, message: torch.Tensor, group) -> Pending:
        """Every `group` rank's stored `message` (one or more shard rows) into `out`, dequantized."""
        options = self.options
        return all_gather_message(
            self.comm, out, message.to(options.device), self.layout.shard_numel, options.frozen_quant,
            group, options.kernels, bucket_numel=options.allgather_bucket, async_op=True,
        )  # fmt: skip

    def _gather_into(self, out: torch.Tensor) -> Pending:
        """Every rank's shard into `out` over the shard group, exactly (the quantized message as stored)."""
        options, group = self.options, self.groups.shard
        if self.message is None:
            shard = self.shard.to(options.device)
            return self.comm.all_gather(out, shard, group, bucket_numel=options.allgather_bucket, async_op=True)
        return self._gather_message(out, self.message, group)

    def release(self) -> None:
        if not self.resident:
            self.flat.untyped_storage().resize_(0)

    def whole(self) -> list[torch.Tensor]:
        """Every frozen parameter's whole value (a new tensor each; collective over the shard group)."""
        flat = torch.empty(self.layout.padded_numel, dtype=self.options.compute_dtype, device=self.options.device)
        self._gather_into(flat).wait()
        return [view.clone() for view in self.layout.split(flat)]

    def load(self, tensors: list[torch.Tensor]) -> None:
        """Set the frozen parameters from whole values (every rank the same), one per parameter."""
        full = self.layout.join(tensors, self.options.compute_dtype, self.options.device)
        self.load_shard(full[slice(*self.span)], full)

    def load_shard(self, shard: torch.Tensor, full: torch.Tensor | None = None) -> None:
        """Set this rank's shard (hpZ's copy and a resident ``flat`` follow: every rank's shard gathered
        when `full`, the whole buffer, is not given); quantized frozen weights are quantized again."""
        options = self.options
        if full is None and (self.secondary is not None or self.resident):
            full = torch.empty(self.layout.padded_numel, dtype=options.compute_dtype, device=options.device)
            values = shard.to(options.device, options.compute_dtype)
            self.comm.all_gather(full, values, self.groups.shard, bucket_numel=options.allgather_bucket)
        if self.message is None:
            self.shard.copy_(shard)
            if self.secondary is not None:
                self.secondary.copy_(full[slice(*self._secondary_span)])
        elif full is not None:
            full = self._quantize(full)
        else:
            values = shard.to(options.device, options.compute_dtype).view(1, -1)
            self.message.copy_(joined(options.kernels.quantize(values, options.frozen_quant))[0])
        if self.resident:
            self.flat.copy_(full)

    def state_tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.shard, self.message, self.flat, self.secondary) if t is not None]
