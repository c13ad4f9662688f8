"""``compile = true``: every block's forward through torch.compile trains to the same weights as eager at
stages 0-3 (fp32, 1e-5), on two ranks so gathering, resharding and reductions all run around the
compiled code. With ZeRO++ the first forward (on the same qwZ-gathered weights) gives the same loss;
after that quantization turns the compiled code's last-bit differences into whole quantization steps,
so the weights are not compared."""

from __future__ import annotations

import pytest
import torch
from launcher import run_ranks
from machine import compiler_missing
from models import global_batch, loss_of, make_model, rows

# torch.compile's CPU code is C++ that inductor compiles on the spot
pytestmark = pytest.mark.skipif(
    compiler_missing() is not None, reason=f"torch.compile on the CPU: {compiler_missing()}"
)

STEPS = 3
TOLERANCE = 1e-5
ADAM_EPS = 1e-4  # as in test_exactness: eps=1e-8 would turn the rounding noise of a zero gradient into +-lr steps
CONFIGS = {f"stage{stage}": dict(stage=stage) for stage in (0, 1, 2, 3)} | {
    "zeropp": dict(stage=3, quantized_weights=True, quantized_gradients=True)
}


def compiled_vs_eager() -> dict[str, dict[str, float]]:
    """Per config: the largest weight and first-loss differences compiled vs eager after STEPS steps,
    the compiled run's losses, and how many forwards were compiled."""
    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.topology import init_topology

    topology = init_topology()
    world, rank = topology.world_size, topology.rank
    out = {}
    for name, keys in CONFIGS.items():
        weights, losses = [], []
        for compile_units in (False, True):
            config = ZeroConfig(compile=compile_units, **keys)
            engine = ZeroEngine(make_model("gpt"), torch.optim.AdamW, dict(lr=1e-2, eps=ADAM_EPS), config, topology)
            losses.append([])
            for step in range(STEPS):
                x, y = rows(global_batch("gpt", step, 0, world), rank)
                loss = loss_of("gpt", engine, x, y)
                engine.backward(loss)
                engine.step()
                losses[-1].append(loss.item())
            weights.append(engine.full_state_dict())
        out[name] = {
            "weights": max((weights[0][k] - weights[1][k]).abs().max().item() for k in weights[0]),
            "first_loss": abs(losses[0][0] - losses[1][0]),
            "losses": losses[1],
            "compiled": sum(hasattr(m.forward, "_torchdynamo_orig_callable") for m in engine.module.modules()),
        }
    return out


def test_compiled_units_train_like_eager():
    for per_rank in run_ranks(compiled_vs_eager, 2):
        assert per_rank.keys() == CONFIGS.keys()
        for name, r in per_rank.items():
            assert r["compiled"] == 2, f"{name}: {r['compiled']} compiled forwards, expected the 2 blocks"
            assert r["first_loss"] <= TOLERANCE, f"{name}: first loss differs by {r['first_loss']}"
            assert all(torch.isfinite(torch.tensor(r["losses"]))), f"{name}: {r['losses']}"
            if name != "zeropp":
                assert r["weights"] <= TOLERANCE, f"{name}: compiled weights differ from eager by {r['weights']}"
