"""The library's example exits cleanly: with ``with zeropp.init_topology()``, and without any shutdown
(gloo's threads used to abort ~1 in 5 exits: "terminate called without an active exception").

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


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("variant", ["with", "no-shutdown"])
def test_example_exits_without_abort(tmp_path, variant, world):
    script = EXAMPLES / "using_it.py"
    if variant == "no-shutdown":
        script = tmp_path / "no_shutdown.py"
        script.write_text(NO_SHUTDOWN)
    for run in range(RUNS):
        result = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
             f"--master-port={free_port()}", str(script)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert result.returncode == 0 and "terminate called" not in result.stderr, (run, result.stderr[-2000:])
        assert "tensors" in result.stdout
