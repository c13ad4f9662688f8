"""Test tiers, marked automatically (``-m unit`` is the fast lane).

- ``unit``: starts no process and no subprocess (enforced: a unit test that starts one fails);
- ``distributed``: forks ranks (``launcher.run_ranks``);
- ``cli``: runs a command as a subprocess (``cli_runner.run_cli``, ``subprocess`` directly, ``ip``);
- ``cluster``: needs root and network namespaces (marked by hand; skipped without them);
- ``gpu``: needs CUDA (marked by hand; skipped without it);
- ``kernels``: runs the Triton kernels (marked by hand): unit under the interpreter, not on a GPU, where
  compiling them starts the compiler's processes.

A test's tier is read from the names its code uses: its own body, the module's functions it calls
and the fixtures it takes, transitively.
"""

from __future__ import annotations

import inspect
import multiprocessing.process
import os
import shutil
import subprocess
import types

import pytest
import torch
from machine import report_header

DISTRIBUTED_NAMES = frozenset({"run_ranks"})
CLI_NAMES = frozenset({"run_cli", "run_example", "subprocess", "Popen"})  # run_example: tests/examples.py
PROCESS_TIERS = ("distributed", "cli", "cluster", "gpu")


def _names(code: types.CodeType) -> set[str]:
    names = set(code.co_names) | set(code.co_freevars)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _reached_names(item: pytest.Function) -> set[str]:
    """Every global name the test's code reaches through module functions and its fixtures."""
    module = item.module
    todo = [item.function]
    for name in item.fixturenames:
        for definition in item._fixtureinfo.name2fixturedefs.get(name, ()):
            if definition.func.__module__ != __name__:  # this file's own guard starts nothing
                todo.append(definition.func)
    seen: set[int] = set()
    names: set[str] = set()
    while todo:
        fn = inspect.unwrap(todo.pop())
        code = getattr(fn, "__code__", None)
        if code is None or id(code) in seen:
            continue
        seen.add(id(code))
        found = _names(code)
        names |= found
        for name in found:
            value = getattr(module, name, None)
            if inspect.isfunction(value) and value.__module__ == module.__name__:
                todo.append(value)
    return names


def _namespaces_unavailable() -> str | None:
    """Why the emulated cluster cannot run here (None: it can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth, tc)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "`ip netns` is unavailable here"
    return None


def pytest_report_header(config: pytest.Config) -> list[str]:
    """The machine a run ran on, so that a failing run says which CPU and what it supports."""
    return report_header()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    no_cuda = pytest.mark.skip(reason="needs a CUDA device")
    netns = _namespaces_unavailable() if any(item.get_closest_marker("cluster") for item in items) else None
    for item in items:
        if not isinstance(item, pytest.Function):
            continue
        names = _reached_names(item)
        if names & DISTRIBUTED_NAMES:
            item.add_marker(pytest.mark.distributed)
        if names & CLI_NAMES:
            item.add_marker(pytest.mark.cli)
        compiles = item.get_closest_marker("kernels") and torch.cuda.is_available()  # Triton runs ptxas, ldconfig
        if not compiles and not any(item.get_closest_marker(tier) for tier in PROCESS_TIERS):
            item.add_marker(pytest.mark.unit)
        if item.get_closest_marker("gpu") and not torch.cuda.is_available():
            item.add_marker(no_cuda)
        if item.get_closest_marker("cluster") and netns:
            item.add_marker(pytest.mark.skip(reason=netns))


def _refuse(*args, **kwargs):
    raise AssertionError("a unit test started a process: it belongs to the distributed or cli tier")


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("unit"):
        monkeypatch.setattr(subprocess.Popen, "_execute_child", _refuse)
        monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _refuse)


@pytest.fixture
def small_disk(tmp_path):
    """``small_disk(size)`` mounts a tmpfs of `size` (``"2m"``) under tmp_path and returns its folder,
    unmounted after the test (root only; the test is skipped where it cannot mount)."""
    mounted = []

    def mount(size: str):
        if os.geteuid() != 0:
            pytest.skip("mounts a tmpfs: root only")
        disk = tmp_path / f"disk-{len(mounted)}"
        disk.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)]).returncode:
            pytest.skip("cannot mount a tmpfs here")
        mounted.append(disk)
        return disk

    yield mount
    for disk in mounted:
        subprocess.run(["umount", str(disk)])
