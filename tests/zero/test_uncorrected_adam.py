"""Adam without bias correction (DeepSpeed's ``bias_correction: false``) against torch's own Adam and
AdamW: with bias correction c1 = 1 - b1^t and c2 = 1 - b2^t, torch at lr c1 lr / sqrt(c2) and eps
eps / sqrt(c2) (AdamW's decay scaled to keep lr x decay) moves every element exactly as far."""

from __future__ import annotations

import math

import pytest
import torch

from zeropp.zero.optim.stepping import is_elementwise
from zeropp.zero.optim.uncorrected_adam import UncorrectedAdam


@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam-l2"])
def test_each_step_equals_torchs_adam_with_its_correction_undone(decoupled):
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(64, 8, generator=generator)
    ours, theirs = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    lr, betas, eps, decay = 1e-2, (0.9, 0.99), 1e-6, 0.1
    optimizer = UncorrectedAdam([ours], lr=lr, betas=betas, eps=eps, weight_decay=decay, decoupled=decoupled)
    reference_class = torch.optim.AdamW if decoupled else torch.optim.Adam
    reference = reference_class([theirs], lr=lr, betas=betas, eps=eps, weight_decay=decay, foreach=False)
    for step in range(1, 31):
        grad = torch.randn(64, 8, generator=generator)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        c1, c2 = 1 - betas[0] ** step, 1 - betas[1] ** step
        group = reference.param_groups[0]
        group["lr"], group["eps"] = c1 * lr / math.sqrt(c2), eps / math.sqrt(c2)
        if decoupled:
            group["weight_decay"] = decay * lr / group["lr"]
        optimizer.step()
        reference.step()
        torch.testing.assert_close(ours.data, theirs.data, rtol=1e-5, atol=1e-6, msg=f"step {step}")
    assert set(optimizer.state[ours]) == {"step", "exp_avg", "exp_avg_sq"} and optimizer.state[ours]["step"] == 30


def test_it_steps_on_the_flat_shards_and_skips_a_parameter_without_a_gradient():
    assert is_elementwise(UncorrectedAdam)
    kept = torch.nn.Parameter(torch.ones(3))
    UncorrectedAdam([kept], weight_decay=0.5).step()
    assert torch.equal(kept.data, torch.ones(3))
