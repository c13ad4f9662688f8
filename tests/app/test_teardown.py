"""The library's example exits cleanly: with ``with zeropp.init_topology()``, and without any shutdown
(gloo's threads used to abort ~1 in 5 exits: "terminate called without an active exception"), also
where another library started torch.distributed (accelerate under the Trainer, Lightning).

More runs: ZEROPP_TEARDOWN_RUNS=20 python -m pytest -q tests/app/test_teardown.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from launcher import free_port

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
RUNS = int(os.environ.get("ZEROPP_TEARDOWN_RUNS", "2"))
WORLDS = [int(w) for w in os.environ.get("ZEROPP_TEARDOWN_WORLDS", "2").split(",")]
NO_SHUTDOWN = f"""
import sys; sys.path.insert(0, {str(EXAMPLES)!r})
import zeropp
from using_it import train
train(zeropp.init_topology())  # and exit without zeropp.shutdown()
"""
STARTED_ELSEWHERE = f"""
import atexit, sys; sys.path.insert(0, {str(EXAMPLES)!r})
import torch.distributed as dist
dist.init_process_group("gloo")  # as accelerate or Lightning does before zeropp builds its groups
atexit.register(lambda: print(f"process group at exit: {{dist.is_initialized()}}"))  # one write a rank
import zeropp
from using_it import train
train(zeropp.init_topology())
"""


def torchrun(script: Path, world: int) -> subprocess.CompletedProcess:
    port = free_port()
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}", f"--master-port={port}"]
    return subprocess.run([*command, str(script)], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("variant", ["with", "no-shutdown"])
def test_example_exits_without_abort(tmp_path, variant, world):
    script = EXAMPLES / "using_it.py"
    if variant == "no-shutdown":
        script = tmp_path / "no_shutdown.py"
        script.write_text(NO_SHUTDOWN)
    for run in range(RUNS):
        result = torchrun(script, world)
        assert result.returncode == 0 and "terminate called" not in result.stderr, (run, result.stderr[-2000:])
        assert "tensors" in result.stdout


def test_groups_another_library_started_are_destroyed_at_exit(tmp_path):
    """zeropp's exit hook also runs where torch.distributed was started before zeropp: no rank leaves
    its process group (and gloo's threads) to the C++ runtime."""
    script = tmp_path / "started_elsewhere.py"
    script.write_text(STARTED_ELSEWHERE)
    result = torchrun(script, 2)
    assert result.returncode == 0 and "terminate called" not in result.stderr, result.stderr[-2000:]
    assert result.stdout.count("process group at exit: False") == 2, result.stdout[-2000:]
