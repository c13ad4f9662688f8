"""What the example tests share: run ``examples/<name>`` on 2 ranks under torchrun, and whether the
README shows the example as it runs (from its first import on)."""

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


def readme_shows(name: str) -> bool:
    example = (ROOT / "examples" / name).read_text()
    code = example[example.index("import ") :]
    return f"```python\n{code}```" in (ROOT / "README.md").read_text()
