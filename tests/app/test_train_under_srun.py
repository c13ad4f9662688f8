"""``zeropp train`` started by srun once per rank (no torchrun): each task is a rank of the job's world,
placed by Slurm's variables; here 2 tasks on one node, their environment as srun sets it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from launcher import TORCHRUN, free_port, launcher_env

WORLD = 2


def test_zeropp_train_as_two_srun_tasks_is_one_run_of_two_ranks(tmp_path):
    port, summary = free_port(), tmp_path / "summary.json"
    command = [sys.executable, "-m", "zeropp.cli", "train", "--preset", "tiny", "--steps", "2", "--eval-batches", "1",
               "--summary-json", str(summary)]  # fmt: skip
    base = {k: v for k, v in os.environ.items() if k not in TORCHRUN and not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    tasks = [
        subprocess.Popen(
            command,
            env={**base, **launcher_env("slurm", rank, WORLD, 1, port)},
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        for rank in range(WORLD)
    ]
    outputs = [task.communicate(timeout=300) for task in tasks]
    for task, (_, err) in zip(tasks, outputs, strict=True):
        assert task.returncode == 0, err[-3000:]
    got = json.loads(summary.read_text())
    assert (got["world_size"], got["nodes"], got["steps"]) == (WORLD, 1, 2)
    assert len(got["model_state_bytes_per_rank"]) == WORLD
    assert "summary" in outputs[0][0] and "summary" not in outputs[1][0]  # rank 0 reports, once
