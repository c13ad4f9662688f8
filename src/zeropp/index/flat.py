"""Index math of a unit's flat buffer: where each parameter lives and which slice each rank owns.

Padding: the parameters of a unit are laid one after the other, each starting at a multiple of
``param_alignment`` (1: end to end; a quantization block: a block never holds two parameters'
elements), up to ``end``; the buffer is padded up to ``padded = ceil(end / (world * q)) * world *
q`` with ``q = lcm(alignment, param_alignment)``. Every rank's shard is then ``padded / world``
elements, a multiple of ``alignment``: equal shards make all-gather and reduce-scatter single calls,
and aligned shards start on a quantization-block boundary. The gaps between parameters and the pad
at the end (:meth:`FlatLayout.gaps`) hold zeros, receive zero gradients and therefore never change
(Adam's update of a zero with zero gradient is zero). ``numel`` counts the parameters' elements only.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class FlatLayout:
    shapes: tuple[tuple[int, ...], ...]
    world: int
    alignment: int
    param_alignment: int = 1

    @cached_property
    def numels(self) -> tuple[int, ...]:
        return tuple(math.prod(shape) for shape in self.shapes)

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        offsets, running, step = [], 0, self.param_alignment
        for n in self.numels:
            running = math.ceil(running / step) * step
            offsets.append(running)
            running += n
        return tuple(offsets)

    @property
    def numel(self) -> int:
        return sum(self.numels)

    @property
    def end(self) -> int:
        """Where the last parameter ends: the parameters and the gaps between them."""
        return self.offsets[-1] + self.numels[-1] if self.numels else 0

    @property
    def padded_numel(self) -> int:
        quantum = self.world * (math.lcm(self.alignment, self.param_alignment) if self.numels else self.alignment)
        return max(1, math.ceil(self.end / quantum)) * quantum

    def gaps(self) -> list[tuple[int, int]]:
        """[start, stop) of every stretch no parameter holds: between parameters, and the pad."""
        if not self.numels:
            return [(0, self.padded_numel)]
        stops = [o + n for o, n in zip(self.offsets, self.numels, strict=True)]
        return [(a, b) for a, b in zip(stops, [*self.offsets[1:], self.padded_numel], strict=True) if a < b]

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world

    def shard_range(self, rank: int) -> tuple[int, int]:
        """[start, stop) of `rank`'s shard in the padded flat buffer."""
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def param_range(self, index: int) -> tuple[int, int]:
        """[start, stop) of parameter `index` in the flat buffer."""
        start = self.offsets[index]
        return start, start + self.numels[index]

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views of a whole flat buffer, in the parameters' shapes (padding left out)."""
        return [flat[a : a + n].view(shape) for a, n, shape in zip(self.offsets, self.numels, self.shapes, strict=True)]

    def row_chunk(self, index: int, parts: int, part: int) -> tuple[int, int]:
        """[start, stop) inside parameter `index`, flattened, of piece `part` of its rows (its first
        dimension; a 0-d parameter is one row) cut like ``torch.chunk`` into `parts`: whole rows, so
        the piece is a block of the parameter's shape (a DTensor's ``Shard(0)``)."""
        shape = self.shapes[index]
        row = math.prod(shape[1:])
        start, stop = chunk_range(shape[0] if shape else 1, parts, part)
        return start * row, stop * row

    def join(self, tensors: Sequence[torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A new whole flat buffer holding `tensors` (one per parameter, any shape of its numel) and
        zeros in the padding: the inverse of :meth:`split`."""
        flat = torch.zeros(self.padded_numel, dtype=dtype, device=device)
        for view, tensor in zip(self.split(flat), tensors, strict=True):
            view.view(-1).copy_(tensor.reshape(-1))
        return flat


def secondary_range(padded_numel: int, group_size: int, group_rank: int) -> tuple[int, int]:
    """[start, stop) of the flat buffer that hpZ's secondary shard holds: the buffer cut into
    `group_size` equal pieces (padded_numel = world * shard and group_size divides world)."""
    assert padded_numel % group_size == 0, (padded_numel, group_size)
    size = padded_numel // group_size
    return group_rank * size, (group_rank + 1) * size


def chunk_range(numel: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of piece `index` of `numel` elements cut like ``torch.chunk`` into `parts`
    (a DTensor's ``Shard(0)``): pieces of ceil(numel / parts), the last shorter, trailing ones empty."""
    size = math.ceil(numel / parts)
    start = min(index * size, numel)
    return start, min(start + size, numel)


def qgz_send_order(ranks_per_node: int, nodes: int) -> list[int]:
    """qgZ's tensor-slice reordering (ZeRO++ eq. 2): the slice at each position of the send buffer.

    The flat gradient is W = X * Y slices (X ranks per node, Y nodes); slice z belongs to rank z,
    which is local rank z % X of node z // X. The intra-node all-to-all sends the j-th of X equal
    chunks of the buffer to local rank j, so chunk j must hold the slices of every node's local
    rank j: [j, X + j, 2X + j, ..., (Y-1)X + j]. After summing over the node, local rank j holds
    those Y slices in node order, and the inter-node all-to-all sends the m-th to node m: every
    slice reaches its owner. For X = Y = 2 this is [0, 2, 1, 3] (the paper's Fig. 9 swap).
    """
    return [node * ranks_per_node + local for local in range(ranks_per_node) for node in range(nodes)]


def qgz_slice_order(ranks_per_node: int, nodes: int, chunks: int) -> list[tuple[int, int]]:
    """The generalized reordering with pipelining (ZeRO++ Algorithm 2): (chunk, slice) at each position.

    Every slice is cut into `chunks` column chunks (the paper's pipeline stages); the buffer is
    chunk-major, and within a chunk it follows :func:`qgz_send_order`, so each chunk is one
    contiguous region that goes through both hops on its own. Position of (chunk k, slice z) is
    k*W + (z % X)*Y + z // X.
    """
    order = qgz_send_order(ranks_per_node, nodes)
    return [(chunk, z) for chunk in range(chunks) for z in order]


def qgz_column_chunks(shard: int, bucket: int, chunks: int, min_chunk: int) -> list[tuple[int, int]]:
    """[start, stop) of the column chunks qgZ reduces one after another for a shard of `shard` columns:
    each bucket of at most `bucket` columns cut into `chunks` pipelined chunks, or into fewer where a
    chunk would hold fewer than `min_chunk` columns (at least one a bucket)."""
    buckets = math.ceil(shard / bucket)
    per_bucket = max(1, min(chunks, shard // buckets // min_chunk))
    return column_chunks(shard, buckets * per_bucket)


def column_chunks(numel: int, pieces: int) -> list[tuple[int, int]]:
    """[start, stop) of `pieces` near-equal consecutive chunks of `numel` columns (empty ones dropped)."""
    bounds = [numel * i // pieces for i in range(pieces + 1)]
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]


def node_chunk_numel(numel: int, nodes: int, block: int) -> int:
    """Values per chunk where `numel` values are cut into `nodes` equal chunks of whole `block`s (the last
    ones padded): DiLoCo's quantized exchange, one chunk per node (See [Note: the outer loop])."""
    return block * math.ceil(numel / (nodes * block))


def outer_fragments(shards: Sequence[int], fragments: int) -> list[range]:
    """The units (by index) of each of Streaming DiLoCo's `fragments`, given each unit's master numel on a
    rank (`shards`, in unit order): contiguous, at least one unit each, and balanced by numel: boundary f
    is the unit boundary nearest f / F of the total (the first on a tie), within what leaves every
    fragment a unit (See [Note: the outer loop]). One fragment: every unit."""
    if not 1 <= fragments <= len(shards):
        raise ValueError(f"{fragments} fragments of {len(shards)} units")
    prefix = [0, *itertools.accumulate(shards)]
    total, bounds = prefix[-1], [0]
    for f in range(1, fragments):
        allowed = range(bounds[-1] + 1, len(shards) - (fragments - f) + 1)
        bounds.append(min(allowed, key=lambda i: abs(fragments * prefix[i] - f * total)))
    return [range(a, b) for a, b in zip(bounds, [*bounds[1:], len(shards)], strict=True)]
