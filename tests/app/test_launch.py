"""zeropp train's launcher: ranks die with it, ports, the environment, what a failed rank says."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_runner import run_cli
from launcher import free_port, rank_pids

LONG_RUN = ("train", "--preset", "tiny", "--steps", "100000", "--nproc-per-node", "2", "--eval-interval", "100000")


def error_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.strip()]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def wait_for_ranks(launcher: subprocess.Popen, n: int, timeout: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ranks = rank_pids(launcher.pid)
        if len(ranks) == n:
            time.sleep(5)  # let them reach training
            return ranks
        time.sleep(0.2)
    launcher.kill()
    raise AssertionError(f"{n} ranks did not start")


def start(*args: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "zeropp.cli", *LONG_RUN, "--master-port", str(free_port()), *args]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def test_ranks_die_with_a_killed_launcher_even_before_it_is_reaped():
    """A launcher SIGKILLed whose parent (a shell, a scheduler) has not waited for it yet is a zombie:
    its pid still answers. The ranks go all the same: their fork server ends once the launcher's end of
    its pipe is closed (no rank may hold a copy), and their watchdog counts a zombie as dead."""
    launcher = start()
    ranks = wait_for_ranks(launcher, 2)
    launcher.kill()  # not reaped until the ranks are checked
    deadline = time.monotonic() + 10
    while any(alive(r) for r in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [r for r in ranks if alive(r)]
    for r in left:
        os.kill(r, signal.SIGKILL)
    launcher.wait()
    assert not left, "ranks outlived their launcher"


def test_a_zombie_is_not_alive():
    from zeropp.app.launch import _alive

    process = subprocess.Popen(["sleep", "60"])
    assert _alive(process.pid)
    process.kill()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline, "the killed process did not exit"
        time.sleep(0.01)
    assert not _alive(process.pid)  # exited, not reaped: its pid still answers a signal
    process.wait()


def test_a_killed_rank_is_named_in_one_line():
    launcher = start()
    ranks = wait_for_ranks(launcher, 2)
    os.kill(max(ranks), signal.SIGKILL)  # torchrun starts local rank 1 second
    _, stderr = launcher.communicate(timeout=60)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert lines == ["zeropp: error: training failed (ChildFailedError): rank 1 died (SIGKILL)"], stderr[-3000:]


def patched(folder: Path, source: str) -> dict[str, str]:
    """An environment in which every Python process of a run, the ranks' fork server too, runs
    `source` as it starts (as ``sitecustomize``, which ``site`` imports)."""
    (folder / "sitecustomize.py").write_text(source)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))}


# rank 1 fails in its training loop with an exception zeropp does not expect, and takes a while to end
# after its peers saw it gone (as a rank writing its traceback or flight record would)
FAILING_RANK = """
import os, time
from zeropp.app import trainer
from zeropp.topology import shutdown

run = trainer.Trainer.run

def failing_run(self, *args, **kwargs):
    if os.environ.get("RANK") == "1":
        shutdown(wait_for_others=False)
        time.sleep(2)
        raise RuntimeError("an unexpected failure")
    return run(self, *args, **kwargs)

trainer.Trainer.run = failing_run
"""


def test_an_unexpected_error_in_a_rank_prints_its_traceback_and_the_launcher_names_that_rank(tmp_path):
    """Neither torchrun's agent, which zeropp keeps quiet, nor rank 0, which lost its peer (exit 3)
    before rank 1 ended, may take the failure's place."""
    result = run_cli(
        "train", "--preset", "tiny", "--steps", "4", "--nproc-per-node", "2", env=patched(tmp_path, FAILING_RANK)
    )
    lines = error_lines(result)
    assert result.returncode == 1 and lines[0] == "Traceback (most recent call last):", result.stderr[-3000:]
    assert lines[-2:] == [
        "RuntimeError: an unexpected failure",
        "zeropp: error: training failed (ChildFailedError): rank 1 exited with 1",
    ], result.stderr[-3000:]


def test_a_busy_port_is_named_with_the_flag_to_change_it():
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run_cli("train", "--preset", "tiny", "--steps", "1", "--master-port", str(port))
    assert result.returncode == 2
    assert error_lines(result) == [
        f"zeropp: error: port {port} is already in use on this machine; choose another with --master-port "
        "(leave it out on one node to pick a free one)"
    ]


def test_one_node_picks_a_free_port_by_default():
    with socket.socket() as busy:  # the former fixed default, taken
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        busy.bind(("", 29511))
        busy.listen()
        result = run_cli("train", "--preset", "tiny", "--steps", "1", "--eval-batches", "1", "--nproc-per-node", "2")
    assert result.returncode == 0, result.stderr[-3000:]


def test_environment_that_contradicts_the_flags_is_refused():
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    cases = [
        ({"RANK": "0", "WORLD_SIZE": "1"}, "the environment sets RANK=0 WORLD_SIZE=1, a rank's variables"),
        ({"RANK": "0"}, "the environment sets RANK=0, a rank's variables"),
        ({"WORLD_SIZE": "abc"}, "the environment sets WORLD_SIZE=abc, a rank's variables"),
        (
            {"TORCHELASTIC_RUN_ID": "x", "RANK": "0"},
            "torchrun's environment lacks WORLD_SIZE, MASTER_ADDR, MASTER_PORT",
        ),
        (
            {
                "TORCHELASTIC_RUN_ID": "x",
                "RANK": "0",
                "WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "1",
            },
            "WORLD_SIZE=1 in the environment contradicts --nproc-per-node 2 x --nnodes 1 = 2 ranks",
        ),
    ]
    for extra, expected in cases:
        result = run_cli("train", "--nproc-per-node", "2", env={**base, **extra})
        lines = error_lines(result)
        assert result.returncode == 2 and len(lines) == 1 and expected in lines[0], (extra, result.stderr[-2000:])


def test_missing_nodes_are_announced_and_given_up_on_after_the_join_timeout():
    port = free_port()
    result = run_cli(
        "train", "--preset", "tiny", "--nnodes", "2", "--nproc-per-node", "1", "--join-timeout-s", "2",
        "--master-port", str(port), timeout=60,
    )  # fmt: skip
    assert result.returncode == 1
    assert error_lines(result) == [
        f"zeropp: waiting up to 2 s for 2 nodes at 127.0.0.1:{port} (this is node 0)",
        f"zeropp: error: not every node of --nnodes 2 joined at 127.0.0.1:{port} within 2 s (--join-timeout-s); "
        "start zeropp train with its --node-rank on each node",
    ]


def test_gloo_pair_closure_and_lost_peers_are_one_line_collective_errors():
    from zeropp.comm.communicator import CollectiveTimeout, PeerLost, Pending

    class Failing:
        def __init__(self, text: str) -> None:
            self.text = text

        def wait(self) -> None:
            raise RuntimeError(self.text)

    cases = [
        ("[pair.cc:598] Application timeout caused pair closure", CollectiveTimeout),
        ("[pair.cc:537] Read error [127.0.0.1]:4264: Connection reset by peer. GLHF!", PeerLost),
    ]
    for text, kind in cases:
        try:
            Pending([Failing(text)]).wait()
        except CollectiveTimeout as error:
            assert type(error) is kind and "\n" not in str(error)
        else:
            raise AssertionError("no error")


# each rank's flight record takes a second to write (a slow disk): time enough for a fork server that a
# group's signal ended to take its ranks along (PR_SET_PDEATHSIG) before they have written it
SLOW_RECORDS = """
import time
from zeropp.comm import trace

write = trace.CollectiveTrace.write

def slow_write(self, reason):
    time.sleep(1)
    return write(self, reason)

trace.CollectiveTrace.write = slow_write
"""


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stopped_run_says_so_once_and_every_rank_writes_its_flight_record(tmp_path, stop):
    """SIGINT: a terminal's Ctrl-C; SIGTERM: a scheduler's (scancel) or ``kill -- -PGID``. Either reaches
    the whole process group, the ranks' fork server too, which must outlive the ranks it forked."""
    records = tmp_path / "flight"
    command = [sys.executable, "-m", "zeropp.cli", *LONG_RUN, "--master-port", str(free_port())]
    metrics = tmp_path / "metrics.jsonl"
    command += ["--flight-record-dir", str(records), "--metrics-jsonl", str(metrics)]
    env = patched(tmp_path, SLOW_RECORDS)
    launcher = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True, env=env
    )
    ranks = wait_for_ranks(launcher, 2)
    deadline = time.monotonic() + 60
    while not (metrics.exists() and metrics.read_text().strip()):  # training: each rank holds its recorder
        assert launcher.poll() is None and time.monotonic() < deadline, "no step was logged"
        time.sleep(0.2)
    os.killpg(launcher.pid, stop)
    # well before torchrun's agent would SIGKILL ranks that ignored the signal it forwards (after 30 s)
    _, stderr = launcher.communicate(timeout=20)
    said, status, allowed = {
        signal.SIGINT: ("zeropp: interrupted", 130, {"SIGINT", "SIGTERM"}),
        signal.SIGTERM: ("zeropp: error: stopped by SIGTERM", 143, {"SIGTERM"}),
    }[stop]
    assert [line for line in stderr.splitlines() if line.strip()] == [said], stderr[-3000:]
    assert launcher.returncode == status and not any(alive(r) for r in ranks)
    reasons = {json.loads(path.read_text())["reason"] for path in records.glob("flight-rank*.json")}
    assert len(list(records.glob("flight-rank*.json"))) == 2 and reasons <= allowed, reasons


def test_a_rank_blocked_in_the_rendezvous_stops_at_its_launchers_signal():
    """The main thread of a rank waiting in C++ for a peer (here: rank 1 never comes) runs no Python
    signal handler: the rank must end at the SIGINT anyway, not at the agent's SIGKILL 30 s later."""
    port = free_port()
    place = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_PORT": str(port)}
    env = {**os.environ, **place, "TORCHELASTIC_RUN_ID": "blocked", "MASTER_ADDR": "127.0.0.1"}
    env["ZEROPP_LAUNCHER_PID"] = str(os.getpid())
    # as a forked rank starts: SIGINT and SIGTERM blocked (the fork server's mask), no other thread
    entry = (
        "import signal; signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM}); "
        "import sys; from zeropp.app.launch import rank_process; from zeropp.cli import main; "
        "rank_process(main, sys.argv[1:])"
    )
    command = [sys.executable, "-c", entry, "train", "--preset", "tiny", "--steps", "10"]
    rank = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not listening(port):  # rank 0 hosts the store and waits there for rank 1
        assert rank.poll() is None and time.monotonic() < deadline, rank.stderr.read()[-2000:]
        time.sleep(0.1)
    time.sleep(1)
    rank.send_signal(signal.SIGINT)
    try:
        _, stderr = rank.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        rank.kill()
        raise AssertionError("the rank ignored SIGINT while blocked in the rendezvous") from None
    assert rank.returncode == -signal.SIGTERM and not stderr.strip(), (rank.returncode, stderr[-2000:])


def listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def test_a_thread_count_the_ranks_libraries_would_refuse_stops_the_launcher():
    """OpenMP reads OMP_NUM_THREADS when torch loads it (its own warning comes first); the launcher
    then refuses to start ranks that would each warn and run on its default."""
    result = run_cli("train", "--nproc-per-node", "2", env={**os.environ, "OMP_NUM_THREADS": "four"})
    ours = [line for line in error_lines(result) if line.startswith("zeropp: error:")]
    assert result.returncode == 2 and ours == [
        "zeropp: error: the environment sets OMP_NUM_THREADS='four'; expected a whole number >= 1 (or unset it)"
    ], result.stderr[-2000:]
