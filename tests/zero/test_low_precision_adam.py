"""Adam's moments in bf16 (``optimizer_state_dtype = "bf16"``, zeropp.zero.low_precision_adam): torch's
update bit for bit when the moments are fp32, moments stored in bf16 otherwise, and the sharded run
within bf16's rounding of one process running the same optimizer: the reduced gradients differ from
one process's in their last fp32 bits, which can move a moment to the neighbouring bf16 value (a
relative 2^-8), so each step may differ by up to lr x 2^-8."""

from __future__ import annotations

import functools

import pytest
import torch
from launcher import run_ranks
from models import ADAM_EPS, STEPS, global_batch, loss_of, make_model, reference_state, rows

from zeropp.config.sections import ZeroConfig
from zeropp.costs.memory import analytic_model_state_bytes
from zeropp.errors import ConfigError
from zeropp.zero.low_precision_adam import LowPrecisionAdam, low_precision_adam

OPTIM = dict(lr=1e-2, eps=ADAM_EPS, weight_decay=0.05)


def run(make_optimizer, steps: int = 5) -> list[torch.Tensor]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(257)), torch.nn.Parameter(torch.randn(3, 5))]
    optimizer = make_optimizer(params)
    for step in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step)) * 10 ** (step - 2)
        optimizer.step()
    return [p.detach().clone() for p in params], optimizer


@pytest.mark.parametrize("torch_class,decoupled", [(torch.optim.AdamW, True), (torch.optim.Adam, False)])
def test_fp32_moments_are_torchs_update_bit_for_bit(torch_class, decoupled):
    ours, _ = run(lambda ps: LowPrecisionAdam(ps, **OPTIM, decoupled=decoupled, state_dtype=torch.float32))
    theirs, _ = run(lambda ps: torch_class(ps, **OPTIM, foreach=False))
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_bf16_moments_are_stored_in_bf16_and_stay_close():
    ours, optimizer = run(lambda ps: LowPrecisionAdam(ps, **OPTIM, decoupled=True))
    theirs, _ = run(lambda ps: torch.optim.AdamW(ps, **OPTIM, foreach=False))
    for state in optimizer.state.values():
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    change = max((a - b).abs().max().item() for a, b in zip(ours, theirs, strict=True))
    assert 0 < change < 0.05 * OPTIM["lr"] * 5  # rounding of the moments, well under the steps taken


def test_other_optimizers_and_options_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="needs torch.optim.Adam or torch.optim.AdamW .*not SGD"):
        low_precision_adam(torch.optim.SGD, {"lr": 0.1}, torch.bfloat16)
    with pytest.raises(ConfigError, match="does not support amsgrad of AdamW"):
        low_precision_adam(torch.optim.AdamW, {"amsgrad": True}, torch.bfloat16)
    with pytest.raises(ConfigError, match="zero.optimizer_state_dtype = 'fp16' is not allowed"):
        ZeroConfig(optimizer_state_dtype="fp16").validate()


def train(stage: int) -> dict:
    from zeropp import ZeroEngine
    from zeropp.topology import init_topology

    topology = init_topology()
    torch.manual_seed(0)
    config = ZeroConfig(stage=stage, optimizer_state_dtype="bf16")
    engine = ZeroEngine(make_model("gpt"), torch.optim.AdamW, OPTIM, config, topology)
    for step in range(STEPS):
        x, y = rows(global_batch("gpt", step, 0, topology.world_size), topology.rank)
        engine.backward(loss_of("gpt", engine, x, y))
        engine.step()
    states = [s for s in engine.optimizer.state.values()]
    return dict(state=engine.full_state_dict(), dtypes={s["exp_avg"].dtype for s in states},
                bytes=engine.measured_model_state_bytes, psi=engine.param_count)  # fmt: skip


@pytest.mark.parametrize("stage", [1, 3])
def test_sharded_bf16_moments_equal_one_process(stage):
    torch.manual_seed(0)
    reference = reference_state(
        "gpt", STEPS, 2, 1, None, OPTIM,
        functools.partial(LowPrecisionAdam, decoupled=True, state_dtype=torch.bfloat16),
    )  # fmt: skip
    for result in run_ranks(train, 2, stage=stage):
        assert result["dtypes"] == {torch.bfloat16}
        error = max((result["state"][k] - reference[k]).abs().max().item() for k in reference)
        assert error <= STEPS * OPTIM["lr"] * 2**-8, error
        formula = analytic_model_state_bytes(result["psi"], 2, stage, "fp32", optimizer_bytes=4)  # 4: two bf16 moments
        assert result["bytes"] == pytest.approx(formula, rel=0.02)
