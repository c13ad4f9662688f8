"""Single-process tests of qgZ's index math (``zeropp.index.flat``): ``qgz_send_order`` against eq. 2
of ZeRO++, ``qgz_slice_order`` against Algorithm 2, a symbolic simulation of the two-hop qgZ exchange
for every X, Y <= 8 and stages <= 4, ``column_chunks`` and ``secondary_range``."""

from __future__ import annotations

from collections import Counter

import pytest

from zeropp.index.flat import column_chunks, qgz_send_order, qgz_slice_order, secondary_range


def _eq2(x: int, y: int) -> list[int]:
    """ZeRO++ eq. 2 written out: for each local rank j, the slices j, X + j, ..., (Y - 1) X + j."""
    order = []
    for j in range(x):
        for m in range(y):
            order.append(m * x + j)
    return order


def test_qgz_send_order_paper_example():
    assert qgz_send_order(2, 2) == [0, 2, 1, 3]


@pytest.mark.parametrize("x, y", [(1, 1), (1, 4), (4, 1), (2, 3), (3, 2), (4, 4), (8, 2), (2, 8)])
def test_qgz_send_order_is_eq2(x, y):
    order = qgz_send_order(x, y)
    assert order == _eq2(x, y)
    assert order[:y] == [m * x for m in range(y)]  # [0, X, 2X, ..., (Y-1)X, ...]
    assert order[-1] == x * y - 1
    assert sorted(order) == list(range(x * y))


@pytest.mark.parametrize("x, y, stages", [(1, 1, 1), (2, 2, 3), (3, 2, 2), (2, 5, 4), (4, 3, 1), (8, 8, 4)])
def test_qgz_slice_order_is_algorithm2(x, y, stages):
    order = qgz_slice_order(x, y, stages)
    assert len(order) == stages * x * y
    assert sorted(order) == [(k, z) for k in range(stages) for z in range(x * y)]
    for position, (k, z) in enumerate(order):
        assert position == k * x * y + (z % x) * y + z // x, (position, k, z)


def _simulate_qgz(x: int, y: int, stages: int, order: list[tuple[int, int]]) -> dict:
    """Run the two qgZ hops on labels with the send buffer `order` of (stage, slice) items.

    Returns {rank: {stage: ((slice, stage) held, Counter of contributing ranks)}}.

    Raises AssertionError when a receiver would sum chunks holding different (slice, stage) items.
    """
    world = x * y
    result: dict = {r: {} for r in range(world)}
    for k in range(stages):
        send = [(z, stage) for stage, z in order if stage == k]  # every rank's buffer for stage k
        assert len(send) == world
        # hop 1: chunk j of rank (node, i) -> rank (node, j); the receiver sums the X chunks
        reduced = {}
        for node in range(y):
            for j in range(x):
                chunks = [(node * x + i, send[j * y : (j + 1) * y]) for i in range(x)]
                labels = chunks[0][1]
                assert all(chunk == labels for _, chunk in chunks), (x, y, k, node, j)
                reduced[node * x + j] = [(label, Counter(sender for sender, _ in chunks)) for label in labels]
        # hop 2: among ranks with local index j, the m-th item of rank (node, j) -> rank (m, j)
        for receiver in range(world):
            m, j = divmod(receiver, x)
            items = [reduced[node * x + j][m] for node in range(y)]
            labels = {label for label, _ in items}
            assert len(labels) == 1, (x, y, k, receiver, labels)
            contributors = sum((c for _, c in items), Counter())
            result[receiver][k] = (labels.pop(), contributors)
    return result


@pytest.mark.parametrize("y", range(1, 9))
@pytest.mark.parametrize("x", range(1, 9))
def test_qgz_two_hop_exchange_delivers_every_slice(x, y):
    world = x * y
    everyone = Counter(range(world))
    for stages in range(1, 5):
        held = _simulate_qgz(x, y, stages, qgz_slice_order(x, y, stages))
        for rank in range(world):
            assert sorted(held[rank]) == list(range(stages))
            for k in range(stages):
                label, contributors = held[rank][k]
                assert label == (rank, k), (x, y, stages, rank, k, label)
                assert contributors == everyone, (x, y, stages, rank, k)


def test_simulation_catches_a_wrong_order():
    """The simulation itself can fail: without the reordering, slices reach the wrong ranks."""
    for x, y in [(2, 2), (3, 2), (2, 4)]:
        identity = [(k, z) for k in range(2) for z in range(x * y)]
        held = _simulate_qgz(x, y, 2, identity)
        assert any(held[r][k][0] != (r, k) for r in range(x * y) for k in range(2)), (x, y)


@pytest.mark.parametrize("numel", [0, 1, 2, 3, 5, 7, 8, 64, 100, 1001])
@pytest.mark.parametrize("pieces", [1, 2, 3, 4, 7, 8, 16])
def test_column_chunks(numel, pieces):
    chunks = column_chunks(numel, pieces)
    assert len(chunks) == min(numel, pieces)
    cursor = 0
    for start, stop in chunks:
        assert start == cursor and stop > start
        cursor = stop
    assert cursor == numel
    sizes = [b - a for a, b in chunks]
    assert not sizes or max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("padded, group", [(8, 1), (8, 2), (96, 4), (96, 3), (1024, 8), (5, 5)])
def test_secondary_range(padded, group):
    ranges = [secondary_range(padded, group, r) for r in range(group)]
    assert ranges[0][0] == 0 and ranges[-1][1] == padded
    for (a, b), (c, _) in zip(ranges, ranges[1:] + [(padded, None)], strict=True):
        assert b - a == padded // group and b == c
    with pytest.raises(AssertionError):
        secondary_range(10, 4, 0)  # group_size must divide the padded buffer


# ---------------------------------------------------------------------------------------------
# block versus per-tensor accuracy (ZeRO++ Fig. 2)
