"""The optimizer step inside backward (``zero.step_in_backward``): the weights bit for bit those of
stepping after backward (stages 1-3, worlds 1, 2 and 4, clipping on and off, accumulation, offload
none and cpu), within the exactness bound of one process; the units are stepped before
``engine.step()``; what cannot step unit by unit is refused in one line."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from launcher import run_ranks
from models import ADAM_EPS, GPT_TEST, TOLERANCE, global_batch, loss_of, make_model, rows

from zeropp.config.sections import ZeroConfig
from zeropp.errors import ConfigError

STEPS, ACCUMULATION, MAX_NORM = 3, 2, 0.05
LRS = [1e-3 * 0.8**step for step in range(STEPS)]  # set before each step's forward, as zeropp train does


def train(stage: int, in_backward: bool, extra: dict) -> tuple[dict, list[bool]]:
    """The weights after STEPS steps, and per step whether the masters had moved before engine.step()."""
    from zeropp import ZeroEngine
    from zeropp.topology import init_topology

    topology = init_topology()
    if "offload_path" in extra:  # each engine its own disk tier's folder
        folder = Path(extra["offload_path"]) / f"in-backward-{in_backward}"
        folder.mkdir(exist_ok=True)
        extra = {**extra, "offload_path": str(folder)}
    config = ZeroConfig(
        stage=stage, gradient_accumulation_steps=ACCUMULATION, step_in_backward=in_backward, **extra
    )  # fmt: skip
    engine = ZeroEngine(make_model("gpt"), torch.optim.AdamW, dict(lr=LRS[0], eps=ADAM_EPS), config, topology)
    world, rank = topology.world_size, topology.rank
    moved = []

    # the disk tier's masters are in memory only while stepped; its units publish their compute shards then
    def weights(unit):  # a resident unit (world 1) holds them whole
        return unit.compute_shard if unit.compute_shard is not None else unit.compute_flat

    probed = weights if "offload_path" in extra else (lambda unit: unit.master)
    for step in range(STEPS):
        for group in engine.optimizer.param_groups:
            group["lr"] = LRS[step]
        for micro in range(ACCUMULATION):
            before = [probed(unit).detach().clone() for unit in engine.units]
            x, y = rows(global_batch("gpt", step, micro, world), rank)
            engine.backward(loss_of("gpt", engine, x, y))
        if step == 0:  # the first step: were the masters stepped before engine.step()? (the later ones:
            if engine.early is not None:  # engine.step() waits for the worker itself)
                engine.early.wait()
            if engine.disk is not None and engine.disk.gradients is not None:  # (and for the parked gradients)
                engine.disk.gradients.settle()
            moved.append([not torch.equal(b, probed(unit)) for b, unit in zip(before, engine.units, strict=True)])
            moved.append([unit.known_statistics is not None for unit in engine.units])  # the norm's parts
        assert engine.step()
    moved.append([engine.last_grad_norm])  # the last step's norm, before clipping
    return {k: v.clone() for k, v in engine.full_state_dict().items()}, moved


def reference(world: int, max_norm: float | None) -> dict:
    """One process on the global batch (every micro-batch at once), the rate set before each step."""
    model = make_model("gpt")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LRS[0], eps=ADAM_EPS)
    for step in range(STEPS):
        for group in optimizer.param_groups:
            group["lr"] = LRS[step]
        x, y = (
            torch.cat(parts)
            for parts in zip(*(global_batch("gpt", step, m, world) for m in range(ACCUMULATION)), strict=False)
        )
        optimizer.zero_grad()
        loss_of("gpt", model, x, y).backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
    return model.state_dict()


def compare_worker(stage: int, extra: dict) -> dict:
    after, moved = train(stage, False, extra)
    inside, moved_inside = train(stage, True, extra)
    return dict(after=after, inside=inside, moved=moved, moved_inside=moved_inside)


CASES = [
    (1, 3, {}), (2, 1, {}), (2, 2, {"max_grad_norm": MAX_NORM}), (2, 3, {"offload_optimizer": "cpu"}),
    (4, 3, {}), (4, 2, {"offload_optimizer": "cpu", "max_grad_norm": MAX_NORM}), (4, 1, {"precision": "bf16"}),
    (2, 3, {"optimizer_path": "flat"}), (2, 3, {"precision": "bf16", "optimizer_state_dtype": "bf16"}),
    (2, 3, {"offload_optimizer": "nvme"}), (2, 3, {"offload_optimizer": "nvme", "precision": "bf16"}),
    (2, 3, {"offload_optimizer": "nvme", "max_grad_norm": MAX_NORM}), (1, 3, {"offload_optimizer": "nvme"}),
    (4, 3, {"offload_optimizer": "nvme", "max_grad_norm": MAX_NORM}),
]  # fmt: skip


@pytest.mark.parametrize(
    "world,stage,extra",
    CASES,
    ids=[f"w{w}-s{s}-{'-'.join(f'{k}={v}' for k, v in e.items()) or 'plain'}" for w, s, e in CASES],
)
def test_the_weights_are_bit_for_bit_those_of_stepping_after_backward(world, stage, extra, tmp_path):
    if extra.get("offload_optimizer") == "nvme":  # the disk tier steps the flat masters
        extra = {**extra, "offload_path": str(tmp_path), "optimizer_path": "flat"}
    per_rank = run_ranks(compare_worker, world, stage=stage, extra=extra)
    clipped = "max_grad_norm" in extra
    for result in per_rank:
        for name, value in result["after"].items():
            assert torch.equal(result["inside"][name], value), name
        assert not any(result["moved"][0])  # without it, nothing moves before engine.step()
        # with it, every unit is stepped during the boundary's backward, unless clipping needs the norm first;
        # then each unit's part of the norm is computed as it lands (the disk tier's, as it is parked)
        assert all(result["moved_inside"][0]) if not clipped else not any(result["moved_inside"][0])
        if clipped:  # (the norms' parts as the units landed; clipping acts: wrong parts would change the weights)
            assert all(result["moved_inside"][1]) and result["moved_inside"][2][0] > MAX_NORM
        parked = extra.get("offload_optimizer") == "nvme" and stage >= 2
        assert all(result["moved"][1]) if parked else not any(result["moved"][1])  # after backward: at the step
    if extra.get("precision", "fp32") == "fp32":  # and they are one process's weights
        ref = reference(world, extra.get("max_grad_norm"))
        for result in per_rank:
            assert max((result["inside"][k].float() - ref[k]).abs().max().item() for k in ref) <= TOLERANCE


@pytest.mark.unit
def test_what_the_config_cannot_step_in_backward_is_refused_in_one_line(tmp_path):
    for extra, clash in (
        (dict(precision="fp16"), "zero.precision = 'fp16'"),
        (dict(offload_optimizer="cpu", offload_delayed_update=True), "zero.offload_delayed_update"),
        (dict(offload_params="nvme", offload_path=str(tmp_path)), "zero.offload_params = 'nvme'"),
        (dict(stage=2, offload_optimizer="nvme", offload_path=str(tmp_path)), "zero.offload_params = 'nvme', or"),
    ):
        with pytest.raises(ConfigError) as error:
            ZeroConfig(step_in_backward=True, **extra).validate()
        message = str(error.value)
        assert message.startswith(f"zero.step_in_backward = True is not allowed; expected false with {clash}")
        assert "\n" not in message


def refusal_worker() -> list[str]:
    from zeropp import ZeroEngine
    from zeropp.topology import init_topology

    class MarkedSGD(torch.optim.SGD):  # element-wise by its author's word: its step may take every unit at once
        elementwise = True

    topology, messages = init_topology(), []
    for optimizer in (torch.optim.Adafactor, MarkedSGD, torch.optim.LBFGS):
        try:
            ZeroEngine(make_model("gpt"), optimizer, dict(lr=0.01), ZeroConfig(step_in_backward=True), topology)
        except ConfigError as error:
            messages.append(str(error))
    return messages


def test_an_optimizer_it_cannot_step_unit_by_unit_is_refused_in_one_line_before_any_collective():
    adafactor, marked, lbfgs = run_ranks(refusal_worker, 2)[0]
    assert adafactor == (
        "zero.step_in_backward = True is not allowed; expected false with the 'whole' optimizer path "
        "(whole parameters on owner ranks: not one unit per step call)"
    )
    assert marked == (
        "zero.step_in_backward = True is not allowed; expected false with MarkedSGD (one unit per "
        "optimizer.step() call: torch's element-wise optimizers only)"
    )
    assert lbfgs.startswith("optimizer LBFGS re-evaluates the model through a closure")


def order_worker() -> dict:
    """A state dict between a boundary backward and engine.step(), then two boundary backwards without
    engine.step() between them (what a backward that failed after some units were stepped leaves)."""
    from zeropp import ZeroEngine
    from zeropp.topology import init_topology

    topology = init_topology()
    config = ZeroConfig(stage=3, step_in_backward=True)
    engine = ZeroEngine(make_model("gpt"), torch.optim.AdamW, dict(lr=LRS[0], eps=ADAM_EPS), config, topology)
    x, y = rows(global_batch("gpt", 0, 0, topology.world_size), topology.rank)
    messages = {}
    engine.backward(loss_of("gpt", engine, x, y))
    try:
        engine.sharded_state_dict()
    except RuntimeError as error:
        messages["state dict"] = str(error)
    assert engine.step()
    engine.sharded_state_dict()  # after engine.step(): allowed
    engine.backward(loss_of("gpt", engine, x, y))
    try:
        engine.backward(loss_of("gpt", engine, x, y))
    except RuntimeError as error:
        messages["backward again"] = str(error)
    return messages


def test_reading_the_states_before_the_step_and_a_second_boundary_backward_are_refused_in_one_line():
    messages = run_ranks(order_worker, 2)[0]
    assert messages["state dict"] == (
        "zeropp: reading or writing the model states between engine.backward() and engine.step() is not allowed "
        "with zero.step_in_backward (the units were stepped in backward); expected engine.step() first"
    )
    assert messages["backward again"].startswith(
        "zeropp: zero.step_in_backward stepped units in the last accumulation boundary's backward, which "
        "engine.step() did not follow"
    )


def failed_backward_worker(path: str) -> dict:
    """With the disk tier: a step and a checkpoint, then a boundary backward that fails half-way (the
    stream waits for units that never land), then a forward, then the checkpoint loaded and a step."""
    from zeropp import ZeroEngine
    from zeropp.app.models.gpt import GPT
    from zeropp.checkpoint import load_checkpoint, save_checkpoint
    from zeropp.topology import init_topology

    topology = init_topology()
    config = ZeroConfig(stage=3, step_in_backward=True, offload_optimizer="nvme", offload_path=path)
    deep = GPT(dataclasses.replace(GPT_TEST, n_layer=6))  # units land while backward goes on (2 in flight)
    engine = ZeroEngine(deep, torch.optim.AdamW, dict(lr=LRS[0], eps=ADAM_EPS), config, topology)
    x, y = rows(global_batch("gpt", 0, 0, topology.world_size), topology.rank)
    engine.backward(loss_of("gpt", engine, x, y))
    assert engine.step()
    saved = save_checkpoint(engine, Path(path) / "checkpoints", 1)

    def fail(*_):
        raise ValueError("a failure in backward")

    hook = engine.module.blocks[0].register_full_backward_hook(fail)  # the first block: the last to land
    with pytest.raises(ValueError):
        engine.backward(loss_of("gpt", engine, x, y))
    hook.remove()
    result = {"stepped before the failure": bool(engine.early._stepped)}
    with pytest.raises(RuntimeError) as refused:
        engine(x, y)
    result["forward"] = str(refused.value)
    load_checkpoint(engine, saved)  # what the failed backward stepped is overwritten
    engine.backward(loss_of("gpt", engine, x, y))
    result["trains after the load"] = engine.step()
    return result


def test_a_boundary_backward_that_fails_with_the_disk_tier_stops_its_stream_and_a_checkpoint_resumes(tmp_path):
    for result in run_ranks(failed_backward_worker, 2, path=str(tmp_path)):  # returns: nothing hangs
        assert result["stepped before the failure"] and result["trains after the load"]
        assert result["forward"] == (
            "zeropp: a forward between engine.backward() and engine.step() is not allowed with "
            "zero.step_in_backward and the optimizer's disk tier (the weights are being stepped, or a backward "
            "failed); expected engine.step() first, or a checkpoint loaded"
        )


UNCAUGHT = """
import dataclasses, sys, torch
sys.path.insert(0, sys.argv[2])
from models import GPT_TEST, global_batch, loss_of, rows
from zeropp import ZeroEngine
from zeropp.app.models.gpt import GPT
from zeropp.config.sections import ZeroConfig
from zeropp.topology import init_topology

topology = init_topology()
config = ZeroConfig(stage=3, step_in_backward=True, offload_optimizer="nvme", offload_path=sys.argv[1])
engine = ZeroEngine(GPT(dataclasses.replace(GPT_TEST, n_layer=6)), torch.optim.AdamW, {}, config, topology)
x, y = rows(global_batch("gpt", 0, 0, 1), 0)
engine.backward(loss_of("gpt", engine, x, y))
engine.step()

def fail(*_):
    raise ValueError("a failure in backward")

engine.module.blocks[0].register_full_backward_hook(fail)
engine.backward(loss_of("gpt", engine, x, y))  # uncaught: the process must still exit
"""


def test_an_uncaught_failure_in_a_boundary_backward_with_the_disk_tier_lets_the_process_exit(tmp_path):
    """The worker's stream waits for units to land; one that never will must not hold up the exit."""
    import os
    import subprocess
    import sys

    from launcher import free_port

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1"}
    tests = str(Path(__file__).resolve().parents[1])
    run = subprocess.run(
        [sys.executable, "-c", UNCAUGHT, str(tmp_path), tests], env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 1 and "ValueError: a failure in backward" in run.stderr, run.stderr[-2000:]
