"""Expert parallelism's collectives priced in closed form (costs.expert_parallel), routing spread evenly."""

from __future__ import annotations

import pytest

from zeropp.costs.expert_parallel import MixtureOfExperts, dispatch_bytes, expert_transfers

pytestmark = pytest.mark.unit


def test_each_all_to_all_sends_the_tokens_rows_but_the_share_bound_for_its_own_experts():
    assert dispatch_bytes(256, 2, 64, 4, 2) == 256 * 2 * 64 * 4 // 2
    assert dispatch_bytes(256, 2, 64, 4, 4) == 256 * 2 * 64 * 4 * 3 // 4
    assert dispatch_bytes(256, 2, 64, 4, 1) == 0


def test_a_step_has_per_layer_the_counts_and_two_all_to_alls_each_way_and_recomputation_repeats_forward():
    moe = MixtureOfExperts(layers=3, experts=8, top_k=2, expert_parallel=4)
    rows = dispatch_bytes(128, 2, 32, 2, 4)
    plain = list(expert_transfers(moe, 128, 32, 2, micro=2))
    assert [(t.op, t.phase) for t in plain[:5]] == [
        ("ep.all_gather", "forward"), ("ep.all_to_all", "forward"), ("ep.all_to_all", "forward"),
        ("ep.all_to_all", "backward"), ("ep.all_to_all", "backward"),
    ]  # fmt: skip
    assert len(plain) == 2 * 3 * 5 and all(t.crossing == 0 for t in plain)
    assert plain[0].sent == 8 * 8 * 3  # every rank's 8 counts, int64, from the 3 others
    assert sum(t.sent for t in plain if t.op == "ep.all_to_all") == 2 * 3 * 4 * rows
    again = list(expert_transfers(moe, 128, 32, 2, micro=1, recomputed=True))
    assert sum(t.sent for t in again if t.op == "ep.all_to_all" and t.phase == "backward") == 3 * 4 * rows
    assert list(expert_transfers(MixtureOfExperts(3, 8, 2, 1), 128, 32, 2, micro=1)) == []
