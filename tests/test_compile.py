"""``compile = true``: every block's forward through torch.compile, at stages 0-3 and with ZeRO++, trains
to the same weights as eager (fp32, 1e-5); the gathering and resharding hooks stay outside the compiled code."""

from __future__ import annotations

import torch
from launcher import run_ranks
from models import global_batch, loss_of, make_model, rows

STEPS = 3
TOLERANCE = 1e-5
ADAM_EPS = 1e-4  # as in test_exactness: Adam's eps=1e-8 would turn the rounding noise of a zero gradient into +-lr steps
CONFIGS = {f"stage{stage}": dict(stage=stage) for stage in (0, 1, 2, 3)} | {
    "zeropp": dict(stage=3, quantized_weights=True, quantized_gradients=True)
}


def compiled_vs_eager() -> dict[str, tuple[float, int]]:
    """Per config: the largest weight difference compiled vs eager after STEPS steps, and how many
    block forwards were compiled."""
    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.topology import init_topology

    topology = init_topology()
    world, rank = topology.world_size, topology.rank
    out = {}
    for name, keys in CONFIGS.items():
        weights, compiled = [], 0
        for compile_units in (False, True):
            config = ZeroConfig(compile=compile_units, **keys)
            engine = ZeroEngine(make_model("gpt"), torch.optim.AdamW, dict(lr=1e-2, eps=ADAM_EPS), config, topology)
            for step in range(STEPS):
                x, y = rows(global_batch("gpt", step, 0, world), rank)
                engine.backward(loss_of("gpt", engine, x, y))
                engine.step()
            weights.append(engine.full_state_dict())
            compiled = sum(hasattr(m.forward, "_torchdynamo_orig_callable") for m in engine.module.modules())
        out[name] = (max((weights[0][k] - weights[1][k]).abs().max().item() for k in weights[0]), compiled)
    return out


def test_compiled_units_train_like_eager():
    for per_rank in run_ranks(compiled_vs_eager, 2):  # sharded over two ranks: gathers and reductions run
        assert per_rank.keys() == CONFIGS.keys()
        for name, (error, compiled) in per_rank.items():
            assert compiled == 2, f"{name}: {compiled} compiled forwards, expected the 2 blocks"
            assert error <= TOLERANCE, f"{name}: compiled weights differ from eager by {error}"
