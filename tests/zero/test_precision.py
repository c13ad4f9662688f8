"""fp16 dynamic loss scaling (overflow skips the step) and bf16 training against the fp32 reference."""

from __future__ import annotations

import torch
from launcher import run_ranks
from models import BF16_OPTIM as OPTIM
from models import BF16_STEPS, BF16_TOLERANCE, global_batch, loss_of, make_model, reference_state, rows

from zeropp.config.sections import LossScaleConfig
from zeropp.zero.precision import LossScaler

WORLD = 2


# -- LossScaler, no processes ------------------------------------------------------------------------


def test_loss_scaler_growth_backoff_and_floor():
    scaler = LossScaler(
        LossScaleConfig(initial_scale=8.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3, min_scale=2.0),
        True,
    )
    assert scaler.scale == 8.0
    for _ in range(2):
        scaler.update(False)
    assert scaler.scale == 8.0  # not yet growth_interval clean steps
    scaler.update(False)
    assert scaler.scale == 16.0
    for _ in range(3):
        scaler.update(False)
    assert scaler.scale == 32.0
    scaler.update(False)
    scaler.update(False)
    scaler.update(True)  # an overflow backs off and restarts the clean-step count
    assert scaler.scale == 16.0
    scaler.update(False)
    scaler.update(False)
    assert scaler.scale == 16.0
    scaler.update(False)
    assert scaler.scale == 32.0
    for _ in range(10):
        scaler.update(True)
    assert scaler.scale == 2.0  # min_scale floor
    state = scaler.state_dict()
    other = LossScaler(LossScaleConfig(), True)
    other.load_state_dict(state)
    assert other.scale == 2.0 and other.state_dict() == state


def test_loss_scaler_disabled_is_fixed_at_one():
    scaler = LossScaler(LossScaleConfig(initial_scale=1024.0, growth_interval=1), enabled=False)
    for overflow in (True, False, False, True):
        scaler.update(overflow)
    assert scaler.scale == 1.0


# -- multi-rank ---------------------------------------------------------------------------------------


def _topology():
    from zeropp.config.sections import TopologyConfig
    from zeropp.topology import init_topology

    return init_topology(TopologyConfig())


def _snapshot(engine) -> dict:
    return engine.full_state_dict()  # a copy at every stage


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def fp16_worker() -> dict:
    from zeropp import ZeroConfig, ZeroEngine

    topology = _topology()
    rank = topology.rank
    out = {}
    loco = dict(quantized_gradients=True, gradient_error_feedback="loco")  # residuals must survive the overflow
    for name, stage, extra in ((0, 0, {}), (1, 1, {}), (2, 2, {}), (3, 3, {}), ("3-qgz-loco", 3, loco)):
        config = ZeroConfig(
            stage=stage,
            precision="fp16",
            loss_scale=LossScaleConfig(initial_scale=2.0**12, growth_interval=1000),
            **extra,
        )
        engine = ZeroEngine(make_model("gpt"), torch.optim.AdamW, dict(OPTIM), config, topology)
        x, y = rows(global_batch("gpt", 0, 0, WORLD), rank)
        engine.backward(loss_of("gpt", engine, x, y))
        first = engine.step()
        before = _snapshot(engine)
        scale_before = engine.scaler.scale

        x, y = rows(global_batch("gpt", 1, 0, WORLD), rank)
        loss = loss_of("gpt", engine, x, y)
        engine.backward(loss * float("inf") if rank == 0 else loss)  # one rank overflows: every rank skips
        overflow_step = engine.step()
        skipped = engine.last_step_skipped
        after_skip = _snapshot(engine)
        scale_after = engine.scaler.scale

        x, y = rows(global_batch("gpt", 2, 0, WORLD), rank)
        engine.backward(loss_of("gpt", engine, x, y))
        normal = engine.step()
        after_normal = _snapshot(engine)
        residuals = [r for u in engine.units if u.error_feedback for r in u.error_feedback.residuals.values()]
        out[name] = dict(
            residuals_finite=all(torch.isfinite(r).all().item() for r in residuals) and (not extra or bool(residuals)),
            first=first,
            overflow_step=overflow_step,
            skipped=skipped,
            unchanged=_same(before, after_skip),
            scales=(scale_before, scale_after, engine.scaler.scale),
            normal=normal,
            skipped_after_normal=engine.last_step_skipped,
            changed=not _same(after_skip, after_normal),
            finite=all(torch.isfinite(v).all().item() for v in after_normal.values()),
        )
    return out


def test_fp16_overflow_skips_step_and_backs_off():
    for rank, stages in enumerate(run_ranks(fp16_worker, WORLD)):
        for stage, got in stages.items():
            what = f"rank {rank} stage {stage}: {got}"
            assert got["first"], what
            assert got["overflow_step"] is False and got["skipped"] is True, what
            assert got["unchanged"], what
            assert got["scales"] == (2.0**12, 2.0**11, 2.0**11), what
            assert got["normal"] is True and got["skipped_after_normal"] is False, what
            assert got["changed"] and got["finite"] and got["residuals_finite"], what


def bf16_worker() -> dict:
    from zeropp import ZeroConfig, ZeroEngine

    topology = _topology()
    rank = topology.rank
    reference = reference_state("gpt", BF16_STEPS, WORLD, 1, None, OPTIM)
    out = {}
    for stage in (2, 3):
        engine = ZeroEngine(
            make_model("gpt"), torch.optim.AdamW, dict(OPTIM), ZeroConfig(stage=stage, precision="bf16"), topology
        )
        for step in range(BF16_STEPS):
            x, y = rows(global_batch("gpt", step, 0, WORLD), rank)
            engine.backward(loss_of("gpt", engine, x, y))
            assert engine.step()
        ours = engine.full_state_dict()
        assert ours.keys() == reference.keys()
        error = max((ours[k] - reference[k]).abs().max().item() for k in reference)
        # then fit one fixed batch: its loss must fall
        x, y = rows(global_batch("gpt", 99, 0, WORLD), rank)
        losses = []
        for _ in range(5):
            loss = loss_of("gpt", engine, x, y)
            losses.append(loss.item())
            engine.backward(loss)
            assert engine.step()
        dtypes = {p.dtype for p in engine.module.parameters()}
        out[stage] = dict(error=error, losses=losses, dtypes=dtypes, master=str(engine.units[0].master.dtype))
    return out


def test_bf16_trains_close_to_fp32_reference():
    for rank, stages in enumerate(run_ranks(bf16_worker, WORLD)):
        for stage, got in stages.items():
            what = f"rank {rank} stage {stage}: {got}"
            assert got["dtypes"] == {torch.bfloat16} and got["master"] == "torch.float32", what
            assert got["error"] <= BF16_TOLERANCE, what
            assert got["error"] > 1e-4, what  # bf16 really ran (fp32 matches to ~1e-6)
            losses = got["losses"]
            assert losses[-1] < losses[0] - 0.1, what
            assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), what


def float_inputs_misuse_and_int_buffers() -> dict:
    from torch import nn

    from zeropp import ZeroConfig, ZeroEngine

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    engine = ZeroEngine(model, torch.optim.AdamW, {"lr": 1e-3}, ZeroConfig(stage=3, precision="bf16"), _topology())
    x = torch.randn(4, 6)  # fp32 features meet bf16 weights
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    stepped = engine.step()
    try:
        engine(x).float().pow(2).mean().backward()
        misuse = "no error"
    except RuntimeError as error:
        misuse = str(error)
    state = engine.full_state_dict()
    return {
        "loss_finite": bool(torch.isfinite(loss)),
        "stepped": stepped,
        "misuse": misuse,
        "tracked_dtype": state["1.num_batches_tracked"].dtype,
        "weight_dtype": state["0.weight"].dtype,
    }


def test_float_inputs_are_cast_misuse_is_refused_and_int_buffers_keep_their_dtype():
    result = run_ranks(float_inputs_misuse_and_int_buffers, 1)[0]
    assert result["loss_finite"] and result["stepped"]
    assert "call engine.backward(loss), not loss.backward()" in result["misuse"]
    assert result["tracked_dtype"] == torch.int64
    assert result["weight_dtype"] == torch.float32
