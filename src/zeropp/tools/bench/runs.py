"""What the benchmarks share: ``zeropp train`` runs read back as a :class:`~zeropp.app.summary.RunSummary`,
the flags that switch ZeRO++ on or off, where a one-file benchmark writes (:func:`output_file`), and the
CPU model that goes beside its numbers (:func:`cpu_model`)."""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from zeropp.app.flags import as_flags
from zeropp.app.summary import RunSummary
from zeropp.config.sections import ZEROPP_SWITCHES, ZeroConfig

ZEROPP_OFF = {key: ZeroConfig().as_flat()[key] for key in ZEROPP_SWITCHES}  # the library's defaults: all off
ZEROPP_ON_FLAGS = as_flags(ZEROPP_SWITCHES)  # qwZ, hpZ over each node, qgZ
ZEROPP_OFF_FLAGS = as_flags(ZEROPP_OFF)


def train_summary(args: Sequence[str]) -> RunSummary:
    """Run ``zeropp train <args>`` (4 ranks as 2 simulated nodes unless `args` say otherwise), its
    output discarded, and return its summary; raises CalledProcessError if it fails."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "summary.json"
        command = [sys.executable, "-m", "zeropp.cli", "train", *args, "--summary-json", str(out)]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        return RunSummary.from_json(out.read_text())


def publish_report(out: Path, report: str, plot: Callable[[], None]) -> None:
    """Write the markdown `report` to ``out/results.md``, print it, and draw the plots when
    matplotlib (the ``bench`` extra) is installed."""
    (out / "results.md").write_text(report + "\n")
    print(report)
    try:
        plot()
    except ImportError:
        print("matplotlib is not installed: no plots (pip install matplotlib)")


def output_file(parser: argparse.ArgumentParser, out: Path, default_name: str) -> Path:
    """Where a one-file benchmark writes, checked before any work (a late failure would lose every
    number): `out` itself where it names a file (it has a suffix), else `default_name` inside the
    folder `out`, as the folder benchmarks take it. One line through `parser` where it cannot be written."""
    path = out if out.suffix and not out.is_dir() else out / default_name
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        existed = path.exists()
        with open(path, "a"):
            pass
        if not existed:
            os.remove(path)
    except OSError as error:
        parser.error(f"--out {str(out)!r} cannot be written ({error.strerror}); give a folder or a .json file")
    return path


def cpu_model() -> str:
    """The CPU's model name as ``lscpu`` says it (the processor's name where lscpu is missing)."""
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown"
