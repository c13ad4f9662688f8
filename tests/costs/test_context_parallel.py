"""Ulysses' all-to-alls as the estimator prices them (costs.context_parallel) against the closed form."""

from __future__ import annotations

from zeropp.costs.context_parallel import LEDGER_OP, ulysses_bytes
from zeropp.costs.memory import Activations
from zeropp.costs.volume import ulysses_transfers


def test_ulysses_bytes_closed_form_with_grouped_keys_and_values():
    # 2 rows of a 4096-token sequence over 4 ranks, 32 query heads of 128, 8 key-value heads, bf16:
    # q and the output at 32 heads, k and v at 8, each rank keeping 1/4 of what it holds
    per_head = 2 * 1024 * 128 * 2 * 3 // 4
    assert ulysses_bytes(2, 4096, 32, 8, 128, 4, 2) == per_head * (2 * 32 + 2 * 8)
    assert ulysses_bytes(2, 4096, 32, 2, 128, 4, 2) == per_head * 4 * 32  # 2 kv heads over 4: repeated to 32
    assert ulysses_bytes(2, 4096, 32, 8, 128, 1, 2) == 0


def test_transfers_per_step_follow_layers_micro_batches_checkpointing_and_tensor_parallelism():
    shape = dict(layers=3, hidden=512, seq=1024, batch=2, context_parallel=4)
    plain = list(ulysses_transfers(Activations(**shape), 1, 4, 2))
    assert {t.op for t in plain} == {LEDGER_OP} and all(t.crossing == 0 for t in plain)
    tensor = 2 * (1024 // 4) * 512 * 4 * 3 // 4  # one of q, k, v, output: a rank's slice, all but 1/4 sent
    for phase in ("forward", "backward"):
        assert sum(t.sent for t in plain if t.phase == phase) == 2 * 3 * 4 * tensor  # micro x layers x 4 tensors
    recomputed = list(ulysses_transfers(Activations(**shape, activation_checkpointing=True), 1, 4, 2))
    assert sum(t.sent for t in recomputed if t.phase == "backward") == 2 * 3 * 8 * tensor  # the forward's again
    halved = list(ulysses_transfers(Activations(**shape), 2, 4, 2))  # a tensor-parallel rank's half of the heads
    assert sum(t.sent for t in halved) * 2 == sum(t.sent for t in plain)
    assert list(ulysses_transfers(Activations(**{**shape, "context_parallel": 1}), 1, 4, 2)) == []
    # the activations a rank holds shrink with its share of the sequence
    assert Activations(**shape).block_elements * 4 == Activations(**{**shape, "context_parallel": 1}).block_elements
