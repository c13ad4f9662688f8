"""The progress shown while training: validation only once measured, tokens/s labelled (all ranks and
per rank), MFU where known, and a line every tenth of the run where the output is not a terminal."""

from __future__ import annotations

import io

from rich.console import Console

from zeropp.app import report


def _metrics(step: int, val: float | None, mfu: float | None = None):
    from zeropp.app.metrics import StepMetrics

    return StepMetrics(step, 5.0 - step / 10, val, 1.0, 1e-3, 0.5, 1234.0, 308.5, mfu, 1 << 20)


def test_progress_lines_without_a_terminal(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(report, "console", Console(file=out, force_terminal=False, width=200))
    with report.progress_bar(20, enabled=True) as update:
        for step in range(1, 21):
            update(_metrics(step, 3.25 if step == 9 else None), 0)  # validated after step 9 only
    lines = out.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == [f"{s}/20" for s in range(2, 21, 2)]
    assert lines[0] == "step 2/20  loss 4.8000  1,234 tok/s all ranks (308 per rank)"  # no val before one
    assert lines[-1] == "step 20/20  loss 3.0000  val 3.2500  1,234 tok/s all ranks (308 per rank)"  # the latest
    assert "nan" not in out.getvalue() and "MFU" not in out.getvalue()  # CPU: no peak, no MFU


def test_progress_shows_mfu_where_known_and_skipped_steps(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(report, "console", Console(file=out, force_terminal=False, width=200))
    with report.progress_bar(1, enabled=True) as update:
        update(_metrics(1, None, mfu=0.4123), 2)
    assert out.getvalue().strip() == "step 1/1  loss 4.9000  1,234 tok/s all ranks (308 per rank)  MFU 41.2%  2 skipped"


def test_train_and_estimate_print_bytes_alike():
    from zeropp.tools.estimate import show

    assert report.si is show.si  # one formatter: decimal prefixes (GB = 1e9 bytes)
    assert report.si(61_234) == "61.2 kB" and report.si(1.88e9) == "1.88 GB"
