"""What this machine's CPU and libraries support, asked of them rather than assumed: the suite's
header prints it, and tests that need a precision or a kernel skip with the reason where it is missing."""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import shutil
from functools import cache
from pathlib import Path

import torch

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def cpu_model() -> str:
    """The CPU's model name as lscpu prints it (from /proc/cpuinfo; platform's name elsewhere)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def mkldnn_precisions() -> list[str]:
    """The low precisions torch's oneDNN (mkldnn) kernels support on this CPU (none in a build without it)."""
    checks = {"bf16": "_is_mkldnn_bf16_supported", "fp16": "_is_mkldnn_fp16_supported"}
    found = []
    for name, check in checks.items():
        with contextlib.suppress(Exception):
            if getattr(torch.ops.mkldnn, check)():
                found.append(name)
    return found


def compiler_missing() -> str | None:
    """Why nothing here compiles C++ (torch.compile's CPU code, DeepSpeed's CPU ops), None where it can."""
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++", "clang++"]
    if any(shutil.which(name) for name in names):
        return None
    return f"no C++ compiler ({' or '.join(names)}) on this machine"


def deepspeed_cpu_precisions() -> list[str] | None:
    """The precisions DeepSpeed's CPU accelerator trains in here (None: DeepSpeed is not installed).

    DeepSpeed refuses fp16 on a CPU whose oneDNN has no fp16 kernels ("Type fp16 is not supported on
    your device."), e.g. an AMD EPYC with avx512_bf16 but no avx512_fp16 or AMX."""
    logging.disable(logging.WARNING)  # importing DeepSpeed logs "Setting accelerator to CPU"
    try:
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
    except ImportError:
        return None
    finally:
        logging.disable(logging.NOTSET)
    supported = CPU_Accelerator().supported_dtypes()
    return [name for name, dtype in PRECISIONS.items() if dtype in supported]


@cache
def deepspeed_cpu_refuses(precision: str) -> str | None:
    """Why DeepSpeed cannot train in `precision` on this CPU (None: it can). Its CPU accelerator
    compiles a shared-memory op when it starts torch.distributed, so it needs a C++ compiler too."""
    if missing := compiler_missing():
        return f"DeepSpeed compiles its CPU communication op: {missing}"
    supported = deepspeed_cpu_precisions()
    if supported is None or precision in supported:
        return None
    return f"DeepSpeed's CPU accelerator does not support {precision} on this CPU ({cpu_model()}; it supports {', '.join(supported)})"


def report_header() -> list[str]:
    try:
        deepspeed = deepspeed_cpu_precisions()
    except Exception as error:  # a DeepSpeed that does not import beside this torch: say so, run the rest
        deepspeed = [f"unavailable ({type(error).__name__}: {str(error).splitlines()[0][:120]})"]
    return [
        f"cpu: {cpu_model()}, {torch.get_num_threads()} torch threads; oneDNN low precisions: "
        f"{', '.join(mkldnn_precisions()) or 'none'}",
        "deepspeed cpu accelerator: " + (", ".join(deepspeed) if deepspeed is not None else "not installed"),
    ]
