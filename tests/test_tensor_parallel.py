"""Tensor parallelism composed with ZeRO on real gloo ranks: exactness against one process, the
tensor-parallel traffic in the ledger, refusals."""

from __future__ import annotations

import pytest
import torch
from launcher import run_ranks
from models import GPT_TEST, global_batch, loss_of, make_model, reference_state, rows
from test_exactness import ADAM_EPS, STEPS, TOLERANCE

# (name, stage, accumulation, max_grad_norm)
SCENARIOS = [
    *[(f"stage{stage}", stage, 1, None) for stage in (0, 1, 2, 3)],
    *[(f"stage{stage}-accum2-clip", stage, 2, 0.05) for stage in (1, 3)],
]


def train_tensor_parallel(tp: int) -> dict[str, float]:
    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.config import TopologyConfig
    from zeropp.tensor_parallel import parallelize
    from zeropp.topology import init_topology

    topology = init_topology(TopologyConfig(tensor_parallel_size=tp))  # nodes: the launcher's
    dp = topology.data_parallel
    errors = {}
    for name, stage, accumulation, max_norm in SCENARIOS:
        optim_kwargs = dict(lr=1e-2, eps=ADAM_EPS, weight_decay=0.01)
        config = ZeroConfig(stage=stage, gradient_accumulation_steps=accumulation, max_grad_norm=max_norm)
        model = parallelize(make_model("gpt"), topology)
        assert model.blocks[0].attn.qkv.weight.to_local().shape == (3 * GPT_TEST.d_model // tp, GPT_TEST.d_model)
        engine = ZeroEngine(model, torch.optim.AdamW, optim_kwargs, config, topology)
        clipped = False
        for step in range(STEPS):
            for micro in range(accumulation):
                x, y = rows(global_batch("gpt", step, micro, dp.size), dp.rank)  # tp ranks read the same rows
                engine.backward(loss_of("gpt", engine, x, y))
            assert engine.step()
            clipped |= max_norm is not None and engine.last_grad_norm > max_norm
        assert max_norm is None or clipped, f"{name}: clipping never engaged"
        ours = engine.full_state_dict()
        ref = reference_state("gpt", STEPS, dp.size, accumulation, max_norm, optim_kwargs)
        assert ours.keys() == ref.keys(), name
        errors[name] = max((ours[k] - ref[k]).abs().max().item() for k in ref)
    return errors


@pytest.mark.parametrize("world,nodes,tp", [(4, 2, 2), (2, 1, 2)], ids=["dp2xtp2-2nodes", "dp1xtp2"])
def test_tensor_parallel_trains_to_the_weights_of_one_process(world, nodes, tp):
    results = run_ranks(train_tensor_parallel, world=world, nodes=nodes, tp=tp)
    for rank_errors in results:
        for name, error in rank_errors.items():
            assert error <= TOLERANCE, (name, error)
