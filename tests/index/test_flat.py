"""Index math without processes: FlatLayout padding / shard / parameter ranges, and topology.Layout."""

from __future__ import annotations

import itertools
import math

import pytest

from zeropp.errors import ConfigError
from zeropp.index.flat import FlatLayout, column_chunks, qgz_column_chunks, secondary_range
from zeropp.index.ranks import Layout

SHAPE_SETS = [
    ((1,),),  # a single 1-element parameter
    ((1,), (1,), (1,)),
    ((7,),),
    ((13, 7), (13,), (3, 13), (3,)),  # the test MLP: primes everywhere
    ((5, 3, 2), (1,), (97,)),
    ((32,),),  # exactly one alignment quantum at world 1
    ((64, 2),),  # exactly world * alignment for world 4, alignment 32
    ((129,),),  # one past a quantum
    ((256, 32), (16, 32), (32,), (32,)),
    ((1001,), (999, 3)),
    ((0,), (3,)),  # an empty parameter among others
]
WORLDS = [1, 2, 3, 4, 8]
ALIGNMENTS = [1, 2, 32, 7]


@pytest.mark.parametrize("shapes", SHAPE_SETS, ids=[str(s) for s in SHAPE_SETS])
def test_padding_and_ranges(shapes):
    for world, alignment in itertools.product(WORLDS, ALIGNMENTS):
        layout = FlatLayout(shapes, world, alignment)
        what = f"shapes={shapes} world={world} alignment={alignment}"
        numel, padded, quantum = layout.numel, layout.padded_numel, world * alignment
        assert numel == sum(math.prod(s) for s in shapes), what
        assert padded % quantum == 0, what
        assert padded >= numel, what
        assert padded > 0, what
        assert padded - numel < quantum or numel == 0, what
        assert layout.shard_numel * world == padded, what
        assert layout.shard_numel % alignment == 0, what

        # shards tile [0, padded) exactly, in rank order
        cursor = 0
        for rank in range(world):
            start, stop = layout.shard_range(rank)
            assert start == cursor and stop - start == layout.shard_numel, what
            cursor = stop
        assert cursor == padded, what

        # parameters are contiguous, in order, and end at numel
        cursor = 0
        for index, shape in enumerate(shapes):
            start, stop = layout.param_range(index)
            assert start == cursor and stop - start == math.prod(shape), what
            cursor = stop
        assert cursor == numel, what


def test_padding_exact_values():
    assert FlatLayout(((1,),), 4, 32).padded_numel == 128
    assert FlatLayout(((128,),), 4, 32).padded_numel == 128
    assert FlatLayout(((129,),), 4, 32).padded_numel == 256
    assert FlatLayout(((7,),), 3, 1).padded_numel == 9
    assert FlatLayout(((7,),), 1, 1).padded_numel == 7
    assert FlatLayout(((13, 7), (13,)), 2, 32).shard_numel == 64  # 104 -> 128


@pytest.mark.parametrize(
    "world,nodes,node_of,intra,inter",
    [
        (4, 2, [0, 0, 1, 1], [(0, 1), (2, 3)], [(0, 2), (1, 3)]),
        (6, 3, [0, 0, 1, 1, 2, 2], [(0, 1), (2, 3), (4, 5)], [(0, 2, 4), (1, 3, 5)]),
        (4, 1, [0, 0, 0, 0], [(0, 1, 2, 3)], [(0,), (1,), (2,), (3,)]),
    ],
    ids=["2x2", "3x2", "1x4"],
)
def test_layout(world, nodes, node_of, intra, inter):
    layout = Layout(world, nodes)
    assert layout.ranks_per_node == world // nodes
    assert [layout.node_of(r) for r in range(world)] == node_of
    assert layout.intra_node_groups() == intra
    assert layout.inter_node_groups() == inter
    # every rank is in exactly one intra-node group and one inter-node group
    assert sorted(r for group in intra for r in group) == list(range(world))
    assert sorted(r for group in inter for r in group) == list(range(world))


@pytest.mark.parametrize("world,nodes", [(4, 3), (3, 2), (0, 1), (4, 0)])
def test_layout_refuses_uneven_split(world, nodes):
    with pytest.raises(ConfigError) as info:
        Layout(world, nodes)
    message = str(info.value)
    assert "\n" not in message
    assert "topology.nodes" in message and str(nodes) in message and str(world) in message


@pytest.mark.parametrize("shapes", SHAPE_SETS)
def test_split_and_join_are_inverse_views(shapes):
    import torch

    layout = FlatLayout(shapes, 4, 32)
    tensors = [torch.randn(shape) for shape in shapes]
    flat = layout.join(tensors, torch.float32, torch.device("cpu"))
    assert flat.numel() == layout.padded_numel
    assert not flat[layout.numel :].any()  # padding holds zeros
    views = layout.split(flat)
    assert [tuple(v.shape) for v in views] == [tuple(s) for s in shapes]
    for view, tensor, index in zip(views, tensors, range(len(shapes)), strict=True):
        assert torch.equal(view, tensor)
        start, stop = layout.param_range(index)
        if view.numel():
            assert view.data_ptr() == flat[start:stop].data_ptr()  # a view, not a copy


@pytest.mark.parametrize("numel", [0, 1, 2, 5, 7, 31, 32, 100])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 8])
def test_chunk_range_cuts_like_torch_chunk(numel, parts):
    import torch

    from zeropp.index.flat import chunk_range

    values = torch.arange(numel)
    pieces = torch.chunk(values, parts) if numel else ()
    for index in range(parts):
        start, stop = chunk_range(numel, parts, index)
        expected = pieces[index] if index < len(pieces) else values[:0]
        assert torch.equal(values[start:stop], expected)


@pytest.mark.parametrize(
    "world,nodes,setting,groups",
    [
        (4, 2, 0, [(0, 1), (2, 3)]),  # each node
        (8, 2, 8, None),  # as large as the world: off
        (8, 2, 2, [(0, 1), (2, 3), (4, 5), (6, 7)]),  # parts of a node
        (8, 4, 4, [(0, 1, 2, 3), (4, 5, 6, 7)]),  # two whole nodes
        (4, 4, 1, None),  # off
    ],
)
def test_hpz_groups_cover_each_data_parallel_group(world, nodes, setting, groups):
    layout = Layout(world, nodes)
    size = layout.hpz_group_size(setting)
    if groups is None:
        assert size == 1
        return
    assert layout.hpz_groups(size) == groups
    for group in groups:  # a group is whole nodes or inside one node
        spanned = {layout.node_of(r) for r in group}
        assert len(spanned) == 1 or len(group) == len(spanned) * layout.ranks_per_node


def test_mesh_groups_derive_from_the_data_parallel_groups():
    layout = Layout(8, 2)
    assert layout.data_parallel_groups() == [tuple(range(8))]
    assert (layout.data_parallel_size, layout.data_parallel_per_node) == (8, 4)
    assert layout.intra_node_groups() == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert layout.inter_node_groups() == [(0, 4), (1, 5), (2, 6), (3, 7)]


@pytest.mark.parametrize("alignment", [1, 32])
def test_a_32_element_parameter_with_hpz_16_at_world_2048(alignment):
    """DeepSpeed's failing shape (a 32-element parameter, hpZ 16, 2048 ranks on 256 nodes of 8): here the
    unit pads to world x alignment, so every rank has an equal, aligned shard and every hpZ secondary
    piece an equal slice; together they hold the parameter exactly once."""
    layout = Layout(2048, 256)
    size = layout.hpz_group_size(16)
    assert size == 16 and all(len(group) == 16 for group in layout.hpz_groups(size))
    flat = FlatLayout(((32,), (1,)), world=2048, alignment=alignment)  # a bias-like 1-element one behind it
    assert flat.padded_numel == max(1, math.ceil(33 / (2048 * alignment))) * 2048 * alignment
    shards = [flat.shard_range(rank) for rank in range(2048)]
    assert all(stop - start == flat.shard_numel >= 1 and start % alignment == 0 for start, stop in shards)
    pieces = [secondary_range(flat.padded_numel, size, rank) for rank in range(size)]
    assert pieces[0][0] == 0 and pieces[-1][1] == flat.padded_numel
    assert all(a[1] == b[0] and a[1] - a[0] == b[1] - b[0] for a, b in itertools.pairwise(pieces))
    # each secondary piece is the union of the primary shards of the ranks it stands for
    per_piece = 2048 // size
    assert all(pieces[i] == (shards[i * per_piece][0], shards[(i + 1) * per_piece - 1][1]) for i in range(size))
    held = [min(stop, 33) - max(start, 0) for start, stop in pieces if start < 33]
    assert sum(held) == 33 and flat.param_range(0) == (0, 32)


def test_qgz_column_chunks_cut_each_bucket_but_never_below_the_minimum():
    # two buckets of at most 100 columns, 3 chunks each: 6 near-equal chunks
    assert qgz_column_chunks(200, 100, 3, 1) == column_chunks(200, 6)
    # a chunk of 200 // 2 // 3 = 33 columns is under a minimum of 40: 2 a bucket instead
    assert qgz_column_chunks(200, 100, 3, 40) == column_chunks(200, 4)
    # under the minimum even whole: one chunk a bucket, never fewer than the buckets
    assert qgz_column_chunks(200, 100, 3, 1000) == [(0, 100), (100, 200)]
    assert qgz_column_chunks(50, 100, 2, 2**16) == [(0, 50)]
    # the small GPT's blocks on 4 ranks: 111,216 columns a shard, 2 chunks of 55,608 < 2^16: one chunk
    assert len(qgz_column_chunks(111_216, 2**24, 2, 2**16)) == 1
    assert len(qgz_column_chunks(2 * 2**16, 2**24, 2, 2**16)) == 2
