"""torchao's 8-bit and 4-bit AdamW, a well-kept library's low-bit optimizer states, through the
whole-parameter path: each parameter's blocks are the ones torchao cuts in one process, so the weights
equal torchao's own run, and the states' bytes are torchao's formula for the parameters' shapes."""

from __future__ import annotations

import math

import pytest
import torch
from launcher import run_ranks
from machine import compiler_missing
from models import STEPS, TOLERANCE, global_batch, loss_of, make_model, rows

pytest.importorskip("torchao")
pytestmark = pytest.mark.skipif(
    compiler_missing() is not None, reason=f"torchao compiles its step: {compiler_missing()}"
)

BLOCK = {8: 256, 4: 128}  # torchao's blocks: one fp32 scale per block of states
SMALLEST = 4096  # a parameter with fewer elements (or not a multiple of the block) keeps fp32 states


def state_bytes_formula(shapes: list[torch.Size], bits: int) -> int:
    """exp_avg and exp_avg_sq: `bits` per element, an fp32 scale a block and the 2^bits-entry fp32 code
    map, where torchao quantizes; else fp32."""
    total = 0
    for shape in shapes:
        n, block = math.prod(shape), BLOCK[bits]
        quantized = n >= SMALLEST and n % block == 0
        total += 2 * (n * bits // 8 + 4 * n // block + 4 * 2**bits) if quantized else 2 * 4 * n
    return total


def train_low_bit() -> dict[str, tuple[float, int]]:
    from torchao.optim import AdamW4bit, AdamW8bit

    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.costs.memory import distinct_storage_bytes
    from zeropp.topology import init_topology

    topology = init_topology()
    results = {}
    for cls in (AdamW8bit, AdamW4bit):
        reference = make_model("gpt")
        optimizer = cls(reference.parameters(), lr=1e-3)
        for step in range(STEPS):
            x, y = global_batch("gpt", step, 0, topology.world_size)
            optimizer.zero_grad()
            loss_of("gpt", reference, x, y).backward()
            optimizer.step()
        model = make_model("gpt")
        engine = ZeroEngine(model, cls(model.parameters(), lr=1e-3), None, ZeroConfig(stage=3), topology)
        for step in range(STEPS):
            x, y = rows(global_batch("gpt", step, 0, topology.world_size), topology.rank)
            engine.backward(loss_of("gpt", engine, x, y))
            engine.step()
        ours, ref = engine.full_state_dict(), reference.state_dict()
        error = max((ours[k] - ref[k]).abs().max().item() for k in ref)
        states = [v for s in engine.optimizers[0].state.values() for k, v in s.items() if k != "step"]
        results[cls.__name__] = (error, distinct_storage_bytes(states))
    return results


def test_torchao_low_bit_adamw_equals_torchao_in_one_process_and_its_bytes_are_the_formula():
    by_rank = run_ranks(train_low_bit, 2)
    shapes = [p.shape for p in make_model("gpt").parameters()]
    for name, bits in (("AdamW8bit", 8), ("AdamW4bit", 4)):
        assert by_rank[0][name][0] <= TOLERANCE, (name, by_rank[0][name])
        held = sum(rank[name][1] for rank in by_rank)  # each parameter's states on its owner alone
        assert held == state_bytes_formula(shapes, bits), (name, held, state_bytes_formula(shapes, bits))
    assert state_bytes_formula(shapes, 4) < state_bytes_formula(shapes, 8) < 8 * sum(math.prod(s) for s in shapes)


def save_low_bit(folder: str) -> str:
    from torchao.optim import AdamW8bit

    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.checkpoint import CheckpointError, save_checkpoint
    from zeropp.topology import init_topology

    topology = init_topology()
    model = make_model("gpt")
    engine = ZeroEngine(model, AdamW8bit(model.parameters(), lr=1e-3), None, ZeroConfig(stage=3), topology)
    x, y = rows(global_batch("gpt", 0, 0, topology.world_size), topology.rank)
    engine.backward(loss_of("gpt", engine, x, y))
    engine.step()
    try:
        save_checkpoint(engine, folder, 1)
    except CheckpointError as error:
        return str(error)
    return "saved"


def test_a_checkpoint_of_quantized_states_is_refused_in_one_line_not_saved_dense(tmp_path):
    """DCP would write torchao's states dequantized, and a resumed run would step fp32 states: refused."""
    message = run_ranks(save_low_bit, 1, folder=str(tmp_path))[0]
    assert "\n" not in message and "is a OptimState8bit, not a plain tensor" in message, message
