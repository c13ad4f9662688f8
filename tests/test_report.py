"""The progress shown while training: no NaN before the first evaluation, tokens/s labelled, and a
line every tenth of the run where the output is not a terminal."""

from __future__ import annotations

import io

from rich.console import Console

from zeropp import report


def test_progress_lines_without_a_terminal(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(report, "console", Console(file=out, force_terminal=False, width=200))
    with report.progress_bar(20, enabled=True) as update:
        for step in range(1, 21):
            update(step, 5.0 - step / 10, float("nan") if step < 10 else 3.25, 1234.0)
    lines = out.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == [f"{s}/20" for s in range(2, 21, 2)]
    assert lines[0] == "step 2/20  loss 4.8000  val -  1,234 tok/s (all ranks)"
    assert lines[-1].endswith("val 3.2500  1,234 tok/s (all ranks)")
    assert "nan" not in out.getvalue()


def test_train_and_estimate_print_bytes_alike():
    from zeropp.estimate import show

    assert report.si is show.si  # one formatter: decimal prefixes (GB = 1e9 bytes)
    assert report.si(61_234) == "61.2 kB" and report.si(1.88e9) == "1.88 GB"
