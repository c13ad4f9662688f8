"""The optimizer steps the shards' segments unit by unit where it is one of torch's element-wise optimizers
(one unit's fp32 gradient and optimizer temporaries at a time), and over all of them at once where
it is a user's own element-wise one, to the same weights; where every parameter has a gradient the
segments compute what the flat shards compute, bit for bit, and resume from their checkpoint."""

from __future__ import annotations

import pytest
import torch
from launcher import run_ranks

from zeropp.zero.optim.stepping import step_batches


class WholeAdamW(torch.optim.AdamW):
    """AdamW as a user's own element-wise optimizer, whose step zeropp cannot vouch for: stepped over
    all masters at once."""

    elementwise = True


def test_torch_optimizers_step_per_unit_and_others_at_once():
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
    assert step_batches([torch.optim.AdamW(params)], "abc") == [["a"], ["b"], ["c"]]
    assert step_batches([torch.optim.SGD(params, lr=0.1)], "ab") == [["a"], ["b"]]
    assert step_batches([WholeAdamW(params)], "abc") == ["abc"]


def train(optimizer: type[torch.optim.Optimizer], zero: dict) -> tuple[list[list[int]], dict[str, torch.Tensor], int]:
    """Units whose tensors (segments) hold a gradient at each optimizer.step() call, the final full state
    dict, the units."""
    import zeropp
    from zeropp.app.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    topology = zeropp.init_topology()
    model = GPT(GPTConfig(block_size=16, n_layer=3, n_head=2, d_model=32, vocab_size=64))
    engine = zeropp.ZeroEngine(model, optimizer, dict(lr=1e-2), zeropp.ZeroConfig(**zero), topology)
    calls: list[list[int]] = []
    engine.optimizer.register_step_pre_hook(
        lambda opt, *_: calls.append(
            [k for k in range(len(engine.units)) if any(t.grad is not None for t in engine.stepper.tensors(k))]
        )
    )
    for step in range(3):
        x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(10 * step + topology.rank))
        engine.backward(engine(x, x))
        engine.step()
    state = {k: v.clone() for k, v in engine.full_state_dict().items()}
    units = len(engine.units)
    zeropp.shutdown()
    return calls, state, units


CASES = {
    "stage3": dict(stage=3),
    "stage1-clipped": dict(stage=1, max_grad_norm=0.05),
    "stage3-fp16-clipped": dict(stage=3, precision="fp16", max_grad_norm=0.05),
    "stage3-offload": dict(stage=3, offload_optimizer="cpu"),
}


@pytest.mark.parametrize("case", CASES)
def test_unit_by_unit_equals_all_at_once(case):
    per_unit = run_ranks(train, 2, optimizer=torch.optim.AdamW, zero=CASES[case])
    whole = run_ranks(train, 2, optimizer=WholeAdamW, zero=CASES[case])
    for (unit_calls, unit_state, units), (whole_calls, whole_state, _) in zip(per_unit, whole, strict=True):
        steps = len(whole_calls)
        assert steps >= 2 and whole_calls == [list(range(units))] * steps  # fp16 may skip its first steps
        assert unit_calls == [[u] for u in range(units)] * steps
        assert unit_state.keys() == whole_state.keys()
        for name, tensor in unit_state.items():
            assert torch.equal(tensor, whole_state[name]), name


def flat_and_segments(zero: dict, folder: str) -> dict[str, float]:
    """Where every parameter has a gradient, the segments step the flat shards' elements as the flat path
    does, bit for bit: straight through 5 steps, and resumed from the flat path's checkpoint after 3."""
    import zeropp
    from zeropp.app.models.gpt import GPT, GPTConfig
    from zeropp.checkpoint import load_checkpoint, save_checkpoint

    topology = zeropp.init_topology()

    def engine(path: str):
        torch.manual_seed(0)
        model = GPT(GPTConfig(block_size=16, n_layer=3, n_head=2, d_model=32, vocab_size=64))
        return zeropp.ZeroEngine(
            model, torch.optim.AdamW, dict(lr=1e-2), zeropp.ZeroConfig(**zero, optimizer_path=path), topology
        )

    def steps(engine, numbers: range) -> None:
        for step in numbers:
            x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(10 * step + topology.rank))
            engine.backward(engine(x, x))
            engine.step()

    flat, segments, resumed = engine("flat"), engine("auto"), engine("auto")
    assert segments.stepper is not None and resumed.stepper.segments, "the segments path"
    steps(flat, range(3))
    save_checkpoint(flat, folder, 3)
    steps(flat, range(3, 5))
    steps(segments, range(5))
    load_checkpoint(resumed, f"{folder}/step-{3:08d}")
    steps(resumed, range(3, 5))
    ref = flat.full_state_dict()
    out = {
        name: max((other.full_state_dict()[k] - ref[k]).abs().max().item() for k in ref)
        for name, other in (("straight", segments), ("resumed", resumed))
    }
    zeropp.shutdown()
    return out


@pytest.mark.parametrize("case", CASES)
def test_the_segments_step_the_flat_shards_elements_bit_for_bit(case, tmp_path):
    for distances in run_ranks(flat_and_segments, 2, zero=CASES[case], folder=str(tmp_path)):
        assert distances == {"straight": 0.0, "resumed": 0.0}, distances
