"""On a CPU where DeepSpeed refuses fp16 (oneDNN without fp16 kernels: an AMD EPYC with
avx512_bf16 only), the DeepSpeed-import tests still run their fp32 and bf16 cases and report the fp16
ones as skipped with DeepSpeed's reason, instead of erroring the whole module."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed's import picks and caches an accelerator
pytest.importorskip("deepspeed")

TESTS = Path(__file__).resolve().parents[1]
# DeepSpeed's CPU accelerator answers as it does where oneDNN has no fp16; forked ranks inherit it
WITHOUT_FP16 = """
import sys, pytest
from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
CPU_Accelerator.is_fp16_supported = lambda self: False
sys.exit(pytest.main(sys.argv[1:]))
"""


def test_fp16_cases_skip_and_the_rest_run_where_deepspeed_has_no_fp16(tmp_path):
    module = TESTS / "checkpoint" / "test_deepspeed_import.py"
    selected = "masters and gpt-stage2"  # the stage-2 GPT in fp32, bf16 and fp16
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_FP16, str(module), "-k", selected, "-rs", "-p", "no:cacheprovider",
         "--basetemp", str(tmp_path / "basetemp"), "-o", "addopts="],
        capture_output=True, text=True, cwd=TESTS.parent, timeout=600,
    )  # fmt: skip
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-2000:]
    assert "deepspeed cpu accelerator: fp32, bf16\n" in out, out[:1000]
    assert "2 passed, 1 skipped" in out, out[-2000:]
    assert "DeepSpeed's CPU accelerator does not support fp16 on this CPU" in out, out[-2000:]
