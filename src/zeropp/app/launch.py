"""``zeropp train``'s launcher side: torchrun's flags, the port, the environment, and what a failure says.

The launcher runs torchrun's agent in its own process (torch.distributed's ``elastic_launch``), and
each rank, forked from a server that imported zeropp once (:func:`rank_process`), runs ``zeropp train``
again, recognising itself by torchrun's environment (``TORCHELASTIC_RUN_ID``): See [Note: forked
ranks] (docs/design.md).
Started by srun or mpirun once per rank instead, ``zeropp train`` is the rank itself (:func:`adopt_task`).
A rank follows its launcher: it dies with it (``PR_SET_PDEATHSIG`` on Linux, and a watchdog thread
that polls its parent and the launcher everywhere), so killing ``zeropp train`` never leaves ranks training.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import logging
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zeropp.config.launcher import read_launch_environment
from zeropp.errors import ConfigError
from zeropp.topology import free_port

DEFAULT_PORT = 29511  # several nodes must agree on one port; one node picks a free one
TASK = "ZEROPP_TASK"  # set in a rank that srun or mpirun started (its launcher's name): see adopt_task
LAUNCHER_PID = "ZEROPP_LAUNCHER_PID"  # set by the launcher for its ranks: the process they follow
RANK_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # what a rank needs from its launcher
PR_SET_PDEATHSIG = 1
# What the ranks' fork server imports once: the CLI (torch and zeropp with it), and torch._dynamo,
# which building a model on the meta device imports (0.5 s of CPU a rank). None touches a device.
RANK_PRELOAD = ["zeropp.cli", "torch._dynamo"]
STOPS = {signal.SIGINT, signal.SIGTERM}  # how a launcher (or a terminal, a scheduler) stops the ranks
PEER_LOST_STATUS = 3  # a rank's exit status when it stopped because another rank was gone: not a cause
LINGER_S = 10.0  # how long such a rank waits for its launcher to stop it (See [Note: forked ranks])
_stop_hooks: list[Callable[[str], object]] = []
# A forked rank runs the launcher's main module again as __mp_main__ (multiprocessing's preparation):
# under ``python -m zeropp.cli`` runpy warns that the server imported it already, which tells a user nothing.
warnings.filterwarnings("ignore", r"'zeropp\.cli' found in sys\.modules", RuntimeWarning)


def start_rank_server() -> None:
    """Start the fork server of this launcher's ranks (torchrun's agent forks them from it), its
    SIGINT and SIGTERM blocked for good: See [Note: forked ranks] (docs/design.md)."""
    multiprocessing.forkserver.set_forkserver_preload(RANK_PRELOAD)
    multiprocessing.resource_tracker.ensure_running()  # first: starting it unblocks both signals here
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)  # a new process keeps its creator's mask
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def rank_process(main: Callable[[list[str]], int], argv: list[str]) -> None:
    """A rank of ``zeropp train`` as torchrun's agent starts it, forked from the launcher's server: `main`
    (the CLI's) on ARGV, the process's exit status its own. See [Note: forked ranks] (docs/design.md)."""
    # The server ends once its "alive" pipe has no writer: each child inherits the launcher's end,
    # which must stay the launcher's alone (a rank holding it would keep the server, and so itself, alive).
    server = multiprocessing.forkserver._forkserver
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
    signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)  # blocked already where the server forked it
    os.register_at_fork(after_in_child=lambda: signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPS))
    threading.Thread(target=_stop_on_signal, name="zeropp-stop", daemon=True).start()
    sys.stdout.reconfigure(line_buffering=True)  # as ``python -u`` would write it (stderr is line-buffered)
    try:
        status = main(argv)
    except Exception:  # what an interpreter would print: torchrun's agent only logs it
        traceback.print_exc()
        status = 1
    if status == PEER_LOST_STATUS:  # a consequence: let the launcher see the cause first
        _stop_hooks.clear()  # the flight record says why already
        time.sleep(LINGER_S)
    sys.exit(status)  # not os._exit: torchrun's agent waits for a rank's return value


def _stop_on_signal() -> None:
    """A rank's stopping thread. Ctrl-C reaches every process of the terminal's group, and torchrun's
    agent forwards the SIGINT it got to the ranks (then waits 30 s before SIGKILL). A Python handler
    runs only when the main thread runs Python: a rank blocked in C++ (a gloo wait, the store's
    rendezvous) would hold it until the SIGKILL. So SIGINT and SIGTERM stay blocked in every thread
    of a rank (threads started later inherit it; a forked child gets them back) and this thread takes
    them with sigwait: it runs the stop hooks (the flight record, see on_stop) and ends the process by
    SIGTERM's default action (or, where a library set a Python handler for SIGTERM, by os._exit a
    second later), whatever the main thread is doing. The launcher alone says "interrupted"."""
    name = signal.Signals(signal.sigwait(STOPS)).name
    _run_stop_hooks(name)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
    time.sleep(1)  # still here: a library set a Python handler for SIGTERM, which the main thread may never run
    os._exit(128 + signal.SIGTERM)


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
    """In a rank: die when its launcher dies. A forked rank's parent is the launcher's fork server,
    which ends with the launcher; a rank that torchrun by hand, srun or mpirun started has it as parent."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    launcher = int(os.environ.get(LAUNCHER_PID, parent))
    if os.getppid() != parent or not _alive(launcher):  # gone before prctl took effect
        os._exit(1)
    threading.Thread(target=_watch, args=(parent, launcher), name="zeropp-launcher-watchdog", daemon=True).start()


def _watch(parent: int, launcher: int) -> None:
    while os.getppid() == parent and _alive(launcher):
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Whether process `pid` runs: not gone, nor (where /proc tells) a zombie, which has exited and
    waits for its parent to reap it (a launcher SIGKILLed under a shell or a test that did not wait)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        pass
    with contextlib.suppress(OSError):  # no /proc here (or gone since: the next look says so)
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return True


def quiet_torchrun() -> None:
    """Silence torchrun's own warnings about failures and signals: the launcher says them once.

    Each of its modules' loggers has a level of its own (torch.distributed.elastic.utils.logging)."""
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)  # "Terminating process ..."
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


def _run_stop_hooks(name: str) -> None:
    """Called by the stopping thread of a rank; a hook's failure never keeps the rank alive."""
    for hook in _stop_hooks:
        try:
            hook(name)
        except Exception:  # noqa: BLE001 - the rank is ending: a courtesy must not stop that
            pass
