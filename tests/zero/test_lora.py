"""LoRA (peft) through the engine: the frozen base stays whole on every rank, the adapters are sharded,
and every stage at world 2 trains the adapters to the weights of one process (fp32, 1e-5)."""

from __future__ import annotations

import pytest
import torch
from launcher import run_ranks
from models import ADAM_EPS, STEPS, TOLERANCE, global_batch, loss_of, make_model, reference_state, rows

pytest.importorskip("peft")

OPTIM = dict(lr=1e-2, eps=ADAM_EPS, weight_decay=0.01)


def lora_model() -> torch.nn.Module:
    """The tiny Llama of tests/models.py with rank-4 LoRA adapters on q_proj and v_proj (seeded)."""
    import peft

    model = make_model("hf-llama")
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    return peft.get_peft_model(model, config)


def lora_worker() -> dict[int, float]:
    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.topology import init_topology

    topology = init_topology()
    errors = {}
    for stage in (1, 2, 3):
        engine = ZeroEngine(
            lora_model(), torch.optim.AdamW, OPTIM, ZeroConfig(stage=stage, persistence_threshold=0), topology
        )
        for step in range(STEPS):
            x, _ = rows(global_batch("hf-llama", step, 0, topology.world_size), topology.rank)
            engine.backward(loss_of("hf-llama", engine, x, None))
            assert engine.step()
        ours = engine.full_state_dict()
        ref = reference_state("hf-llama", STEPS, topology.world_size, 1, None, OPTIM, model=lora_model())
        assert ours.keys() == ref.keys()
        initial = lora_model().state_dict()
        lora = [k for k in ref if "lora_" in k]
        assert lora and all(not torch.equal(ours[k], initial[k]) for k in lora)  # trained
        errors[stage] = max((ours[k] - ref[k]).abs().max().item() for k in ref)
    return errors


def test_lora_at_every_stage_matches_single_process_lora():
    for errors in run_ranks(lora_worker, 2):
        assert all(error <= TOLERANCE for error in errors.values()), errors
