"""``zeropp bench gpu``'s report: gpu.md (a markdown table per stage) and the closing summary."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any


def _num(value: Any, scale: float = 1.0, digits: int = 3) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, (int, float)):
        return f"{value * scale:,.{digits}g}" if scale != 1.0 or isinstance(value, float) else f"{value:,}"
    return str(value)


def _mib(value: Any) -> str:
    return "n/a" if value is None else f"{value / 2**20:,.0f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def _verdict(result: dict[str, Any]) -> str:
    if "error" in result:
        return f"error: {result['error']}"
    if "skipped" in result:
        return f"skipped: {result['skipped']}"
    return {True: "pass", False: "FAIL", None: "n/a"}[result.get("passed")]


def _tests(results: dict[str, Any]) -> list[str]:
    lines = _table(["passed", "failed", "errors", "skipped"],
                   [[str(results.get(k, "")) for k in ("passed", "failed", "errors", "skipped")]])  # fmt: skip
    return lines + [f"- failed: `{name}`" for name in results.get("failures", [])]


def _exactness(results: dict[str, Any]) -> list[str]:
    rows, probe = [], results.get("probe")
    for key, r in results.items():
        if key == "probe":
            continue
        relative = _num(r.get("relative_change_error"))
        rows.append(
            [key, r.get("backend", ""), _num(r.get("max_abs_diff")), relative, _num(r.get("bound")), _verdict(r)]
        )
    lines = _table(["check", "backend", "max abs diff", "relative change error", "bound", "verdict"], rows)
    if probe:
        backends = probe["backends"]
        names = sorted({k for answer in backends.values() if isinstance(answer, dict) for k in answer})
        cell = {b: (a if isinstance(a, dict) else dict.fromkeys(names, a)) for b, a in backends.items()}
        lines += ["", f"Collectives on 2 ranks sharing the device (chosen: {probe['chosen']}):", ""]
        lines += _table(["collective", *backends], [[n, *(cell[b].get(n, "") for b in backends)] for n in names])
    return lines


def _memory(results: dict[str, Any]) -> list[str]:
    rows = []
    for key, r in results.items():
        rows.append([key, r.get("backend", ""), _num(r.get("psi")), _mib(r.get("constructed_bytes")),
                     _mib(r.get("backward_peak_bytes")), _mib(r.get("allocated_at_step_bytes")),
                     _mib(r.get("optimizer_step_peak_bytes")), _mib(r.get("step_peak_bytes")),
                     _mib(r.get("formula_bytes")), _num(r.get("ratio")), _verdict(r)])  # fmt: skip
    header = ["run", "backend", "Ψ", "after construction (MiB)", "forward+backward peak (MiB)",
              "allocated at step() (MiB)", "optimizer step peak (MiB)", "step peak (MiB)", "formula (MiB)", "ratio",
              "<= 1.1"]  # fmt: skip
    return _table(header, rows) + [
        "",
        "formula: 16Ψ/N + 2 units gathered (bf16) + 3 units' whole gradients (world > 1: the unit in backward, two in "
        "reduction) + activation checkpoints (zeropp.costs.memory); on gloo at world > 1, + gloo's copy of each "
        "reduction's input (two in flight)",
    ]


def _speed(results: dict[str, Any]) -> list[str]:
    model, rows = results.get("model", {}), []
    for key, r in results.items():
        if key == "model":
            continue
        notes = "; ".join(
            f"{k}: {v}" for k, v in r.items() if k not in ("median_step_s", "tokens_per_s", "mfu", "steps_s")
        )
        rows.append([key, _num(r.get("median_step_s"), 1e3), _num(r.get("tokens_per_s"), 1.0, 4),
                     _num(r.get("mfu"), 100.0), notes])  # fmt: skip
    head = f"model: {json.dumps(model)}" if model else ""
    return [head, "", *_table(["variant", "median step (ms)", "tokens/s", "MFU (%)", "notes"], rows)]


def _kernels(results: dict[str, Any]) -> list[str]:
    rows = [["copy", str(mib), "", f"{gbps:,.0f}", "100", ""] for mib, gbps in results.get("copy_gbps", {}).items()]
    rows += [[r["kernel"], str(r["mib"]), f"{1e3 * r['ms']:,.1f}", f"{r['gbps']:,.0f}", f"{r['pct_copy']:.0f}",
              f"{r['speedup']:.1f}x"] for r in results.get("rows", [])]  # fmt: skip
    return _table(["kernel", "MiB", "µs", "GB/s", "% copy", "vs reference"], rows) + [
        f"- {line}" for line in results.get("verdict", [])
    ]


def _offload(results: dict[str, Any]) -> list[str]:
    r = results.get("offload", {})
    medians = r.get("median_step_s", {})
    rows = [[k, _num(v, 1e3)] for k, v in medians.items()]
    model = results.get("model", {})
    lines = [f"model: {json.dumps(model)}", "", *_table(["offload_optimizer", "median step (ms)"], rows)]
    ratios = (f"\nratio cpu / none: {_num(r.get('ratio_offload_to_device'))}; with the step in backward: "
              f"{_num(r.get('ratio_in_backward_to_device'))}")  # fmt: skip
    lines.append(ratios if medians else f"\n{_verdict(r)}")
    return lines


RENDER: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "a": _tests, "b": _exactness, "c": _memory, "d": _speed, "e": _kernels, "f": _offload,
}  # fmt: skip


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [f"# zeropp bench gpu: {env['device']}", "",
             f"torch {env['torch']}, CUDA {env['cuda']}, {env['date']}", "", f"    {env['command']}"]  # fmt: skip
    for stage, record in report["stages"].items():
        lines += ["", f"## {stage}: {record['what']}: {record['status']} ({record['seconds']} s)", ""]
        if record["error"]:
            lines += [f"error: {record['error']}", ""]
        if record["results"]:
            lines += RENDER[stage](record["results"])
    return "\n".join(lines) + "\n"


def summary(report: dict[str, Any]) -> str:
    """One line a stage: its status, seconds and error."""
    lines = [f"zeropp bench gpu on {report['environment']['device']}:"]
    for stage, r in report["stages"].items():
        lines.append(
            f"  {stage} {r['what']}: {r['status']} ({r['seconds']} s){': ' + r['error'] if r['error'] else ''}"
        )
    return "\n".join(lines)
