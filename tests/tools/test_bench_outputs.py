"""Where the benchmarks write: a folder or a file for every one-file benchmark, checked before the work,
and `zeropp bench step` keeping what it measured as it goes."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from cli_runner import run_cli

from zeropp.tools.bench.runs import output_file


def test_a_folder_gets_the_default_name_and_a_file_is_itself(tmp_path):
    parser = argparse.ArgumentParser()
    assert output_file(parser, tmp_path, "bench_step.json") == tmp_path / "bench_step.json"
    assert (
        output_file(parser, tmp_path / "new" / "folder", "bench_step.json") == tmp_path / "new/folder/bench_step.json"
    )
    assert output_file(parser, tmp_path / "mine.json", "bench_step.json") == tmp_path / "mine.json"
    assert not (tmp_path / "mine.json").exists()  # checked, not left behind


def test_an_output_that_cannot_be_written_is_refused_in_one_line_before_any_work(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(SystemExit):
        output_file(argparse.ArgumentParser(prog="zeropp bench step"), blocker / "out.json", "bench_step.json")
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("zeropp bench step: error: --out ") and "cannot be written" in err


def test_bench_step_into_a_folder_with_a_whole_parameter_variant(tmp_path):
    command = [
        "bench", "step", "--worlds", "2", "--n-layer", "1", "--d-model", "32",
        "--block-size", "16", "--steps", "2", "--warmup", "1", "--reps", "1",
        "--variants", "zeropp-3-muon", "--out", str(tmp_path),
    ]  # fmt: skip
    done = run_cli(*command, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(Path(tmp_path / "bench_step.json").read_text())["worlds"]["2"]
    assert set(rows) == {"zeropp-3-muon"}
    assert all(row["median_step_time_s"] > 0 for row in rows.values()), rows
