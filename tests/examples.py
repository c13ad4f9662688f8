"""What the example tests share: run ``examples/<name>`` on 2 ranks under torchrun, and whether a docs
page shows the example as it runs (included by a snippet line, so the page cannot drift from the file)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from launcher import free_port

ROOT = Path(__file__).resolve().parents[1]


def run_example(name: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
        str(ROOT / "examples" / name), *args,
    ]  # fmt: skip
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def docs_include(page: str, name: str) -> bool:
    """Whether ``docs/<page>`` includes ``examples/<name>`` whole, as the only line of a fenced block
    (pymdownx.snippets; ``mkdocs build --strict`` fails where the file is missing)."""
    text = (ROOT / "docs" / page).read_text()
    return f'\n--8<-- "examples/{name}"\n```\n' in text and (ROOT / "examples" / name).is_file()
