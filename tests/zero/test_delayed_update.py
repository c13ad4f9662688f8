"""ZeRO-Offload's delayed parameter update (``zero.offload.delayed_update``): after the warm-up, the
weights equal a plain-PyTorch run that applies each step's update one step late; the warm-up steps
equal the run without the delay bit for bit; state dicts, checkpoints and evals wait for the thread;
bad settings are refused in one line."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from launcher import run_ranks
from models import ADAM_EPS, global_batch, loss_of, make_model, rows

from zeropp.config.policies import OffloadPolicy
from zeropp.config.sections import ZeroConfig
from zeropp.errors import ConfigError

STEPS, WARMUP, ACCUMULATION, MAX_NORM = 6, 2, 2, 0.05
LRS = [1e-2 * 0.8**step for step in range(STEPS)]  # set before each step's forward, as zeropp train does


def delayed_reference(world: int, steps: int, warmup: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(weights, masters) of one process on the global batch: the optimizer steps the masters with the
    gradients of the weights; an update after the warm-up reaches the weights only once the next
    step's gradients are computed (on the weights from before it)."""
    weights = make_model("gpt")
    masters = copy.deepcopy(weights)
    optimizer = torch.optim.AdamW(masters.parameters(), lr=LRS[0], eps=ADAM_EPS)
    unpublished = False
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = LRS[step]
        batches = [global_batch("gpt", step, m, world) for m in range(ACCUMULATION)]
        x, y = (torch.cat(parts) for parts in zip(*batches, strict=True))
        weights.zero_grad()
        loss_of("gpt", weights, x, y).backward()  # on the weights from before the last update, if delayed
        if unpublished:  # the last step's update reaches the weights at the start of this optimizer step
            weights.load_state_dict(masters.state_dict())
        for master, weight in zip(masters.parameters(), weights.parameters(), strict=True):
            master.grad = weight.grad.clone()
        torch.nn.utils.clip_grad_norm_(masters.parameters(), MAX_NORM)
        optimizer.step()
        unpublished = step >= warmup
        if not unpublished:
            weights.load_state_dict(masters.state_dict())
    return weights, masters


def _engine(topology, stage: int, delayed: bool, warmup: int = WARMUP, optimizer=torch.optim.AdamW, **extra):
    from zeropp import ZeroEngine

    config = ZeroConfig(
        stage=stage, gradient_accumulation_steps=ACCUMULATION, max_grad_norm=MAX_NORM, offload_optimizer="cpu",
        offload_delayed_update=delayed, offload_delayed_update_warmup=warmup, **extra,
    )  # fmt: skip
    kwargs = dict(lr=LRS[0], eps=ADAM_EPS) if optimizer is torch.optim.AdamW else dict(lr=0.1)
    return ZeroEngine(make_model("gpt"), optimizer, kwargs, config, topology)


def _train(engine, steps: int) -> None:
    world, rank = engine.topology.world_size, engine.topology.rank
    for step in range(steps):
        for group in engine.optimizer.param_groups:  # the next step's rate while the last one may still run
            group["lr"] = LRS[step]
        for micro in range(ACCUMULATION):
            x, y = rows(global_batch("gpt", step, micro, world), rank)
            engine.backward(loss_of("gpt", engine, x, y))
        assert engine.step()


def train_delayed(stage: int, extra: dict) -> dict:
    from zeropp.topology import init_topology

    topology = init_topology()
    world, rank = topology.world_size, topology.rank
    warm = {}
    for delayed in (False, True):  # the warm-up is the run without the delay, bit for bit
        engine = _engine(topology, stage, delayed, **extra)
        _train(engine, WARMUP)
        warm[delayed] = engine.full_state_dict()
    engine = _engine(topology, stage, True, **extra)
    _train(engine, STEPS)
    state = engine.full_state_dict()  # the masters: waits for the last step's thread
    engine.eval()
    x, y = rows(global_batch("gpt", STEPS, 0, world), rank)
    with torch.no_grad():
        eval_loss = loss_of("gpt", engine, x, y).item()  # publishes the last update first
    undelayed = _engine(topology, stage, False, **extra)
    _train(undelayed, STEPS)
    return dict(warm=warm, state=state, eval_loss=eval_loss, undelayed=undelayed.full_state_dict(), rank=rank)


@pytest.mark.parametrize(
    "world,stage,extra",
    [(1, 3, {}), (2, 1, {}), (2, 2, {}), (2, 3, dict(offload_params="cpu"))],
    ids=["world1-stage3", "world2-stage1", "world2-stage2", "world2-stage3-params"],
)
def test_delayed_update_matches_plain_pytorch(world, stage, extra):
    _, masters = delayed_reference(world, STEPS, WARMUP)
    expected = {k: v.detach() for k, v in masters.state_dict().items()}
    undelayed_masters = delayed_reference(world, STEPS, STEPS)[1].state_dict()
    for result in run_ranks(train_delayed, world, stage=stage, extra=extra):
        warm = result["warm"]
        assert all(torch.equal(warm[True][k], warm[False][k]) for k in warm[False])
        error = max((result["state"][k] - expected[k]).abs().max().item() for k in expected)
        assert error <= 1e-5, error
        stale = max((result["undelayed"][k] - undelayed_masters[k]).abs().max().item() for k in expected)
        assert stale <= 1e-5, stale  # the reference without the delay is the engine's undelayed run
        changed = max((result["state"][k] - result["undelayed"][k]).abs().max().item() for k in expected)
        assert changed > 1e-4, changed  # the delay did change the trajectory
        x, y = rows(global_batch("gpt", STEPS, 0, world), result["rank"])
        with torch.no_grad():
            assert result["eval_loss"] == pytest.approx(loss_of("gpt", masters, x, y).item(), abs=1e-5)


class SlowSGD(torch.optim.SGD):
    """SGD whose step takes long enough that a read not waiting for the thread sees the old masters."""

    elementwise = True

    def step(self, closure=None):
        time.sleep(0.5)
        return super().step(closure)


def save_while_stepping(folder: str) -> dict:
    from zeropp.checkpoint.dcp import load_checkpoint, save_checkpoint
    from zeropp.topology import init_topology

    topology = init_topology()
    engine = _engine(topology, 2, True, warmup=0, optimizer=SlowSGD)
    before = engine.full_state_dict()
    _train(engine, 1)
    full = engine.full_state_dict()
    _train(engine, 1)
    path = save_checkpoint(engine, folder, 2)  # right after the step: its thread is still running
    saved = _engine(topology, 2, False, optimizer=SlowSGD)
    load_checkpoint(saved, path)
    return dict(before=before, full=full, after=engine.full_state_dict(), saved=saved.full_state_dict())


def test_state_dicts_and_checkpoints_wait_for_the_thread(tmp_path):
    for result in run_ranks(save_while_stepping, 2, folder=str(tmp_path)):
        before, full, after = result["before"], result["full"], result["after"]
        assert any(not torch.equal(before[k], full[k]) for k in before)  # the first step's update is there
        assert all(torch.equal(result["saved"][k], after[k]) for k in after)  # and the second's, in the checkpoint
        assert any(not torch.equal(full[k], after[k]) for k in after)


def test_bad_settings_are_refused_in_one_line():
    from zeropp.zero.optim.outer import runs_outer_loop

    def message(config: ZeroConfig) -> str:
        with pytest.raises(ConfigError) as info:
            config.validate()
        assert "\n" not in str(info.value)
        return str(info.value)

    assert message(ZeroConfig(offload_delayed_update=True)).startswith(
        "zero.offload_delayed_update = True is not allowed; expected false unless zero.offload_optimizer = 'cpu'"
    )
    grouped = ZeroConfig(offload=OffloadPolicy(optimizer="nvme", path="/tmp", delayed_update=True))
    assert message(grouped).startswith("zero.offload.delayed_update = True is not allowed")
    warmup = ZeroConfig(offload_optimizer="cpu", offload_delayed_update=True, offload_delayed_update_warmup=-1)
    assert message(warmup).startswith(
        "zero.offload_delayed_update_warmup = -1 is not allowed; expected an integer >= 0"
    )
    diloco = ZeroConfig(offload_optimizer="cpu", offload_delayed_update=True, outer_sync_every=4)
    diloco.validate()  # one node: plain zeropp
    with pytest.raises(
        ConfigError, match=r"^zero.outer_sync_every = 4 is not allowed with zero.offload_delayed_update"
    ):
        runs_outer_loop(diloco, 2, "segments")
    ZeroConfig(offload_optimizer="cpu", offload_delayed_update=True, precision="fp16").validate()  # allowed


def fp16_runs(growth_intervals: tuple[int, ...]) -> dict[int, dict]:
    from zeropp.config.sections import LossScaleConfig
    from zeropp.topology import init_topology

    topology, states = init_topology(), {}
    for interval in growth_intervals:
        scaling = LossScaleConfig(initial_scale=2.0**8, growth_interval=interval)
        engine = _engine(topology, 2, True, warmup=0, optimizer=torch.optim.SGD, precision="fp16", loss_scale=scaling)
        _train(engine, 4)
        states[interval] = dict(state=engine.full_state_dict(), scale=engine.scaler.scale)
    return states


def test_fp16_unscales_by_the_scale_of_its_step():
    """The loss scale doubles after every step, while the thread still steps: by powers of 2, the
    weights are those of a constant scale (SGD: an update divided by the next step's scale would halve)."""
    states = run_ranks(fp16_runs, 1, growth_intervals=(1, 1000))[0]
    assert (states[1]["scale"], states[1000]["scale"]) == (2.0**12, 2.0**8)
    growing, constant = states[1]["state"], states[1000]["state"]
    assert max((growing[k] - constant[k]).abs().max().item() for k in constant) <= 1e-6
