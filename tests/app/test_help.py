"""zeropp train --help: every flag with its meaning and default; zeropp --version."""

from __future__ import annotations

import argparse
import subprocess
import sys

from zeropp.cli import build_parser
from zeropp.config.keys import leaf_keys


def train_parser() -> argparse.ArgumentParser:
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices["train"]


def test_every_train_flag_has_a_meaning_and_a_default():
    for action in train_parser()._actions:
        if action.help == argparse.SUPPRESS or action.dest == "help":
            continue
        assert "(default: " in action.help and len(action.help.split("(default")[0].strip()) > 10, action.dest
    text = train_parser().format_help()
    assert "`" not in text and "`" not in build_parser().format_help()
    helps = {a.dest: (a.metavar, a.help) for a in train_parser()._actions if a.help != argparse.SUPPRESS}
    assert helps["checkpoint.resume"][0] == "auto|PATH" and "a fresh start if none" in helps["checkpoint.resume"][1]
    assert "default: True at stage 3, else False" in helps["zero.quantized_weights"][1]  # zeropp train's ZeRO++
    assert all(key.meaning for key in leaf_keys().values())


def test_version():
    result = subprocess.run([sys.executable, "-m", "zeropp.cli", "--version"], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.startswith("zeropp ")
