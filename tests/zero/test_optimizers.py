"""Which optimizers train on the flat shards: torch's element-wise ones and a user's own marked
``elementwise = True`` train there to the weights of one process; one that reads a parameter's shape
or norm (Adafactor, Muon, ...) steps whole parameters instead (tests/zero/test_whole_parameter_step.py),
never trained silently wrong on the shards."""

from __future__ import annotations

import pytest
import torch
from launcher import run_ranks
from models import STEPS, TOLERANCE, global_batch, loss_of, make_model, reference_state, rows

from zeropp.zero.optim.spec import read_optimizer
from zeropp.zero.optim.stepping import ELEMENTWISE_OPTIMIZERS, is_elementwise


class SignDescent(torch.optim.Optimizer):
    """A user's own element-wise optimizer: each element moves by lr times its gradient's sign."""

    elementwise = True

    def __init__(self, params, lr: float = 1e-3) -> None:
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"])


class NormalizedAdamW(torch.optim.AdamW):
    """A subclass whose step reads each parameter's norm: zeropp cannot tell it from AdamW by its base."""


SHAPE_AWARE = [torch.optim.Adafactor, torch.optim.Muon, NormalizedAdamW]


@pytest.mark.parametrize("cls", SHAPE_AWARE, ids=lambda c: c.__name__)
@pytest.mark.parametrize("form", ["class", "factory"])
def test_an_optimizer_that_is_not_elementwise_steps_whole_parameters(cls, form):
    model = make_model("gpt")
    given, kwargs = (cls, {"lr": 1e-2}) if form == "class" else (lambda ps: cls(ps, lr=1e-2), None)
    spec = read_optimizer(given, kwargs, model)
    assert spec.whole and spec.factory is None and spec.parts[0].cls is cls
    assert spec.parts[0].hyperparameters[0]["lr"] == 1e-2


def test_torch_elementwise_optimizers_and_a_marked_one_are_accepted():
    assert all(is_elementwise(cls) for cls in (*ELEMENTWISE_OPTIMIZERS, SignDescent))
    assert not is_elementwise(NormalizedAdamW)
    model = make_model("gpt")
    assert not read_optimizer(SignDescent, {"lr": 1e-3}, model).whole


OPTIMIZERS = {
    "sgd-nesterov": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    "rmsprop": (torch.optim.RMSprop, dict(lr=1e-3, momentum=0.5, centered=True)),
    "custom-elementwise": (SignDescent, dict(lr=1e-3)),
}


def train_each_optimizer() -> dict[str, float]:
    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.topology import init_topology

    topology = init_topology()
    errors = {}
    for stage in (1, 3):
        for name, (cls, kwargs) in OPTIMIZERS.items():
            engine = ZeroEngine(make_model("gpt"), cls, kwargs, ZeroConfig(stage=stage), topology)
            for step in range(STEPS):
                x, y = rows(global_batch("gpt", step, 0, topology.world_size), topology.rank)
                engine.backward(loss_of("gpt", engine, x, y))
                engine.step()
            ours = engine.full_state_dict()
            ref = reference_state("gpt", STEPS, topology.world_size, 1, None, kwargs, optimizer_class=cls)
            errors[f"{name}-stage{stage}"] = max((ours[k] - ref[k]).abs().max().item() for k in ref)
    return errors


def test_elementwise_optimizers_train_to_the_weights_of_one_process():
    errors = run_ranks(train_each_optimizer, 2)[0]
    assert len(errors) == 2 * len(OPTIMIZERS)
    assert all(error <= TOLERANCE for error in errors.values()), errors
