"""``zeropp`` run as a user runs it, its output captured: a process of this Python whose exit status,
stdout and stderr (its ranks' too) are the command's.

The process forks from the tests' forkserver (:func:`launcher.forkserver`), which imported torch and
zeropp once, instead of starting a fresh interpreter: the command's own imports cost about 2 s of CPU
per run on 2 cores. What it runs is what ``python -m zeropp.cli ARGS`` runs: ``main(ARGS)`` with the
given environment and working directory, its file descriptors 1 and 2 on files (so the ranks it
launches write there too), its non-daemon threads joined and at-exit handlers run at its end.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from launcher import forkserver


def _main(args: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = ["zeropp", *args]
    from zeropp.cli import main

    try:
        code = main(args)
    except SystemExit as stop:
        code = stop.code
    except BaseException:  # as the interpreter would: the traceback on stderr, status 1
        import traceback

        traceback.print_exc()
        code = 1
    threading._shutdown()  # as the interpreter ends: its non-daemon threads joined, then the at-exit handlers
    atexit._run_exitfuncs()
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def run_cli(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``zeropp ARGS``, as :func:`subprocess.run` with ``capture_output=True, text=True`` reports it."""
    with tempfile.TemporaryDirectory() as folder:
        out, err = str(Path(folder, "out")), str(Path(folder, "err"))
        environment = dict(os.environ if env is None else env)
        process = forkserver().Process(target=_main, args=(list(args), environment, os.getcwd(), out, err))
        process.start()
        process.join(timeout)
        if process.is_alive():
            process.kill()
            process.join()
            raise subprocess.TimeoutExpired(["zeropp", *args], timeout)
        return subprocess.CompletedProcess(
            ["zeropp", *args], process.exitcode, Path(out).read_text(), Path(err).read_text()
        )
