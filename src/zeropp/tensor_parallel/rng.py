"""Dropout under tensor parallelism: which random stream each part of the model draws from.

What a tensor-parallel group computes whole (the embeddings, the residual stream, the head) is the
same on every rank of the group, so a dropout there must draw the same mask on every rank: it uses
the default generator, seeded alike. Between a column-wise linear whose output is split and the
row-wise linear that ends its layer, each rank holds its own heads or hidden units, and with
sequence parallelism, between the split layers, its own slice of the sequence: there each rank's
mask must be its own, as the parts of one mask over the whole tensor are (Megatron's
model-parallel generator). Without that, attention dropout on a rank's heads or a residual dropout
on a rank's slice repeats the same mask on every rank's part.

A region forks the generator (:class:`RankStream`): on entry it draws one seed from the CPU default
generator (the same draw on every rank: the default stream moves on alike), keeps the generators'
state and reseeds them with that seed mixed with the rank; on exit it puts the kept state back.
Because the seed is a draw of the default generator, activation checkpointing that restores the
generators before recomputing (torch's checkpoint does) recomputes the same masks; there is no
generator of our own for it to save.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from zeropp.tensor_parallel.plans import Plan, SequenceGathered, SequenceSliced

_GOLDEN = 0x9E3779B97F4A7C15  # spreads rank numbers over the seed's bits


class RankStream:
    """The generators of this process forked to a stream of this rank's own while a region of `holder`
    runs."""

    def __init__(self, rank: int, device: torch.device, holder: nn.Module) -> None:
        self.rank, self.device, self.holder = rank, device, holder
        self.kept: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def enter(self, *_) -> None:
        if not self.holder.training:  # no dropout in it: the default stream stays where training left it
            return
        if self.kept is not None:  # already inside (e.g. q, k and v each open attention's region)
            return
        seed = int(torch.randint(2**62, ()))
        cuda = self.device.type == "cuda"
        self.kept = (torch.get_rng_state(), torch.cuda.get_rng_state(self.device) if cuda else None)
        rank_seed = (seed ^ (self.rank * _GOLDEN)) & (2**63 - 1)
        torch.default_generator.manual_seed(rank_seed)
        if cuda:
            with torch.cuda.device(self.device):
                torch.cuda.manual_seed(rank_seed)

    def exit(self, *_) -> None:
        if self.kept is None:
            return
        cpu, cuda = self.kept
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, self.device)
        self.kept = None

    def forget(self, *_) -> None:
        """Drop a state kept by a region left open: a recomputation runs a block's ``forward`` without
        the module hooks around it, and torch's checkpoint may stop it before the region's end
        (restoring the generators itself)."""
        self.kept = None


def fork_split_regions(model: nn.Module, plan: Plan, rank: int, device: torch.device) -> None:
    """Give each region of `model` where tensor-parallel ranks hold different parts its own stream per
    rank, from `plan` (after ``parallelize_module`` applied it):

    - a layer: from the output of a column-wise style that splits it (not one gathering its output
      whole) to the input of the next row-wise style in the module holding it;
    - with sequence parallelism, from :class:`SequenceSliced`'s module to :class:`SequenceGathered`'s,
      held by the model.

    A region's holder forgets a state left open when its forward starts and closes the region when
    its forward ends, also when it raised."""
    edges = [
        (module, *edge)
        for pattern, style in plan.items()
        for name, module in _matching(model, pattern)
        if (edge := _region_edge(name, style)) is not None
    ]
    streams: dict[tuple[str, str], RankStream] = {}
    for module, region, opens in edges:
        if not opens:
            continue
        if region not in streams:
            holder = model.get_submodule(region[0])
            streams[region] = RankStream(rank, device, holder)
            holder.register_forward_pre_hook(streams[region].forget)
            holder.register_forward_hook(streams[region].exit, always_call=True)
        # a layer opens at its split output, the sequence's region at its first module's input
        register = module.register_forward_hook if region[1] == "layer" else module.register_forward_pre_hook
        register(streams[region].enter)
    for module, region, opens in edges:
        if not opens and region in streams:
            module.register_forward_pre_hook(streams[region].exit)


def _region_edge(name: str, style: ParallelStyle) -> tuple[tuple[str, str], bool] | None:
    """The region (holder's name, "layer" or "sequence") that a plan entry for module `name` opens
    (True) or closes (False); None: neither."""
    holder = name.rpartition(".")[0]
    if isinstance(style, ColwiseParallel) and not isinstance(style.output_layouts[0], Replicate):
        return (holder, "layer"), True
    if isinstance(style, RowwiseParallel):
        return (holder, "layer"), False
    if isinstance(style, (SequenceSliced, SequenceGathered)):
        return ("", "sequence"), isinstance(style, SequenceSliced)
    return None


def _matching(model: nn.Module, pattern: str) -> Iterator[tuple[str, nn.Module]]:
    """The modules a plan key names, matched as ``parallelize_module`` does: dot by dot, each part an
    fnmatch pattern."""
    parts = pattern.split(".")
    for name, module in model.named_modules():
        atoms = name.split(".")
        if len(atoms) == len(parts) and all(fnmatch.fnmatchcase(a, p) for a, p in zip(atoms, parts, strict=True)):
            yield name, module
