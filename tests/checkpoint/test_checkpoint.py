"""Checkpoints: exact resume, resharding across world size / nodes / stage, export, a killed rank,
a save killed or out of disk space, and the bad inputs that must fail in one line and destroy nothing."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cli_runner import run_cli
from launcher import free_port, rank_pids, run_ranks
from runs import PROBE, run_config, weights_of

# -- exact resume ---------------------------------------------------------------------------------

RESUME_CASES = {
    "stage1": {"stage": 1},
    "stage2": {"stage": 2},
    "stage3": {"stage": 3},
    "zeropp": {"stage": 3, "quantized_weights": True, "hpz_partition_size": 0, "quantized_gradients": True},
    # error feedback (reset at steps 4 and 8), two-level qgZ with rotation, qgZ off from step 9
    "zeropp-loco": {
        "stage": 3,
        "quantized_weights": True,
        "hpz_partition_size": 0,
        "quantized_gradients": True,
        "gradient_error_feedback": "loco",
        "err_beta": 0.5,
        "reset_T": 4,
        "gradient_intra_node_bits": 8,
        "gradient_hadamard": True,
        "quantized_gradients_until": 0.75,
    },
}


def resume_worker(root: str) -> dict:
    from zeropp.app.trainer import Trainer

    out = {}
    for name, zero in RESUME_CASES.items():
        folder = Path(root) / name
        straight = Trainer(run_config(folder / "straight", 12, nodes=2, zero=zero))
        straight_losses = [straight.train_step(step) for step in range(12)]
        first = Trainer(run_config(folder / "resumed", 12, nodes=2, zero=zero))
        for step in range(6):
            first.train_step(step)
        first.save(6)
        second = Trainer(run_config(folder / "resumed", 12, nodes=2, zero=zero, checkpoint={"resume": "auto"}))
        resumed_losses = [second.train_step(step) for step in range(second.start_step, 12)]
        a, b = weights_of(straight), weights_of(second)
        out[name] = dict(
            start=second.start_step,
            losses_equal=straight_losses[6:] == resumed_losses,
            weights_equal=all(torch.equal(a[k], b[k]) for k in a),
            trained=not torch.equal(a["wte.weight"], weights_of(first)["wte.weight"]),
        )
    out["residuals"] = _residuals_across_worlds(Path(root) / "zeropp-loco" / "resumed")
    return out


def _residuals_across_worlds(folder: Path) -> dict:
    """The loco checkpoint (step 6, after 2 steps since the reset at 4) holds residuals; loaded on
    the same world they come back as saved, on another node count they start at zero with a note."""
    import contextlib
    import io

    from zeropp.app.trainer import Trainer

    zero, resume = RESUME_CASES["zeropp-loco"], {"resume": "auto"}
    same = Trainer(run_config(folder, 12, nodes=2, zero=zero, checkpoint=resume))
    note = io.StringIO()
    with contextlib.redirect_stdout(note):
        other = Trainer(run_config(folder, 12, nodes=1, zero=zero, checkpoint=resume))
    norms = [
        [float(r.abs().max()) for u in t.engine.units for r in u.error_feedback.residuals.values()]
        for t in (same, other)
    ]
    return dict(
        same_world_nonzero=bool(norms[0]) and min(norms[0]) > 0,
        other_world_zero=max(norms[1], default=0.0) == 0,
        note="residuals start from zero" in note.getvalue(),
    )


def test_resume_is_bit_identical_for_stages_1_2_3_and_zeropp_with_error_feedback(tmp_path):
    per_rank = run_ranks(resume_worker, 4, nodes=2, root=str(tmp_path))
    for rank, cases in enumerate(per_rank):
        residuals = cases.pop("residuals")
        assert residuals == dict(same_world_nonzero=True, other_world_zero=True, note=rank == 0), rank
        for name, result in cases.items():
            assert result == dict(start=6, losses_equal=True, weights_equal=True, trained=True), (rank, name)


# -- resharding and export ---------------------------------------------------------------------------


def save_world4_worker(root: str) -> dict:
    from zeropp.app.trainer import Trainer

    trainer = Trainer(run_config(Path(root), 8, nodes=2, zero={"stage": 3}))
    for step in range(4):
        trainer.train_step(step)
    trainer.save(4)
    with torch.no_grad():
        logits = trainer.engine.eval()(PROBE)
    trainer.engine.train()
    for step in range(4, 7):
        trainer.train_step(step)
    return dict(logits=logits, after=weights_of(trainer))


def load_worker(root: str, stage: int, micro_batch: int) -> dict:
    from zeropp.app.trainer import Trainer

    config = run_config(Path(root), 8, nodes=1, micro_batch=micro_batch, zero={"stage": stage})
    config.checkpoint.resume = "auto"
    trainer = Trainer(config)
    loaded = weights_of(trainer)
    for step in range(trainer.start_step, 7):
        trainer.train_step(step)
    return dict(start=trainer.start_step, loaded=loaded, after=weights_of(trainer))


def test_save_at_world4_loads_at_world2_and_world1_and_exports(tmp_path):
    from safetensors.torch import load_file

    from zeropp.app.models.gpt import GPT, gpt_config
    from zeropp.checkpoint.dcp import export_checkpoint

    world4 = run_ranks(save_world4_worker, 4, nodes=2, root=str(tmp_path))
    exported = tmp_path / "model.safetensors"
    meta = export_checkpoint(tmp_path / "step-00000004", exported)
    saved = load_file(str(exported))
    assert meta["world_size"] == 4 and meta["step"] == 4
    for world, stage in ((2, 1), (1, 2)):
        results = run_ranks(load_worker, world, root=str(tmp_path), stage=stage, micro_batch=4 // world)
        for result in results:
            assert result["start"] == 4
            loaded = result["loaded"]
            assert loaded.keys() == saved.keys()
            assert all(torch.equal(loaded[k], saved[k]) for k in saved), f"world {world}: weights after load"
            # same global batches from the same state: training continues as at world 4
            error = max((result["after"][k] - world4[0]["after"][k]).abs().max().item() for k in saved)
            assert error <= 1e-5, f"world {world} continued {error:.3g} away from world 4"
    # the exported file loads into the unmodified model and reproduces the sharded model's outputs
    model = GPT(gpt_config(run_config(tmp_path, 8, nodes=1).model))
    model.load_state_dict(saved)
    with torch.no_grad():
        assert torch.allclose(model(PROBE), world4[0]["logits"], atol=1e-6, rtol=0)


# -- a save that dies or runs out of disk ------------------------------------------------------------


def interrupted_save_worker(root: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from zeropp.app.trainer import Trainer
    from zeropp.checkpoint.dcp import CheckpointError, _state_to_save, find_latest, load_checkpoint

    trainer = Trainer(run_config(Path(root), 8, nodes=2, zero={"stage": 3}))
    trainer.train_step(0)
    trainer.save(1)
    saved = weights_of(trainer)
    trainer.train_step(1)
    # what a save killed after every rank wrote its data, before the publish, leaves behind
    dcp.save(_state_to_save(trainer.engine), storage_writer=FileSystemWriter(f"{root}/.step-00000002.partial"))
    partial_left = sorted(p.name for p in Path(root).iterdir())
    latest_after_kill = find_latest(root).name
    torch.distributed.barrier()  # every rank has looked before the next save tidies up
    write = FileSystemWriter.write_data

    def disk_full(self, plan, planner):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    FileSystemWriter.write_data = disk_full
    try:
        trainer.save(2)
        disk_error = "no error"
    except CheckpointError as error:
        disk_error = str(error)
    FileSystemWriter.write_data = write
    after_disk_full = sorted(p.name for p in Path(root).iterdir())
    torch.distributed.barrier()
    load_checkpoint(trainer.engine, find_latest(root))
    reloaded = weights_of(trainer)
    trainer.train_step(1)
    trainer.save(2)  # a good save clears what the killed one left
    return dict(
        partial_left=partial_left,
        latest_after_kill=latest_after_kill,
        disk_error=disk_error,
        after_disk_full=after_disk_full,
        reloaded_equal=all(torch.equal(saved[k], reloaded[k]) for k in saved),
        final=sorted(p.name for p in Path(root).iterdir()),
    )


def test_killed_or_out_of_disk_save_leaves_previous_checkpoint_loadable(tmp_path):
    for result in run_ranks(interrupted_save_worker, 4, nodes=2, root=str(tmp_path)):
        assert result["partial_left"] == [".step-00000002.partial", "step-00000001"]
        assert result["latest_after_kill"] == "step-00000001"  # the partial one is never picked
        assert result["disk_error"].startswith(f"could not write checkpoint '{tmp_path}/step-00000002'")
        assert "No space left on device" in result["disk_error"] and "\n" not in result["disk_error"]
        assert result["after_disk_full"] == ["step-00000001"]
        assert result["reloaded_equal"]
        assert result["final"] == ["step-00000001", "step-00000002"]


def full_disk_worker(root: str) -> dict:
    from zeropp.app.trainer import Trainer
    from zeropp.checkpoint.dcp import CheckpointError, find_latest, load_checkpoint

    trainer = Trainer(run_config(Path(root) / "ckpt", 8, nodes=2, zero={"stage": 3}))
    trainer.train_step(0)
    trainer.save(1)  # fits; a second one does not
    errors = []
    for remount in ("", "remount,ro"):
        if remount and trainer.topology.rank == 0:
            subprocess.run(["mount", "-o", remount, root], check=True)
        torch.distributed.barrier()
        try:
            trainer.save(2)
            errors.append("no error")
        except CheckpointError as error:
            errors.append(str(error))
    load_checkpoint(trainer.engine, find_latest(Path(root) / "ckpt"))
    return dict(errors=errors, left=sorted(p.name for p in (Path(root) / "ckpt").iterdir()))


def test_a_real_full_disk_or_read_only_folder_is_one_line_naming_the_folder_and_bytes(small_disk):
    disk = small_disk("2m")
    results = run_ranks(full_disk_worker, 2, nodes=2, root=str(disk))
    folder = f"{disk}/ckpt"
    for result in results:
        full, read_only = result["errors"]
        for message, reason in ((full, "No space left on device"), (read_only, "Read-only file system")):
            assert message.startswith(f"could not write checkpoint '{folder}/step-00000002': {reason}; it needs about ")
            assert f"MiB in '{folder}' (" in message and "\n" not in message and len(message) < 160 + 2 * len(folder), (
                message
            )
            assert "needs about 1.7 MiB" in message, message  # the size of the checkpoint before it
            assert message.endswith("MiB free); the checkpoints already there are kept"), message
        assert result["left"] == ["step-00000001"]


# -- zeropp train: a killed rank, bad inputs -------------------------------------------------------------


def test_killed_rank_restarts_resumes_and_ends_with_the_uninterrupted_weights(tmp_path):
    from safetensors.torch import load_file

    from zeropp.checkpoint.dcp import export_checkpoint

    run = ["train", "--preset", "tiny", "--steps", "24", "--eval-batches", "1", "--save-interval", "4"]
    run += ["--keep-last", "0", "--resume", "auto", "--max-restarts", "1"]
    straight = run_cli(*run, "--checkpoint-dir", str(tmp_path / "a"), "--master-port", str(free_port()))
    assert straight.returncode == 0, straight.stderr[-2000:]

    summary = tmp_path / "summary.json"
    cmd = [sys.executable, "-m", "zeropp.cli", *run, "--checkpoint-dir", str(tmp_path / "b")]
    cmd += ["--master-port", str(free_port()), "--summary-json", str(summary)]
    launcher = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / "b" / "step-00000004").exists():
        assert launcher.poll() is None and time.monotonic() < deadline, "no checkpoint at step 4"
        time.sleep(0.02)
    workers = rank_pids(launcher.pid)
    assert len(workers) == 4
    os.kill(workers[1], signal.SIGKILL)
    _, stderr = launcher.communicate(timeout=300)
    assert launcher.returncode == 0, stderr[-3000:]
    resumed = json.loads(summary.read_text())
    assert 4 <= resumed["start_step"] < 24, "the restarted ranks did not resume from a checkpoint"
    final = {}
    for run_name in ("a", "b"):
        export_checkpoint(tmp_path / run_name / "step-00000024", tmp_path / f"{run_name}.safetensors")
        final[run_name] = load_file(str(tmp_path / f"{run_name}.safetensors"))
    a, b = final["a"], final["b"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory) -> Path:
    """A real checkpoint of the tiny GPT written by zeropp train (2 ranks, 2 steps)."""
    root = tmp_path_factory.mktemp("ckpt")
    result = run_cli(
        "train", "--preset", "tiny", "--steps", "2", "--eval-batches", "1", "--nproc-per-node", "2",
        "--checkpoint-dir", str(root), "--save-interval", "2", "--master-port", str(free_port()),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    return root / "step-00000002"


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()


def _one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
    assert lines[0].startswith("zeropp: error: ") and all(f in lines[0] for f in fragments), lines[0]


def test_bad_checkpoint_inputs_fail_in_one_line_before_launch_and_destroy_nothing(small_checkpoint, tmp_path):
    before = _digest(small_checkpoint.parent)
    corrupt = tmp_path / "corrupt"
    shutil.copytree(small_checkpoint, corrupt)
    (corrupt / ".metadata").write_bytes(b"not a checkpoint")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    tiny = ["train", "--preset", "tiny", "--nproc-per-node", "2"]
    cases = [
        ((*tiny, "--resume", str(tmp_path / "missing")), ("does not exist",)),
        ((*tiny, "--resume", str(corrupt)), ("incomplete or corrupt",)),
        (("train", "--preset", "small", "--resume", str(small_checkpoint)), ("model.preset = 'tiny'", "'small'")),
        ((*tiny, "--n-head", "4", "--resume", str(small_checkpoint)), ("model.n_head = None", "model.n_head = 4")),
        ((*tiny, "--checkpoint-dir", str(blocker / "sub"), "--save-interval", "1"), ("not writable",)),
        ((*tiny, "--resume", "auto"), ("checkpoint.checkpoint_dir", "resume = 'auto'")),
        (("export", str(small_checkpoint), str(blocker / "out.safetensors")), ("cannot write",)),
        (("export", str(corrupt), str(tmp_path / "out.safetensors")), ("incomplete or corrupt",)),
    ]
    for args, fragments in cases:
        _one_line_error(run_cli(*args), *fragments)
    assert _digest(small_checkpoint.parent) == before
    assert not (tmp_path / "out.safetensors").exists()


def different_model_worker(path: str) -> str:
    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.app.models.gpt import GPT, PRESETS
    from zeropp.checkpoint.dcp import CheckpointError, load_checkpoint
    from zeropp.topology import init_topology

    one_layer_less = dataclasses.replace(PRESETS["tiny"], n_layer=PRESETS["tiny"].n_layer - 1)
    engine = ZeroEngine(GPT(one_layer_less), torch.optim.AdamW, {}, ZeroConfig(), init_topology())
    try:
        load_checkpoint(engine, path)
    except CheckpointError as error:
        return str(error)
    return "no error"


def test_loading_into_a_different_model_is_refused(small_checkpoint):
    from zeropp.app.models.gpt import PRESETS

    message = run_ranks(different_model_worker, 1, path=str(small_checkpoint))[0]
    last = f"blocks.{PRESETS['tiny'].n_layer - 1}."
    assert "holds a different model" in message and last in message and "(absent)" in message, message


def cuda_generator_worker(root: str) -> bool:
    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.app.models.gpt import GPT, PRESETS
    from zeropp.checkpoint.dcp import load_checkpoint, save_checkpoint
    from zeropp.topology import init_topology

    topology = init_topology()
    engine = ZeroEngine(GPT(PRESETS["tiny"]), torch.optim.AdamW, {}, ZeroConfig(), topology)
    path = save_checkpoint(engine, root, step=1)
    expected = torch.rand(4, device=topology.device)
    load_checkpoint(engine, path)
    return torch.equal(torch.rand(4, device=topology.device), expected)


@pytest.mark.gpu
def test_a_checkpoint_restores_the_cuda_generator(tmp_path):
    """Dropout on CUDA draws from the device's generator: a resume continues its stream."""
    assert run_ranks(cuda_generator_worker, 1, start="spawn", root=str(tmp_path)) == [True]


def test_resuming_the_folder_of_checkpoints_names_its_newest(tmp_path):
    from zeropp.checkpoint.dcp import CheckpointError, checkpoint_name, read_meta

    for step in (2, 10):
        (tmp_path / checkpoint_name(step)).mkdir()
        (tmp_path / checkpoint_name(step) / "zeropp.json").write_text("{}")
    with pytest.raises(
        CheckpointError, match="folder of checkpoints, not one; its newest is .*step.*10.*--resume auto"
    ):
        read_meta(tmp_path)
