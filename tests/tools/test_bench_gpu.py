"""zeropp bench gpu: one line without CUDA; with --allow-cpu every measuring stage runs on the CPU."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from cli_runner import run_cli

from zeropp.tools.bench.gpu.check import SRC, TESTS, junit_counts


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_without_cuda_it_says_so_in_one_line_and_succeeds(tmp_path):
    done = run_cli("bench", "gpu", "--out", str(tmp_path / "out"))
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert len(done.stdout.splitlines()) == 1 and "CUDA is not available" in done.stdout
    assert not (tmp_path / "out").exists()


def numbers(value):
    if isinstance(value, dict):
        return [n for v in value.values() for n in numbers(v)]
    if isinstance(value, list):
        return [n for v in value for n in numbers(v)]
    return [value] if isinstance(value, float) else []


def test_every_measuring_stage_runs_on_the_cpu(tmp_path):
    """b, c and f with tiny sizes on gloo: each stage ok, its numbers finite, gpu.md written."""
    command = [sys.executable, "-m", "zeropp.cli", "bench", "gpu", "--allow-cpu", "--quick", "--stages", "b,c,f",
               "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "gpu.json").read_text())
    assert list(report["stages"]) == ["b", "c", "f"]
    for stage, record in report["stages"].items():
        assert record["status"] == "ok", (stage, record["error"])
        assert numbers(record["results"]) and all(math.isfinite(n) for n in numbers(record["results"])), stage
    assert report["stages"]["b"]["results"]["world2/stage3"]["passed"]
    assert report["stages"]["b"]["results"]["world2/stage3-offload-cpu-in-backward"]["passed"]
    offload = report["stages"]["f"]["results"]["offload"]
    assert offload["ratio_offload_to_device"] > 0 and offload["ratio_in_backward_to_device"] > 0
    assert "## b: exactness" in (tmp_path / "gpu.md").read_text()


def test_the_pytest_report_is_counted(tmp_path):
    xml = tmp_path / "junit.xml"
    xml.write_text(
        '<testsuites><testsuite><testcase classname="t" name="ok"/><testcase classname="t" name="bad"><failure/>'
        '</testcase><testcase classname="t" name="off"><skipped/></testcase></testsuite></testsuites>'
    )
    assert junit_counts(xml) == {"passed": 1, "failed": 1, "errors": 0, "skipped": 1, "failures": ["t::bad"]}


def test_stage_a_finds_the_checkouts_tests_and_its_ranks_find_zeropp():
    assert (SRC / "zeropp" / "__init__.py").is_file()
    assert (TESTS / "conftest.py").is_file()
