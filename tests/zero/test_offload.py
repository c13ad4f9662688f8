"""ZeRO-Offload: the master and optimizer state (and the compute-dtype shards) in host memory train
exactly like the run without offload, and the memory formula counts what lives where."""

from __future__ import annotations

import pytest
import torch
from launcher import run_ranks
from models import ADAM_EPS, global_batch, loss_of, make_model, rows

from zeropp.config.sections import ZeroConfig
from zeropp.errors import ConfigError

OFFLOADS = {
    "off": {},
    "optimizer": dict(offload_optimizer="cpu"),
    "params": dict(offload_params="cpu"),  # DeepSpeed's offload_param alone: the optimizer stays on the device
    "optimizer+params": dict(offload_optimizer="cpu", offload_params="cpu"),
}


def train_with_offloads(simulated_nodes: int, stage: int, extra: dict) -> dict[str, dict]:
    from zeropp import ZeroEngine
    from zeropp.config.sections import TopologyConfig
    from zeropp.topology import init_topology

    topology = init_topology(TopologyConfig(nodes=simulated_nodes))
    world, rank = topology.world_size, topology.rank
    results = {}
    for name, offload in OFFLOADS.items():
        if "offload_params" in offload and stage != 3:
            continue
        config = ZeroConfig(stage=stage, gradient_accumulation_steps=2, max_grad_norm=0.05, **extra, **offload)
        engine = ZeroEngine(make_model("gpt"), torch.optim.AdamW, dict(lr=1e-2, eps=ADAM_EPS), config, topology)
        for step in range(4):
            for micro in range(2):
                x, y = rows(global_batch("gpt", step, micro, world), rank)
                engine.backward(loss_of("gpt", engine, x, y))
            engine.step()
        results[name] = dict(
            state=engine.full_state_dict(), bytes=engine.measured_model_state_bytes, psi=engine.param_count
        )
    return results


@pytest.mark.parametrize(
    "stage,extra",
    [(1, {}), (2, {}), (3, {}), (3, dict(precision="bf16", hpz_partition_size=0, quantized_weights=True))],
    ids=["stage1", "stage2", "stage3", "stage3-bf16-hpz-qwz"],
)
def test_offload_trains_exactly_like_no_offload(stage, extra):
    from zeropp.costs.memory import analytic_model_state_bytes

    for per_rank in run_ranks(train_with_offloads, 4, nodes=2, simulated_nodes=2, stage=stage, extra=extra):
        off = per_rank["off"]["state"]
        for name, result in per_rank.items():
            error = max((result["state"][k] - off[k]).abs().max().item() for k in off)
            assert error <= 1e-6, (name, error)
        if not extra:  # fp32, no hpZ: the offloaded master is a separate copy (it cannot alias the parameters)
            psi = per_rank["optimizer"]["psi"]
            formula = analytic_model_state_bytes(psi, 4, stage, "fp32", offload_optimizer=True)
            assert per_rank["optimizer"]["bytes"] == pytest.approx(formula, rel=0.05)
            if stage == 3:  # the fp32 compute shard on the host is a copy of the device's master
                formula = analytic_model_state_bytes(psi, 4, stage, "fp32", offload_params=True)
                assert per_rank["params"]["bytes"] == pytest.approx(formula, rel=0.05)


def test_offloaded_parameters_need_stage_3():
    with pytest.raises(ConfigError, match="zero.offload_params"):
        ZeroConfig(stage=2, offload_optimizer="cpu", offload_params="cpu").validate()
    ZeroConfig(stage=3, offload_params="cpu").validate()  # DeepSpeed's offload_param alone


def test_memory_formula_splits_device_and_host():
    from zeropp.costs.memory import analytic_model_state_bytes

    psi = 1000
    kwargs = dict(offload_optimizer=True, offload_params=True)
    assert analytic_model_state_bytes(psi, 4, 3, "bf16", **kwargs, where="host") == (12 + 2) * psi / 4
    assert analytic_model_state_bytes(psi, 4, 3, "bf16", **kwargs, where="device") == 2 * psi / 4
    assert analytic_model_state_bytes(psi, 4, 3, "bf16", offload_optimizer=True, where="device") == 4 * psi / 4
    params_only = dict(offload_params=True)  # the optimizer on the device, the bf16 shard on the host
    assert analytic_model_state_bytes(psi, 4, 3, "bf16", **params_only, where="device") == (12 + 2) * psi / 4
    assert analytic_model_state_bytes(psi, 4, 3, "bf16", **params_only, where="host") == 2 * psi / 4
    assert analytic_model_state_bytes(psi, 4, 3, "fp32", **params_only, where="device") == (12 + 4) * psi / 4
    assert analytic_model_state_bytes(psi, 4, 3, "bf16") == 16 * psi / 4
