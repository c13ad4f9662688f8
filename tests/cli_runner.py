"""``zeropp`` run as a user runs it: a subprocess of this Python, its output captured."""

from __future__ import annotations

import subprocess
import sys


def run_cli(
    *args: str, env: dict | None = None, timeout: float = 300, prelude: str = ""
) -> subprocess.CompletedProcess:
    """``zeropp ARGS`` (``python -m zeropp.cli``); with `prelude`, that Python code runs first in the
    same process (e.g. a monkeypatch of what the CLI reaches)."""
    if prelude:
        code = f"{prelude}import sys; from zeropp.cli import main; sys.exit(main(sys.argv[1:]))"
        command = [sys.executable, "-c", code, *args]
    else:
        command = [sys.executable, "-m", "zeropp.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
