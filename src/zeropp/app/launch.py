"""``zeropp train``'s launcher side: torchrun's flags, the port, the environment, and what a failure says.

The launcher runs torch.distributed.run in its own process (it is torchrun's agent), and each rank
runs ``zeropp train`` again, recognising itself by torchrun's environment (``TORCHELASTIC_RUN_ID``).
Started by srun or mpirun once per rank instead, ``zeropp train`` is the rank itself (:func:`adopt_task`).
A rank follows its launcher: it dies with it (``PR_SET_PDEATHSIG`` on Linux, and a watchdog thread
that polls the parent pid everywhere), so killing ``zeropp train`` never leaves ranks training.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from zeropp.config.launcher import read_launch_environment
from zeropp.errors import ConfigError
from zeropp.topology import free_port

DEFAULT_PORT = 29511  # several nodes must agree on one port; one node picks a free one
TASK = "ZEROPP_TASK"  # set in a rank that srun or mpirun started (its launcher's name): see adopt_task
LAUNCHER_PID = "ZEROPP_LAUNCHER_PID"  # set by the launcher for its ranks: the process they follow
RANK_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # what a rank needs from its launcher
PR_SET_PDEATHSIG = 1
# How the launcher starts a rank. Ctrl-C reaches every process of the terminal's group, also ranks
# still importing torch, and torchrun's agent forwards the SIGINT it got to the ranks (then waits 30 s
# before SIGKILL). A Python handler runs only when the main thread runs Python: a rank blocked in C++
# (a gloo wait, the store's rendezvous) would hold it until the SIGKILL. So the rank's first line
# blocks SIGINT and SIGTERM in every thread (threads started later inherit it; a forked child gets
# them back) and one thread takes them with sigwait: it runs the stop hooks (the flight record,
# see on_stop) and ends the process by SIGTERM's default action (or, where a library set a Python
# handler for SIGTERM, by os._exit a second later), whatever the main thread is doing.
# The launcher alone says "interrupted".
RANK_ENTRY = """\
import os, signal, sys, threading, time
STOPS = {signal.SIGINT, signal.SIGTERM}
signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)
os.register_at_fork(after_in_child=lambda: signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPS))
def stop():
    name = signal.Signals(signal.sigwait(STOPS)).name
    launch = sys.modules.get("zeropp.app.launch")
    if launch is not None:
        launch.run_stop_hooks(name)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
    time.sleep(1)  # still here: a library set a Python handler for SIGTERM, which the main thread may never run
    os._exit(128 + signal.SIGTERM)
threading.Thread(target=stop, name="zeropp-stop", daemon=True).start()
from zeropp.cli import main
sys.exit(main())
"""
_stop_hooks: list[Callable[[str], object]] = []
PEER_LOST_STATUS = 3  # a rank's exit status when it stopped because another rank was gone: not a cause

# torchrun flag -> (default, type, help); None: decided at launch (see resolve)
LAUNCH_FLAGS: dict[str, tuple[Any, type, str]] = {
    "nproc_per_node": (4, int, "ranks (processes) on this machine"),
    "nnodes": ("1", str, "machines (nodes) taking part; MIN:MAX for an elastic range"),
    "node_rank": (0, int, "this machine's index among the nodes (0 hosts the rendezvous)"),
    "master_addr": ("127.0.0.1", str, "address of node 0, where every node meets"),
    "master_port": (
        None,
        int,
        f"port of the rendezvous on node 0 (default: a free port on one node, {DEFAULT_PORT} on several)",
    ),
    "max_restarts": (0, int, "restart every rank this many times when one fails (resume with --resume auto)"),
    "join_timeout_s": (600, int, "seconds to wait for every node to join before giving up"),
}


def add_launch_flags(parser: argparse.ArgumentParser) -> None:
    launch = parser.add_argument_group("launcher (torchrun's flags; given, they must agree with a rank's environment)")
    for name, (default, kind, text) in LAUNCH_FLAGS.items():
        shown = "" if default is None else f" (default: {default})"
        metavar = "N|MIN:MAX" if name == "nnodes" else kind.__name__.upper()
        launch.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, help=text + shown, metavar=metavar)


def usable_cpus() -> int:
    """The CPUs this process may run on: a cpuset's (taskset, a container's cgroup), not the host's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def is_rank() -> bool:
    """True inside a rank that torchrun started (our launcher, or torchrun by hand), or a task that
    srun or mpirun started as a rank (:func:`adopt_task`)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or TASK in os.environ


def adopt_task(args: argparse.Namespace) -> bool:
    """``zeropp train`` started once per rank by srun or mpirun (no torchrun, no launcher flags): write
    the task's place as torchrun's variables, which the rank then reads as a torchrun rank does, and
    say so (True). With launcher flags, or a world of one task, it launches torchrun as anywhere."""
    if is_rank() or any(getattr(args, name) is not None for name in LAUNCH_FLAGS):
        return False
    found = read_launch_environment(os.environ)  # a contradiction: one line, before anything starts
    if found.launcher in ("none", "torchrun") or found.world_size == 1:
        return False
    values = dict(RANK=found.rank, WORLD_SIZE=found.world_size, LOCAL_RANK=found.local_rank, MASTER_ADDR=found.master_addr,
                  MASTER_PORT=found.master_port, LOCAL_WORLD_SIZE=found.local_world_size, **{TASK: found.launcher})  # fmt: skip
    os.environ.update({name: str(value) for name, value in values.items() if value is not None})
    return True


def resolve(args: argparse.Namespace) -> int:
    """Check the launcher flags and the environment, fill in defaults; return the number of nodes.

    Raises ConfigError (one line) for a bad value, an environment that contradicts the flags, or a
    busy port."""
    given = {name for name in LAUNCH_FLAGS if getattr(args, name) is not None}
    for name, (default, _, _) in LAUNCH_FLAGS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    nodes = _nodes(args.nnodes)
    _check_positive("--nproc-per-node", args.nproc_per_node)
    _check_positive("--join-timeout-s", args.join_timeout_s)
    if not 0 <= args.node_rank < nodes:
        raise ConfigError(f"--node-rank {args.node_rank} is not allowed; expected 0 to {nodes - 1} (--nnodes {nodes})")
    _check_thread_env()
    if is_rank():
        _check_rank_env(args, given, nodes)
    else:
        _check_launcher_env()
        if args.master_port is None and nodes == 1:
            args.master_port = free_port()
        else:
            if args.master_port is None:
                args.master_port = DEFAULT_PORT
            if args.node_rank == 0:  # node 0 hosts the rendezvous on it
                _check_port_free(args.master_port)
    return nodes


def _nodes(nnodes: str) -> int:
    try:
        low, _, high = nnodes.partition(":")
        values = [int(low)] + ([int(high)] if high else [])
    except ValueError:
        values = [0]
    if min(values) < 1 or values != sorted(values):
        raise ConfigError(f"--nnodes {nnodes} is not allowed; expected an integer >= 1 or MIN:MAX (1 <= MIN <= MAX)")
    return values[-1]


def _check_positive(flag: str, value: int) -> None:
    if value < 1:
        raise ConfigError(f"{flag} {value} is not allowed; expected an integer >= 1")


THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # read by every rank's OpenMP / MKL at start


def _check_thread_env() -> None:
    """Thread counts the ranks' libraries would warn about or ignore, refused before any process starts."""
    for name in THREAD_ENV:
        value = os.environ.get(name)
        if value is not None and not (value.strip().isdigit() and int(value) >= 1):
            raise ConfigError(f"the environment sets {name}={value!r}; expected a whole number >= 1 (or unset it)")


def _check_launcher_env() -> None:
    """A launcher must not inherit a rank's variables: the ranks would read the stale ones."""
    stale = [name for name in RANK_ENV + ("LOCAL_RANK", "LOCAL_WORLD_SIZE") if name in os.environ]
    if stale:
        shown = " ".join(f"{name}={os.environ[name]}" for name in stale)
        raise ConfigError(
            f"the environment sets {shown}, a rank's variables, outside a torchrun rank; "
            f"unset {' '.join(stale)} to launch with zeropp train, or start the ranks with torchrun"
        )


def _check_rank_env(args: argparse.Namespace, given: set[str], nodes: int) -> None:
    missing = [name for name in RANK_ENV if name not in os.environ]
    if missing:
        raise ConfigError(f"torchrun's environment lacks {', '.join(missing)}; expected all of {', '.join(RANK_ENV)}")
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except ValueError:
        shown = f"RANK={os.environ['RANK']} WORLD_SIZE={os.environ['WORLD_SIZE']}"
        raise ConfigError(f"{shown} is not allowed; expected integers with 0 <= RANK < WORLD_SIZE") from None
    if not 0 <= rank < world:
        raise ConfigError(f"RANK={rank} WORLD_SIZE={world} is not allowed; expected 0 <= RANK < WORLD_SIZE")
    asked = args.nproc_per_node * nodes
    if given & {"nproc_per_node", "nnodes"} and ":" not in args.nnodes and asked != world:
        raise ConfigError(
            f"WORLD_SIZE={world} in the environment contradicts --nproc-per-node {args.nproc_per_node} x "
            f"--nnodes {args.nnodes} = {asked} ranks; unset RANK and WORLD_SIZE to launch, or drop the flags"
        )


def _check_port_free(port: int) -> None:
    if not 0 < port < 65536:
        raise ConfigError(f"--master-port {port} is not allowed; expected 1 to 65535")
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError as error:
            if error.errno != errno.EADDRINUSE:
                raise ConfigError(f"--master-port {port} cannot be used here: {error.strerror}") from None
            raise ConfigError(
                f"port {port} is already in use on this machine; choose another with --master-port "
                f"(leave it out on one node to pick a free one)"
            ) from None


def describe_failure(error: BaseException, args: argparse.Namespace) -> str:
    """One line for the launcher: which ranks failed and how (torchrun's ChildFailedError), or the error."""
    from torch.distributed.elastic.rendezvous import RendezvousTimeoutError

    if isinstance(error, RendezvousTimeoutError):
        return (
            f"not every node of --nnodes {args.nnodes} joined at {args.master_addr}:{args.master_port} within "
            f"{args.join_timeout_s} s (--join-timeout-s); start zeropp train with its --node-rank on each node"
        )
    failures = getattr(error, "failures", None)
    if not failures:
        return f"training failed: {type(error).__name__}"
    # ranks that stopped because another one failed (SIGTERM from the agent, a lost peer) are not the cause
    consequences = (-signal.SIGTERM, PEER_LOST_STATUS)
    causes = {r: f for r, f in failures.items() if f.exitcode not in consequences} or failures
    parts = []
    for rank, failure in sorted(causes.items(), key=lambda item: (item[1].timestamp, item[0])):
        code = failure.exitcode
        parts.append(f"rank {rank} died ({failure.signal_name()})" if code < 0 else f"rank {rank} exited with {code}")
    return f"training failed ({type(error).__name__}): " + "; ".join(parts)


def follow_launcher() -> None:
    """In a rank: die when the process that started it (torchrun's agent) dies."""
    parent = int(os.environ.get(LAUNCHER_PID, os.getppid()))
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the launcher died before prctl took effect
        os._exit(1)
    threading.Thread(target=_watch, args=(parent,), name="zeropp-launcher-watchdog", daemon=True).start()


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGKILL)


def quiet_torchrun() -> None:
    """Silence torchrun's own warnings about failures and signals: the launcher says them once.

    Each of its modules' loggers has a level of its own (torch.distributed.elastic.utils.logging)."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL if ".multiprocessing" in name else logging.ERROR)


def waiting_note(args: argparse.Namespace, nodes: int) -> str | None:
    """What the launcher says before a rendezvous that waits for other machines."""
    if nodes == 1:
        return None
    return (
        f"zeropp: waiting up to {args.join_timeout_s} s for {nodes} nodes at {args.master_addr}:{args.master_port} "
        f"(this is node {args.node_rank})"
    )


def on_stop(hook: Callable[[str], object]) -> None:
    """Run ``hook(signal name)`` when the launcher stops this rank (SIGINT or SIGTERM), before it ends."""
    _stop_hooks.append(hook)


def run_stop_hooks(name: str) -> None:
    """Called by the stopping thread of :data:`RANK_ENTRY`; a hook's failure never keeps the rank alive."""
    for hook in _stop_hooks:
        try:
            hook(name)
        except Exception:  # noqa: BLE001 - the rank is ending: a courtesy must not stop that
            pass
