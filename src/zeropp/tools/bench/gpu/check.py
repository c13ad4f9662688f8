"""``zeropp bench gpu``: the CUDA path in one command (GPU tests, exactness, memory, speed, kernels, offload).

Every stage runs in a process of its own under its own time limit, so a CUDA crash or hang in one is
recorded as that stage's error and the next goes on; ``gpu.json`` (every stage's status, seconds,
numbers and error) and ``gpu.md`` (a table per stage) are rewritten after each stage:

- a: ``pytest -m "gpu or kernels" tests``: passed, failed and skipped counts, the failures' names;
- b: exactness of stage 3, ZeRO++, offload cpu and Pa+cpu against one plain PyTorch process at world 1
  (NCCL), a probe of every collective zeropp uses on 2 ranks sharing the GPU (gloo and nccl), then
  worlds 2 and 4 on the backend that ran them all;
- c: peak allocated memory after construction and during a step, against 1.1 x zeropp.costs.memory's formula;
- d: tokens/s and MFU of a ~1B-parameter bf16 GPT: plain PyTorch, zeropp stage 3, with qwZ+qgZ, FSDP2;
- e: ``zeropp bench kernels`` (the Triton kernels' bandwidth);
- f: step time with and without ``offload_optimizer="cpu"``.

    PYTHONPATH=src python3 -m zeropp.cli bench gpu [--out gpu-results] [--stages a,b,c,d,e,f] [--quick]

Without CUDA it prints one line and exits 0 (``--allow-cpu`` runs every stage on the CPU with tiny sizes).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from zeropp.tools.bench.gpu.report import markdown, summary

STAGES = {
    "a": ("GPU and kernel tests (pytest -m 'gpu or kernels')", 200),
    "b": ("exactness at worlds 1, 2, 4", 150),
    "c": ("memory against the formula", 90),
    "d": ("speed of a ~1B bf16 GPT", 180),
    "e": ("quantization kernel bandwidth", 90),
    "f": ("offload copy overlap", 90),
}  # stage: (what, seconds it may take at most)
BUDGET_S = 460  # the whole run, start-up included, stays under 8 minutes
SRC = Path(__file__).resolve().parents[4]  # the folder holding the zeropp package (src/zeropp/tools/bench/gpu)
TESTS = SRC.parent / "tests"


def environment(device_kind: str, argv: Sequence[str]) -> dict[str, Any]:
    cuda = device_kind == "cuda"
    return {
        "device": torch.cuda.get_device_name(0) if cuda else "CPU (--allow-cpu: tiny sizes)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(["PYTHONPATH=src python3 -m zeropp.cli bench gpu", *argv]),
    }


def run_process(command: list[str], timeout_s: float, log: Path, cwd: Path | None = None) -> tuple[int, str]:
    """Run `command` in a session of its own (a timeout kills it with every process it started, e.g.
    ranks holding the GPU); its output goes to `log`. Returns (exit status, stderr or stdout)."""
    process = subprocess.Popen(command, cwd=cwd, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)  # fmt: skip
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        log.write_text(stdout + stderr)
        raise
    log.write_text(stdout + stderr)
    return process.returncode, stderr.strip() or stdout.strip()


def last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip()[:300] if lines else "no output"


def child_env() -> dict[str, str]:
    """The environment of a stage's process: this checkout's zeropp first on the path."""
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{path}" if path else str(SRC)}


def run_tests(out: Path, quick: bool, timeout_s: float) -> tuple[dict[str, Any], str | None]:
    """Stage a: the tests that need CUDA or run the Triton kernels (``pytest -m "gpu or kernels"``) as a
    process; counts and failures from its junit XML."""
    if not TESTS.is_dir():
        return {}, f"no tests folder at {TESTS}"
    junit = out / "pytest-gpu.xml"
    targets = [str(TESTS / "zero" / "test_cuda.py")] if quick else [str(TESTS)]
    command = [
        sys.executable, "-m", "pytest", "-q", "-m", "gpu or kernels", "-p", "no:cacheprovider", f"--junitxml={junit}",
        *targets,
    ]  # fmt: skip
    junit.unlink(missing_ok=True)
    code, text = run_process(command, timeout_s, out / "pytest-gpu.log", cwd=TESTS.parent)
    if not junit.is_file():
        return {}, f"pytest exited {code} without a report: {last_line(text)}"
    result = junit_counts(junit)
    failed = result["failed"] + result["errors"]
    return result, f"{failed} test(s) failed: {', '.join(result['failures'][:10])}" if failed else None


def junit_counts(path: Path) -> dict[str, Any]:
    """passed, failed, errors, skipped and the failing tests' names of a pytest junit XML file."""
    cases = ET.parse(path).getroot().iter("testcase")
    counts: dict[str, Any] = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": []}
    for case in cases:
        kind = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), None)
        key = {"failure": "failed", "error": "errors", "skipped": "skipped"}.get(kind, "passed")
        counts[key] += 1
        if kind in ("failure", "error"):
            counts["failures"].append(f"{case.get('classname')}::{case.get('name')}")
    return counts


def run_kernels(out: Path, quick: bool, timeout_s: float) -> tuple[dict[str, Any], str | None]:
    """Stage e: zeropp bench kernels as a process; its JSON's rows."""
    sizes = ["1", "16"] if quick else ["1", "16", "64", "256"]
    record = out / "kernels.json"
    command = [sys.executable, "-m", "zeropp.cli", "bench", "kernels", "--sizes", *sizes, "--out", str(record)]
    record.unlink(missing_ok=True)
    code, text = run_process(command, timeout_s, out / "kernels.log")
    if code != 0 or not record.is_file():
        return {}, f"exit {code}: {last_line(text)}"
    data = json.loads(record.read_text())
    return {"copy_gbps": data["copy_gbps"], "rows": data["results"], "verdict": data["verdict"]}, None


def run_measuring(stage: str, out: Path, args: argparse.Namespace, device_kind: str, timeout_s: float,
                  world2: str | None) -> tuple[dict[str, Any], str | None]:  # fmt: skip
    """Stages b, c, d, f: this module's --worker in a process; what it wrote, even when it died."""
    record = out / f"stage-{stage}.json"
    record.unlink(missing_ok=True)
    command = [sys.executable, "-m", "zeropp.tools.bench.gpu.check", "--worker", stage, "--out", str(out),
               "--worker-device", device_kind, "--worker-budget", str(int(timeout_s)), *(["--quick"] if args.quick else []),
               *(["--world2-backend", world2] if world2 else [])]  # fmt: skip
    try:
        code, text = run_process(command, timeout_s, out / f"stage-{stage}.log")
        error = f"exit {code}: {last_line(text)}" if code != 0 else None
    except subprocess.TimeoutExpired:
        error = f"timed out after {timeout_s:.0f} s"
    results = json.loads(record.read_text()) if record.is_file() else {}
    bad = [
        key
        for key, value in results.items()
        if isinstance(value, dict) and ("error" in value or value.get("passed") is False)
    ]
    if bad and error is None:
        error = f"{len(bad)} check(s) failed or errored: {', '.join(bad)}"
    return results, error


def worker(args: argparse.Namespace) -> int:
    """One measuring stage in this process: each result written to stage-X.json as it comes."""
    from zeropp.tools.bench.gpu import measures

    began, limit = time.monotonic(), args.worker_budget

    def budget() -> float:  # seconds a launch may still wait
        return max(10.0, limit - (time.monotonic() - began) - 5)

    sizes = measures.Sizes.pick(args.worker_device, args.quick)
    stage = getattr(measures, f"stage_{args.worker}")
    extra = {"world2_backend": args.world2_backend} if args.worker == "c" else {}
    record, results = args.out / f"stage-{args.worker}.json", {}
    for key, value in stage(args.worker_device, sizes, budget, **extra):
        results[key] = value
        record.write_text(json.dumps(results, indent=1, default=str))
        print(f"{args.worker} {key}: {json.dumps(value, default=str)[:400]}", flush=True)
    return 0


def run_stage(stage: str, out: Path, args: argparse.Namespace, device_kind: str, timeout_s: float,
              world2: str | None) -> dict[str, Any]:  # fmt: skip
    """One stage's record: status, seconds, results, error."""
    began = time.monotonic()
    try:
        if stage == "a":
            results, error = run_tests(out, args.quick, timeout_s)
        elif stage == "e":
            if device_kind != "cuda":
                return {"status": "skipped", "seconds": 0.0, "results": {}, "error": "the kernel timings need CUDA"}
            results, error = run_kernels(out, args.quick, timeout_s)
        else:
            results, error = run_measuring(stage, out, args, device_kind, timeout_s, world2)
    except subprocess.TimeoutExpired:
        results, error = {}, f"timed out after {timeout_s:.0f} s"
    except Exception as exc:  # a stage must not end the run
        results, error = {}, f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    status = "failed" if error else "ok"
    return {"status": status, "seconds": round(time.monotonic() - began, 1), "results": results, "error": error}


def probe_choice(record: dict[str, Any]) -> str | None:
    """The backend stage b's probe found for 2 ranks on the device, if it ran."""
    return record.get("results", {}).get("probe", {}).get("chosen")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zeropp bench gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("gpu-results"), help="folder for gpu.json, gpu.md, logs")
    parser.add_argument("--stages", default=",".join(STAGES), help="comma-separated stages (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="smaller models and fewer sizes")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="seconds for every stage together")
    parser.add_argument("--allow-cpu", action="store_true", help=argparse.SUPPRESS)  # development: stages on the CPU
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-device", help=argparse.SUPPRESS)
    parser.add_argument("--worker-budget", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--world2-backend", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        parser.error(f"--stages {args.stages}: unknown {', '.join(unknown)}; allowed: {', '.join(STAGES)}")
    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        print(f"zeropp bench gpu: CUDA is not available, nothing run; on a GPU it runs stages {','.join(stages)} "
              f"({'; '.join(STAGES[s][0] for s in stages)}) and writes gpu.json and gpu.md to {args.out}")  # fmt: skip
        return 0
    return run_all(stages, args, "cuda" if cuda else "cpu", list(sys.argv[1:] if argv is None else argv))


def run_all(stages: list[str], args: argparse.Namespace, device_kind: str, argv: list[str]) -> int:
    """Every stage in turn within the budget; gpu.json and gpu.md rewritten after each."""
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    report: dict[str, Any] = {"environment": environment(device_kind, argv), "stages": {}}
    for stage in stages:
        left = args.budget_s - (time.monotonic() - began)
        if left < 15:
            record = {"status": "skipped", "seconds": 0.0, "results": {}, "error": "the run's time budget was spent"}
        else:
            print(f"stage {stage}: {STAGES[stage][0]} (at most {min(STAGES[stage][1], left):.0f} s)", flush=True)
            world2 = probe_choice(report["stages"].get("b", {}))
            record = run_stage(stage, out, args, device_kind, min(STAGES[stage][1], left), world2)
        report["stages"][stage] = {"what": STAGES[stage][0], **record}
        (out / "gpu.json").write_text(json.dumps(report, indent=1, default=str))
        (out / "gpu.md").write_text(markdown(report))
        print(f"stage {stage}: {record['status']} in {record['seconds']} s{': ' + record['error'] if record['error'] else ''}",
              flush=True)  # fmt: skip
    print(summary(report))
    print(f"written: {out / 'gpu.json'}, {out / 'gpu.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
