"""Reliability: non-finite values and training, one run per checkpoint folder, damaged checkpoints,
ranks building different models, resuming a finished run, the ZeRO-3 baseline at stages 1-2, and
what a run says about its checkpoints."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cli_runner import run_cli
from launcher import free_port, run_ranks

TINY = ["train", "--preset", "tiny", "--nproc-per-node", "2", "--eval-batches", "1"]


def tiny_run(*args: str) -> subprocess.CompletedProcess:
    return run_cli(*TINY, "--master-port", str(free_port()), *args)


def error_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("zeropp: error: ")]


def one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
    assert lines[0].startswith("zeropp: error: ") and all(f in lines[0] for f in fragments), lines[0]
    return lines[0]


def exported(checkpoint: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from zeropp.checkpoint.dcp import export_checkpoint

    out = tmp_path / f"{checkpoint.name}.safetensors"
    export_checkpoint(checkpoint, out)
    return load_file(str(out))


# -- 1. non-finite values ------------------------------------------------------------------------------


def float_keys() -> list[str]:
    from zeropp.config.keys import leaf_keys
    from zeropp.config.sections import LossScaleConfig

    keys = [key.dotted for key in leaf_keys().values() if "float" in str(key.hint)]
    return keys + [f"zero.loss_scale.{name}" for name, key in leaf_keys(LossScaleConfig).items() if key.hint is float]


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_every_float_key_refuses_non_finite_values(value):
    from zeropp.config.sections import load_config
    from zeropp.errors import ConfigError

    keys = float_keys()
    assert {"optim.lr", "optim.weight_decay", "optim.beta1", "zero.max_grad_norm", "topology.timeout_s"} <= set(keys)
    assert "zero.loss_scale.initial_scale" in keys
    for key in keys:
        with pytest.raises(ConfigError) as error:
            load_config(overrides={key: value})
        message = str(error.value)  # where the range allows it (x > 0 takes inf), "a finite number"
        assert message.startswith(f"{key} = {value!r} is not allowed; expected ") and "\n" not in message
    # where the range has an upper bound (topology.timeout_s <= 1e7) the range names inf already
    for key in ("optim.lr", "optim.weight_decay", "zero.max_grad_norm"):
        with pytest.raises(ConfigError, match=f"^{key} = inf is not allowed; expected a finite number$"):
            load_config(overrides={key: math.inf})


def test_lr_inf_is_refused_before_launch():
    one_line_error(run_cli("train", "--lr", "inf"), "optim.lr = inf", "a finite number")


def test_diverging_run_stops_in_one_line_and_keeps_only_finite_checkpoints(tmp_path):
    folder = tmp_path / "ckpt"
    result = tiny_run(
        "--steps", "12", "--lr", "1000", "--warmup-steps", "0",
        "--checkpoint-dir", str(folder), "--save-interval", "1", "--keep-last", "2",
    )  # fmt: skip
    assert result.returncode != 0
    stopped = [line for line in error_lines(result) if "diverged" in line]
    assert len(stopped) == 1 and stopped[0].startswith("zeropp: error: step "), result.stderr[-2000:]
    step = int(stopped[0].split("step ")[1].split(":")[0])
    published = sorted(p.name for p in folder.iterdir() if p.name.startswith("step-"))
    assert published and published[-1] == f"step-{step - 1:08d}"  # nothing of the diverged step
    for name in published:
        assert all(torch.isfinite(t).all() for t in exported(folder / name, tmp_path).values()), name


def nan_save_worker(root: str) -> dict:
    from zeropp.app.trainer import Trainer
    from zeropp.checkpoint.dcp import CheckpointError
    from zeropp.config.sections import load_config

    config = load_config({"model": {"preset": "tiny"}, "train": {"micro_batch_size": 1}})
    config.checkpoint.checkpoint_dir, config.checkpoint.keep_last = root, 1
    trainer = Trainer(config)
    trainer.train_step(0)
    trainer.save(1)
    if trainer.topology.rank == 1:
        trainer.engine.units[0].master.data[0] = math.nan  # one element of one rank's shard
    try:
        trainer.save(2)
        message = "no error"
    except CheckpointError as error:
        message = str(error)
    return dict(message=message, left=sorted(p.name for p in Path(root).iterdir()))


def test_a_checkpoint_of_non_finite_weights_is_never_written_nor_prunes_a_good_one(tmp_path):
    for result in run_ranks(nan_save_worker, 2, root=str(tmp_path)):
        assert result["message"].startswith(f"not writing checkpoint '{tmp_path}/step-00000002'"), result
        assert "nan or inf" in result["message"]
        assert result["left"] == ["step-00000001"]


def test_fp16_skipped_steps_are_counted_and_too_many_in_a_row_stop_the_run(tmp_path):
    out = tmp_path / "summary.json"
    counted = tiny_run(
        "--steps", "6", "--precision", "fp16", "--initial-scale", "1e8", "--backoff-factor", "0.01",
        "--summary-json", str(out),
    )  # fmt: skip
    assert counted.returncode == 0, counted.stderr[-2000:]
    summary = json.loads(out.read_text())
    assert 1 <= summary["skipped_steps"] < 6 and math.isfinite(summary["final_train_loss"])
    assert "skipped steps" in counted.stdout and "skipped" in counted.stdout
    stopped = tiny_run(
        "--steps", "12", "--precision", "fp16", "--initial-scale", "1e30", "--max-consecutive-skipped-steps", "3"
    )
    assert stopped.returncode != 0
    assert error_lines(stopped)[0].startswith("zeropp: error: step 3: 3 optimizer steps in a row skipped"), (
        stopped.stderr
    )


# -- 2. one run per checkpoint folder ------------------------------------------------------------------


def test_a_second_run_on_the_same_folder_is_refused_and_a_dead_runs_lock_taken_over(tmp_path):
    folder, lock = tmp_path / "ckpt", tmp_path / "ckpt" / ".zeropp.lock"
    port = free_port()
    cmd = [sys.executable, "-m", "zeropp.cli", *TINY, "--steps", "5000", "--checkpoint-dir", str(folder)]
    first = subprocess.Popen([*cmd, "--master-port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not lock.is_file() or not lock.read_text():
            assert first.poll() is None and time.monotonic() < deadline, "the first run took no lock"
            time.sleep(0.05)
        second = tiny_run("--steps", "2", "--checkpoint-dir", str(folder))
        one_line_error(second, "is in use by another run", f"pid {first.pid}", f"port {port}")
    finally:
        first.terminate()  # torchrun's agent stops the ranks, then the launcher ends
        first.communicate(timeout=60)
    # the kernel drops a lock when its process ends, however it ends: the file is left and taken over
    from zeropp.app.runlock import hold

    assert str(first.pid) in lock.read_text()
    dead = tmp_path / "dead"
    killed = f"import os; from zeropp.app.runlock import hold; hold({str(dead)!r}, 1); os.kill(os.getpid(), 9)"
    assert subprocess.run([sys.executable, "-c", killed], timeout=60).returncode == -9
    hold(dead)
    assert json.loads((dead / ".zeropp.lock").read_text())["pid"] == os.getpid()
    hold(dead)  # this process again: a no-op, not a refusal
    refused = subprocess.run(
        [sys.executable, "-c", f"from zeropp.app.runlock import hold; hold({str(dead)!r}, 1234)"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert "is in use by another run" in refused.stderr and f"pid {os.getpid()}" in refused.stderr
    # zeropp train under torchrun itself: rank 0 takes the lock, and is refused in one line
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", f"--master-port={free_port()}"]
    direct = subprocess.run(
        [*torchrun, "-m", "zeropp.cli", *TINY[:3], "--steps", "1", "--checkpoint-dir", str(dead)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert direct.returncode != 0 and len(error_lines(direct)) == 1, direct.stderr[-2000:]
    assert "is in use by another run" in error_lines(direct)[0]


def test_every_launcher_tells_its_ranks_and_only_node_rank_0_takes_the_lock(tmp_path, monkeypatch):
    from zeropp.app.runlock import ENV, hold_for_ranks

    monkeypatch.delenv(ENV, raising=False)
    hold_for_ranks(tmp_path / "ckpt", 29500, node_rank=1)  # global rank 0 may run on this node
    assert os.environ[ENV] == str((tmp_path / "ckpt").resolve())
    assert not (tmp_path / "ckpt" / ".zeropp.lock").exists()


# -- 3. damaged checkpoints, 5. a finished run, 7. checkpoints said ------------------------------------


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess, dict]:
    """2 steps with --checkpoint-dir and no --save-interval: one checkpoint, at the end."""
    root = tmp_path_factory.mktemp("finished")
    out = root / "summary.json"
    result = tiny_run("--steps", "2", "--checkpoint-dir", str(root / "ckpt"), "--summary-json", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    return root / "ckpt", result, json.loads(out.read_text())


def test_checkpoint_dir_without_interval_saves_at_the_end_and_says_so(finished_run):
    folder, result, summary = finished_run
    assert sorted(p.name for p in folder.iterdir()) == [".zeropp.lock", "step-00000002"]
    said = [line for line in result.stdout.splitlines() if line.startswith("checkpoint of step 2 published: ")]
    assert len(said) == 1 and "step-00000002" in said[0] and "MiB" in said[0], result.stdout
    [record] = summary["checkpoints"]
    assert record["step"] == 2 and record["path"].endswith("step-00000002") and record["bytes"] > 0
    from zeropp.app.summary import RunSummary

    assert RunSummary.from_dict(summary).checkpoints[0].bytes == record["bytes"]  # reads back typed
    assert "checkpoints" in result.stdout and "1 published" in result.stdout


def test_resuming_a_finished_run_says_so_without_a_summary(finished_run, tmp_path):
    folder, _, _ = finished_run
    out = tmp_path / "summary.json"
    result = tiny_run("--steps", "2", "--checkpoint-dir", str(folder), "--resume", "auto", "--summary-json", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "checkpoint already at step 2 (>= --steps 2): nothing to train" in result.stdout
    assert "summary" not in result.stdout and "nan" not in result.stdout and not out.exists()


def test_a_damaged_checkpoint_file_is_named_on_resume_and_export(finished_run, tmp_path):
    damaged = tmp_path / "damaged"
    shutil.copytree(finished_run[0] / "step-00000002", damaged)
    shards = sorted(damaged.glob("*.distcp"))
    assert len(shards) == 2
    for shard in shards:
        data = bytearray(shard.read_bytes())
        data[len(data) // 2 : len(data) // 2 + 16] = bytes(255 - b for b in data[len(data) // 2 : len(data) // 2 + 16])
        shard.write_bytes(bytes(data))
    for args in (("export", str(damaged), str(tmp_path / "out.safetensors")), (*TINY, "--resume", str(damaged))):
        one_line_error(run_cli(*args), f"file '{shards[0].name}' is damaged")
    assert not (tmp_path / "out.safetensors").exists()


def resume_hyperparameters_worker(root: str) -> dict:
    from zeropp.app.trainer import Trainer
    from zeropp.config.sections import load_config

    def config(**optim):
        data = {"model": {"preset": "tiny"}, "train": {"micro_batch_size": 1}, "optim": optim}
        data["checkpoint"] = {"checkpoint_dir": root, "resume": "auto"}
        return load_config(data)

    first = Trainer(config())
    first.train_step(0)
    first.save(1)
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        second = Trainer(config(weight_decay=0.05, beta2=0.99))
    group = second.engine.optimizer.param_groups[0]
    return dict(said=said.getvalue(), weight_decay=group["weight_decay"], betas=group["betas"])


def test_resume_uses_the_runs_hyperparameters_and_says_which_differ(tmp_path):
    ranks = run_ranks(resume_hyperparameters_worker, 2, root=str(tmp_path))
    for result in ranks:
        assert (result["weight_decay"], result["betas"]) == (0.05, (0.9, 0.99))
    assert ranks[1]["said"] == ""
    assert ranks[0]["said"] == (
        f"zeropp: keeping the configured optimizer settings over checkpoint '{tmp_path}/step-00000001''s: "
        "betas = (0.9, 0.99) (the checkpoint has (0.9, 0.95)), weight_decay = 0.05 (the checkpoint has 0.1)\n"
    )


# -- 4. ranks building different models -------------------------------------------------------------------


def different_models_worker() -> list[str]:
    import dataclasses

    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.app.models.gpt import GPT, PRESETS
    from zeropp.errors import ConfigError
    from zeropp.topology import init_topology

    topology = init_topology()
    tiny = PRESETS["tiny"]
    odd = topology.rank == 1
    cases = [
        dataclasses.replace(tiny, n_head=4 if odd else tiny.n_head),  # same shapes, another model
        dataclasses.replace(tiny, n_layer=tiny.n_layer + odd),  # a block more
        tiny,  # the same: no error
    ]
    messages = []
    for gpt in cases:
        try:
            ZeroEngine(GPT(gpt), torch.optim.AdamW, {}, ZeroConfig(), topology)
            messages.append("no error")
        except ConfigError as error:  # fingerprint.ModelMismatch
            messages.append(str(error))
    return messages


def test_ranks_building_different_models_are_refused_naming_the_difference():
    for messages in run_ranks(different_models_worker, 2):
        heads, layers, same = messages
        assert heads.startswith("rank 1 built a different model than rank 0: ") and "n_head" in heads, heads
        assert "4" in heads.split(" there")[0] and "\n" not in heads
        assert "blocks.2" in layers, layers
        assert same == "no error"


# -- 6. the ZeRO-3 baseline at stages 1 and 2 ------------------------------------------------------------


def baseline_worker() -> dict:
    from zeropp.app.trainer import Trainer
    from zeropp.config.sections import load_config

    out = {}
    for stage in (1, 2, 3):
        data = {"model": {"preset": "tiny"}, "zero": {"stage": stage}, "topology": {"nodes": 2}}
        data["train"] = {"steps": 2, "micro_batch_size": 1, "eval_batches": 1}
        summary = Trainer(load_config(data)).run()
        out[stage] = (summary.inter_node_bytes_per_step, summary.zero3_inter_node_bytes_per_step)
    return out


def test_zero3_baseline_at_stages_1_and_2_is_what_zero3_sends():
    result = run_ranks(baseline_worker, 4, nodes=2)[0]
    sent3, zero3 = result[3]
    # ZeRO-3 itself sends the baseline, and the step's all-reduces: the norm's 4 bytes and a byte per parameter
    # saying which got a gradient (the tiny preset's 28), 2 (n-1)/n of each per rank
    assert abs(sent3 - zero3) <= 2 * (4 + 28)
    for stage in (1, 2):
        sent, baseline = result[stage]
        assert baseline == zero3, (stage, baseline, zero3)
        assert sent < 0.8 * baseline  # stages 1-2 gather weights once per step, not twice per micro-batch
