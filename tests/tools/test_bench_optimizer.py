"""``zeropp bench optimizer`` on tiny shards: each step's bytes set beside a plain copy's bandwidth."""

from __future__ import annotations

import json

import pytest

from zeropp.tools.bench.speed.optimizer import ADAMW_BYTES, main


def test_the_step_is_set_beside_the_copy_bandwidth(tmp_path, capsys):
    out = tmp_path / "optimizer.json"
    assert (
        main(["--params", "2e5", "--units", "2", "--repeats", "2", "--only", "torch AdamW fused", "--out", str(out)])
        == 0
    )
    record = json.loads(out.read_text())
    (row,) = record["rows"]
    assert record["copy_bytes_per_s"] > 0 and row["optimizer"] == "torch AdamW fused"
    assert row["bytes_per_s"] == pytest.approx(ADAMW_BYTES * 2e5 / row["seconds"])
    assert row["of_copy"] == pytest.approx(row["bytes_per_s"] / record["copy_bytes_per_s"])
    assert "| torch AdamW fused |" in capsys.readouterr().out


def test_an_unknown_optimizer_is_one_line(capsys):
    with pytest.raises(SystemExit):
        main(["--only", "Lion"])
    assert "--only 'Lion' is not an optimizer that runs here" in capsys.readouterr().err
