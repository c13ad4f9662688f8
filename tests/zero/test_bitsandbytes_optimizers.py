"""bitsandbytes' 8-bit AdamW (it runs on the CPU since 0.45) through the whole-parameter path: each
parameter's blocks are the ones bitsandbytes cuts in one process, so the weights equal its own run
within its own sensitivity to the gradient's rounding (an 8-bit state code flips where the gradient
moves by a rounding: its own run, given a batch's gradient as the mean of two halves', moves as far);
the states' bytes are its formula; its states are plain tensors and a Python int, so a checkpoint
resumes bit for bit."""

from __future__ import annotations

import math

import pytest
import torch
from launcher import run_ranks
from models import STEPS, TOLERANCE, global_batch, loss_of, make_model, rows
from test_whole_parameter_step import SENSITIVITY_FACTOR, distance, reference

pytest.importorskip("bitsandbytes")

BLOCK, SMALLEST, CODES = 256, 4096, 256  # blocks of 256 with an fp32 absmax; smaller parameters stay fp32


def state_bytes_formula(shapes: list[tuple[int, ...]]) -> int:
    """One optimizer's states over parameters of `shapes`: state1 and state2 a byte an element and an fp32
    absmax a block for a parameter of at least 4096 elements (bitsandbytes' min_8bit_size), else fp32;
    and the two 256-entry fp32 code maps, shared by its quantized parameters."""
    sizes = [math.prod(shape) for shape in shapes]
    quantized = [n for n in sizes if n >= SMALLEST]
    blocks = sum(math.ceil(n / BLOCK) for n in quantized)
    return (
        2 * sum(quantized)
        + 2 * 4 * blocks
        + (2 * 4 * CODES if quantized else 0)
        + 2 * 4 * (sum(sizes) - sum(quantized))
    )


def adamw8bit(model: torch.nn.Module) -> torch.optim.Optimizer:
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit(model.parameters(), lr=1e-3)


def train_bnb(folder: str) -> dict:
    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.checkpoint import load_checkpoint, save_checkpoint
    from zeropp.costs.memory import distinct_storage_bytes
    from zeropp.topology import init_topology

    topology = init_topology()
    ref = reference(lambda model: [adamw8bit(model)], topology.world_size)
    halves = reference(lambda model: [adamw8bit(model)], topology.world_size, parts=2)

    def engine_after(steps: range, resume: str | None = None) -> ZeroEngine:
        model = make_model("gpt")
        engine = ZeroEngine(model, adamw8bit(model), None, ZeroConfig(stage=3), topology)
        if resume is not None:
            load_checkpoint(engine, resume)
        for step in steps:
            x, y = rows(global_batch("gpt", step, 0, topology.world_size), topology.rank)
            engine.backward(loss_of("gpt", engine, x, y))
            engine.step()
        return engine

    straight = engine_after(range(STEPS))
    ours = straight.full_state_dict()
    states = [v for s in straight.optimizers[0].state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    first = engine_after(range(2))
    path = save_checkpoint(first, folder, 2)
    resumed = engine_after(range(2, STEPS), resume=str(path)).full_state_dict()
    return dict(
        error=distance(ours, ref),
        sensitivity=distance(halves, ref),
        held=float(distinct_storage_bytes(states)),
        owned=[tuple(p.shape) for p in straight.optimizers[0].state],
        resumed=max((ours[k] - resumed[k]).abs().max().item() for k in ours),
    )


def test_bitsandbytes_adamw8bit_equals_its_own_run_its_bytes_are_the_formula_and_it_resumes(tmp_path):
    by_rank = run_ranks(train_bnb, 2, folder=str(tmp_path))
    shapes = [p.shape for p in make_model("gpt").parameters()]
    first = by_rank[0]
    assert first["error"] <= max(TOLERANCE, SENSITIVITY_FACTOR * first["sensitivity"]), first
    assert first["resumed"] == 0.0, first
    for rank in by_rank:  # each parameter's states on its owner alone
        assert rank["held"] == state_bytes_formula(rank["owned"]), rank
    assert sorted(s for rank in by_rank for s in rank["owned"]) == sorted(tuple(s) for s in shapes)
    assert state_bytes_formula(shapes) < 8 * sum(math.prod(s) for s in shapes)  # against AdamW's fp32 moments
