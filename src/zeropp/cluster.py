"""Command line and API: ``zeropp cluster``, an emulated multi-node cluster with slow inter-node links.

Each node is a Linux network namespace of its own with a hostname of its own; the nodes are joined
by veth links (two nodes: one veth pair; more: one veth per node into a bridge in a hub namespace),
and every inter-node link is shaped in both directions with ``tc ... tbf`` to the given bandwidth.
Inside each node runs a real multi-node launch, ``zeropp train --nnodes N --node-rank i
--nproc-per-node P --master-addr <node 0> --master-port ...`` (torchrun's c10d rendezvous; gloo
pinned to the node's veth by ``GLOO_SOCKET_IFNAME``), so every inter-node byte of the job crosses a
real (virtual) wire. The bytes each node put on the wire are read from the interface counters
(``/sys/class/net/<dev>/statistics/tx_bytes``, inside the namespace) before and after, and set
beside the ledger's inter-node figures from the run summary (:func:`compare_to_ledger`).

Everything created is removed afterwards, on success, failure, exception, SIGINT, SIGTERM or
SIGHUP: the process groups started, whatever still runs in the namespaces, the namespaces (and
with them their veths and the bridge) and their ``/etc/netns/<name>`` files. Needs root and
``ip netns``; ``tc`` (with the ``tbf`` qdisc) unless the links are unshaped.

    zeropp cluster run --nodes 2 --nproc-per-node 2 --inter-node-bandwidth 200mbit -- --preset tiny --steps 20
    zeropp cluster probe --inter-node-bandwidth 200mbit     # TCP throughput of one shaped link
    zeropp cluster cleanup                                  # leftovers of runs that were SIGKILLed

In code: ``run_cluster(2, 2, "200mbit", ["--preset", "tiny"])`` returns a :class:`ClusterResult`.
See docs/cluster.md.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

MAX_NODES = 250  # one /24: node i is 10.77.0.(i+1)
SUBNET = "10.77.0"
MASTER_PORT = 29500  # every node has a network namespace of its own: any port is free there
MARKER_ENV = "ZEROPP_CLUSTER_RUN"  # set in every process the cluster starts (cleanup finds strays by it)
LAUNCH_FLAGS = ("--nnodes", "--node-rank", "--nproc-per-node", "--master-addr", "--master-port")
TORCHRUN_ENV = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "GLOO_SOCKET_IFNAME",
)  # fmt: skip
RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
RATE_UNITS |= {"bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12}  # tc's bytes per second
TBF_LATENCY = "50ms"  # longest a packet may wait in the shaper's queue before it is dropped
NAME_RE = re.compile(r"^zpp(\d+)-(\d+)-(?:n\d+|hub)$")

# Runs in the node's namespace (after `ip netns exec`): a UTS namespace of its own, so the node has a
# hostname of its own, which /etc/netns/<ns>/hosts (bind-mounted over /etc/hosts by `ip netns exec`)
# resolves to the node's veth address, as on a real cluster; then exec the node's command. torchrun's
# c10d rendezvous needs it: node 0 hosts the store only if the endpoint address is one of its
# hostname's addresses, and the rendezvous publishes node 0's hostname as the ranks' MASTER_ADDR.
_ENTER_NODE = (
    "import ctypes, os, socket, sys\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "if libc.unshare(0x04000000) != 0:\n"  # CLONE_NEWUTS
    "    sys.exit('zeropp cluster: unshare(CLONE_NEWUTS): ' + os.strerror(ctypes.get_errno()))\n"
    "socket.sethostname(sys.argv[1])\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)

_run_counter = itertools.count()


class ClusterError(RuntimeError):
    """A refusal or a failure to build the cluster, in one line. `code` is the CLI's exit status."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


class ClusterInterrupted(BaseException):
    """SIGTERM or SIGHUP arrived during a run (SIGINT raises KeyboardInterrupt); cleanup has run."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


# -- bandwidth ------------------------------------------------------------------------------------


def parse_bandwidth(text: str | float | None) -> float | None:
    """Bits per second from tc's rate syntax ('200mbit', '10gbit', '25mbps' = bytes/s, or a bare
    number of bits/s); None for 'none' / 'unlimited' / None (links left unshaped)."""
    if text is None:
        return None
    if isinstance(text, (int, float)):
        bps = float(text)
    else:
        word = text.strip().lower()
        if word in ("none", "unlimited", "off", "0"):
            return None
        match = re.fullmatch(r"(\d+(?:\.\d*)?(?:e[+-]?\d+)?)\s*([a-z]*)", word)
        if not match or (match[2] or "bit") not in RATE_UNITS:
            raise ClusterError(
                f"zeropp cluster: error: bandwidth {text!r} is not allowed; expected a rate with tc's units "
                "(bit, kbit, mbit, gbit, tbit; bps, kbps, mbps, gbps for bytes/s), e.g. 200mbit, or 'none'"
            )
        bps = float(match[1]) * RATE_UNITS[match[2] or "bit"]
    if not math.isfinite(bps) or bps < 8000:
        raise ClusterError(f"zeropp cluster: error: bandwidth {text!r} is not allowed; expected at least 8kbit")
    return bps


def format_rate(bps: float | None) -> str:
    if bps is None:
        return "unshaped"
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.4g} {unit}"
    return f"{bps:.0f} bit/s"


def tbf_args(bps: float) -> list[str]:
    """`tc qdisc add ... root tbf` arguments for a rate of `bps`: the bucket holds 4 ms at the rate
    (at least 64 KiB, so one 64 KiB GSO packet passes whole), packets wait at most TBF_LATENCY."""
    burst = max(64 * 1024, int(bps / 8 * 0.004))
    return ["tbf", "rate", f"{int(bps)}bit", "burst", str(burst), "latency", TBF_LATENCY]


# -- preconditions --------------------------------------------------------------------------------


def check_privileges(shaped: bool = True) -> None:
    """Refuse, before anything is created, where the cluster cannot be built."""
    if os.geteuid() != 0:
        raise ClusterError(
            "zeropp cluster: error: needs root (network namespaces, veth links and tc qdiscs need CAP_NET_ADMIN); "
            "run it as root"
        )
    if shutil.which("ip") is None:
        raise ClusterError("zeropp cluster: error: `ip netns` is unavailable: the `ip` command (iproute2) is missing")
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        reason = (probe.stderr.strip().splitlines() or ["no reason given"])[-1]
        raise ClusterError(f"zeropp cluster: error: `ip netns` is unavailable: {reason}")
    if shaped and shutil.which("tc") is None:
        raise ClusterError(
            "zeropp cluster: error: `tc` (iproute2) is missing; it shapes the links "
            "(use --inter-node-bandwidth none for unshaped links)"
        )


def _ip(*args: str) -> None:
    """Run an iproute2 command; raise ClusterError (exit status 1) with its message if it fails."""
    result = subprocess.run(list(args), capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if result.returncode != 0:
        reason = (result.stderr.strip() or result.stdout.strip() or f"exit status {result.returncode}").splitlines()
        raise ClusterError(f"zeropp cluster: error: `{' '.join(args)}` failed: {reason[-1]}", code=1)


def list_netns() -> list[str]:
    result = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return [line.split()[0] for line in result.stdout.splitlines() if line.strip()]


def netns_pids(namespace: str) -> list[int]:
    result = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    return [int(p) for p in result.stdout.split() if p.isdigit()]


def marked_pids(marker: str) -> list[int]:
    """Processes whose environment carries MARKER_ENV=marker (what this run started, wherever it is now)."""
    needle = f"{MARKER_ENV}={marker}".encode() + b"\0"
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read() + b"\0":
                    found.append(int(entry))
        except OSError:
            continue
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):  # a zombie is gone for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    return True


def _kill(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _wait_gone(pids: Sequence[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    left = [p for p in pids if _alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if _alive(p)]
    return left


# -- the network ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Node:
    index: int
    namespace: str
    hostname: str
    device: str  # the node's end of its inter-node link (GLOO_SOCKET_IFNAME)
    address: str
    hub_port: str | None = None  # the bridge's end of it (more than 2 nodes)


@dataclass
class Counters:
    tx_bytes: int
    rx_bytes: int
    tx_packets: int
    rx_packets: int
    retrans_segs: int  # TCP segments the node retransmitted (the namespace's /proc/net/snmp)


class EmulatedCluster:
    """Network namespaces joined by (shaped) veth links, and the processes started in them.

    A context manager: entering builds the network, leaving (however it is left) removes
    everything, processes first. While inside, SIGTERM and SIGHUP raise ClusterInterrupted in the
    main thread (SIGINT raises KeyboardInterrupt) so that leaving runs.
    """

    def __init__(self, nodes: int, bandwidth_bps: float | None, *, prefix: str | None = None) -> None:
        if not 2 <= nodes <= MAX_NODES:
            raise ClusterError(f"zeropp cluster: error: --nodes {nodes} is not allowed; expected 2 to {MAX_NODES}")
        self.bandwidth_bps = bandwidth_bps
        self.prefix = prefix or f"zpp{os.getpid()}-{next(_run_counter)}"
        width = len(str(nodes - 1))
        bridged = nodes > 2
        self.nodes = [
            Node(
                index=i,
                namespace=f"{self.prefix}-n{i}",
                # c10d ranks the nodes by hostname: zero-padded, node i gets ranks i*P .. i*P+P-1
                hostname=f"{self.prefix}-node{i:0{width}d}",
                device=f"veth{i}",
                address=f"{SUBNET}.{i + 1}",
                hub_port=f"port{i}" if bridged else None,
            )
            for i in range(nodes)
        ]
        self.hub = f"{self.prefix}-hub" if bridged else None
        self._namespaces: list[str] = []  # created (or being created), in order
        self._procs: list[subprocess.Popen] = []
        self._old_handlers: dict[int, Any] = {}
        self._entered = False

    # -- lifecycle --------------------------------------------------------------------------------

    def __enter__(self) -> EmulatedCluster:
        check_privileges(shaped=self.bandwidth_bps is not None)
        self._install_signal_handlers()
        self._entered = True
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def interrupt(signum: int, frame: object) -> None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise ClusterInterrupted(signum)

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, interrupt)

    def close(self) -> None:
        """Remove everything this cluster made; idempotent; signals are held off until it is done."""
        if not self._entered:
            return
        main = threading.current_thread() is threading.main_thread()
        if main:
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, signal.SIG_IGN)
        try:
            self._stop_processes()
            for namespace in reversed(self._namespaces):
                subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
                shutil.rmtree(Path("/etc/netns") / namespace, ignore_errors=True)
            self._namespaces = []
        finally:
            self._entered = False
            if main:
                for sig, handler in self._old_handlers.items():
                    signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
                self._old_handlers = {}

    def _stop_processes(self, grace_s: float = 10.0) -> None:
        running = [p for p in self._procs if p.poll() is None]
        for proc in running:  # torchrun's agent stops its workers on SIGTERM
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        for proc in running:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        # whatever is left: workers in sessions of their own, orphans of a killed agent
        strays = sorted({p for ns in self._namespaces for p in netns_pids(ns)} | set(marked_pids(self.prefix)))
        _kill(strays, signal.SIGKILL)
        _wait_gone(strays, 10.0)

    # -- network ----------------------------------------------------------------------------------

    def _add_namespace(self, name: str) -> None:
        self._namespaces.append(name)  # tracked before it exists: a signal in between still cleans it
        _ip("ip", "netns", "add", name)

    def _build(self) -> None:
        existing = set(list_netns())
        clash = [n for n in [*(x.namespace for x in self.nodes), self.hub] if n and n in existing]
        if clash:
            raise ClusterError(
                f"zeropp cluster: error: network namespace {clash[0]} exists already "
                "(left by a killed run? `zeropp cluster cleanup` removes those of dead runs)",
                code=1,
            )
        for node in self.nodes:
            self._add_namespace(node.namespace)
            lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
            lines += [f"{n.address} {n.hostname}" for n in self.nodes]
            try:  # `ip netns exec` bind-mounts /etc/netns/<ns>/hosts over /etc/hosts
                folder = Path("/etc/netns") / node.namespace
                folder.mkdir(parents=True, exist_ok=True)
                (folder / "hosts").write_text("\n".join(lines) + "\n")
            except OSError as error:
                raise ClusterError(
                    f"zeropp cluster: error: cannot write /etc/netns/{node.namespace}/hosts: {error}", 1
                ) from None
        if self.hub is None:
            a, b = self.nodes
            _ip("ip", "link", "add", a.device, "netns", a.namespace, "type", "veth",
                "peer", "name", b.device, "netns", b.namespace)  # fmt: skip
        else:
            self._add_namespace(self.hub)
            _ip("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
            for node in self.nodes:
                assert node.hub_port is not None
                _ip("ip", "link", "add", node.device, "netns", node.namespace, "type", "veth",
                    "peer", "name", node.hub_port, "netns", self.hub)  # fmt: skip
                _ip("ip", "-n", self.hub, "link", "set", node.hub_port, "master", "br0")
            _disable_ipv6(self.hub)
            for node in self.nodes:
                assert node.hub_port is not None
                _ip("ip", "-n", self.hub, "link", "set", node.hub_port, "up")
            _ip("ip", "-n", self.hub, "link", "set", "br0", "up")
        for node in self.nodes:
            _disable_ipv6(node.namespace)  # no router solicitations or MLD reports on the counted wire
            _ip("ip", "-n", node.namespace, "addr", "add", f"{node.address}/24", "dev", node.device)
            _ip("ip", "-n", node.namespace, "link", "set", "lo", "up")
            _ip("ip", "-n", node.namespace, "link", "set", node.device, "up")
        if self.bandwidth_bps is not None:
            for namespace, device in self.shaped_devices():
                _ip("tc", "-n", namespace, "qdisc", "add", "dev", device, "root", *tbf_args(self.bandwidth_bps))

    def shaped_devices(self) -> list[tuple[str, str]]:
        """(namespace, device) of every link end: each node's egress, and the hub's egress to each node."""
        ends = [(n.namespace, n.device) for n in self.nodes]
        if self.hub is not None:
            ends += [(self.hub, n.hub_port) for n in self.nodes if n.hub_port]
        return ends

    def link_names(self) -> list[str]:
        """Per node, the name of its outgoing link: 'node0->node1' (a pair) or 'node0->switch'."""
        if self.hub is None:
            return ["node0->node1", "node1->node0"]
        return [f"node{n.index}->switch" for n in self.nodes]

    def counters(self) -> list[Counters]:
        """Each node's interface counters (read inside its namespace) and its TCP retransmissions."""
        out = []
        for node in self.nodes:
            stats = f"/sys/class/net/{node.device}/statistics"
            files = [f"{stats}/{name}" for name in ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets")]
            result = subprocess.run(
                ["ip", "netns", "exec", node.namespace, "cat", *files, "/proc/net/snmp"],
                capture_output=True,
                text=True,
            )
            if result.returncode != 0:
                raise ClusterError(f"zeropp cluster: error: reading {node.namespace}'s counters: {result.stderr}", 1)
            lines = result.stdout.splitlines()
            tcp = [line.split() for line in lines[4:] if line.startswith("Tcp:")]
            retrans = int(tcp[1][tcp[0].index("RetransSegs")]) if len(tcp) >= 2 else 0
            out.append(Counters(*(int(v) for v in lines[:4]), retrans_segs=retrans))
        return out

    def qdisc_drops(self) -> int:
        """Packets the shapers dropped (queue longer than TBF_LATENCY), over all link ends."""
        dropped = 0
        for namespace, device in self.shaped_devices():
            result = subprocess.run(["tc", "-n", namespace, "-s", "qdisc", "show", "dev", device], capture_output=True)
            dropped += sum(int(m) for m in re.findall(rb"dropped (\d+)", result.stdout))
        return dropped

    # -- processes --------------------------------------------------------------------------------

    def start(self, node: Node, argv: Sequence[str], env: dict[str, str], cwd: str | None = None) -> subprocess.Popen:
        """Start `argv` in `node` (its namespace and hostname), in a process group of its own,
        stdout and stderr together on one pipe."""
        env = {k: v for k, v in env.items() if k not in TORCHRUN_ENV}
        env.update({MARKER_ENV: self.prefix, "GLOO_SOCKET_IFNAME": node.device, "PYTHONUNBUFFERED": "1"})
        command = ["ip", "netns", "exec", node.namespace, sys.executable, "-c", _ENTER_NODE, node.hostname, *argv]
        proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )
        self._procs.append(proc)
        return proc


def _disable_ipv6(namespace: str) -> None:
    subprocess.run(
        ["ip", "netns", "exec", namespace, "sh", "-c",
         "for f in /proc/sys/net/ipv6/conf/*/disable_ipv6; do echo 1 > $f; done 2>/dev/null; true"],
        capture_output=True,
    )  # fmt: skip


# -- output ---------------------------------------------------------------------------------------


class _Pump(threading.Thread):
    """Copies a node's output to its log file (and optionally to a stream), keeping the tail."""

    def __init__(self, source: IO[bytes], log: Path, echo: IO[str] | None, tail_lines: int = 200) -> None:
        super().__init__(daemon=True)
        self.source, self.log, self.echo = source, log, echo
        self.tail: deque[str] = deque(maxlen=tail_lines)

    def run(self) -> None:
        with open(self.log, "w", encoding="utf-8", errors="replace") as log:
            for raw in iter(self.source.readline, b""):
                line = raw.decode("utf-8", errors="replace")
                log.write(line)
                log.flush()
                self.tail.append(line.rstrip("\n"))
                if self.echo is not None:
                    with contextlib.suppress(ValueError, OSError):
                        self.echo.write(line)
                        self.echo.flush()


# -- runs -----------------------------------------------------------------------------------------


@dataclass
class ClusterResult:
    summary: dict[str, Any] | None  # rank 0's --summary-json (None if the run wrote none)
    wire_bytes: dict[str, int]  # bytes each node sent over its inter-node link during the run, by link name
    wall_s: float  # from starting the nodes' launchers until the last exited
    returncode: int  # 0, the first failing node's exit status (node 0 first), or 124 on timeout
    nodes: int = 0
    nproc_per_node: int = 0
    bandwidth_bps: float | None = None
    prefix: str = ""  # names of the namespaces: <prefix>-n<i>, <prefix>-hub
    returncodes: list[int] = field(default_factory=list)  # per node
    wire_rx_bytes: dict[str, int] = field(default_factory=dict)  # bytes each node received, same keys
    wire_packets: dict[str, int] = field(default_factory=dict)  # packets each node sent, same keys
    retransmitted_segments: int = 0  # TCP, all nodes
    qdisc_drops: int = 0  # packets the shapers dropped
    log_dir: str | None = None  # where node<i>.log were kept (--keep-logs), else None
    log_tails: list[list[str]] = field(default_factory=list)  # last lines of each node's output
    timed_out: bool = False

    @property
    def node_tx_bytes(self) -> list[int]:
        return list(self.wire_bytes.values())

    @property
    def comparison(self) -> dict[str, Any] | None:
        """compare_to_ledger() of this run, when its summary carries a ledger."""
        if not self.summary or "inter_node_bytes_per_step_by_rank" not in self.summary:
            return None
        packets = list(self.wire_packets.values())
        return compare_to_ledger(self.summary, self.nodes, self.nproc_per_node, self.node_tx_bytes, packets)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["comparison"] = self.comparison
        return out


def _split_summary_flag(args: list[str]) -> tuple[list[str], str | None]:
    out, path, i = [], None, 0
    while i < len(args):
        if args[i] == "--summary-json" and i + 1 < len(args):
            path, i = args[i + 1], i + 2
            continue
        if args[i].startswith("--summary-json="):
            path = args[i].split("=", 1)[1]
        else:
            out.append(args[i])
        i += 1
    return out, path


def _check_train_args(args: Sequence[str]) -> None:
    for arg in args:
        name = arg.split("=", 1)[0]
        if name in LAUNCH_FLAGS or name.replace("_", "-") in LAUNCH_FLAGS:
            raise ClusterError(
                f"zeropp cluster: error: {name} is the cluster's to set (from --nodes, --nproc-per-node); "
                "leave it out of the training arguments"
            )


def run_cluster(
    nodes: int,
    nproc_per_node: int,
    inter_node_bandwidth: str | float | None,
    train_args: Sequence[str] = (),
    summary_json: str | os.PathLike[str] | None = None,
    *,
    module: str | None = None,
    keep_logs: str | os.PathLike[str] | None = None,
    echo: IO[str] | None = None,
    timeout_s: float | None = None,
    failure_grace_s: float = 20.0,
    omp_threads: int | None = None,
    master_port: int = MASTER_PORT,
    cwd: str | os.PathLike[str] | None = None,
    prefix: str | None = None,
    env: dict[str, str] | None = None,
) -> ClusterResult:
    """Run one multi-node training job on an emulated cluster; return its summary and wire bytes.

    Each node runs ``python -m zeropp.cli train --nnodes N --node-rank i --nproc-per-node P
    --master-addr <node 0> --master-port <port> <train_args> --summary-json <path>`` (zeropp's own
    launcher, c10d rendezvous), or, with `module`, ``python -m torch.distributed.run`` with the
    same flags and ``-m <module> <train_args> --summary-json <path>`` (e.g. the peers of
    zeropp.benchmarks.peers). `summary_json` (or a ``--summary-json`` in `train_args`) keeps the
    summary there; otherwise it goes to a temporary file. `echo` receives node 0's output as it comes
    (the CLI passes stdout). When a node fails the others get `failure_grace_s` to fail too, then
    are stopped; past `timeout_s` everything is stopped (returncode 124). Raises ClusterError (before
    anything is created) when not root or without ``ip netns``; KeyboardInterrupt / ClusterInterrupted
    after cleanup when interrupted.
    """
    bandwidth_bps = parse_bandwidth(inter_node_bandwidth)
    if nproc_per_node < 1:
        raise ClusterError(f"zeropp cluster: error: --nproc-per-node {nproc_per_node} is not allowed; expected >= 1")
    args, flagged = _split_summary_flag(list(train_args))
    _check_train_args(args)
    work_dir = Path(cwd) if cwd is not None else Path.cwd()
    wanted = summary_json if summary_json is not None else flagged
    check_privileges(shaped=bandwidth_bps is not None)  # before the temporary folder, too

    with contextlib.ExitStack() as stack:
        if keep_logs is not None:
            log_dir = Path(keep_logs)
            log_dir.mkdir(parents=True, exist_ok=True)
        else:
            log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="zeropp-cluster-")))
        summary_path = (work_dir / wanted).resolve() if wanted is not None else log_dir / "summary.json"
        cluster = stack.enter_context(EmulatedCluster(nodes, bandwidth_bps, prefix=prefix))
        master = cluster.nodes[0].address
        threads = omp_threads or max(1, (os.cpu_count() or 1) // (nodes * nproc_per_node))
        child_env = dict(os.environ if env is None else env)
        child_env["OMP_NUM_THREADS"] = str(threads)
        before = cluster.counters()
        started = time.time()
        tick = time.monotonic()
        procs, pumps = [], []
        for node in cluster.nodes:
            launch = [
                f"--nnodes={nodes}", f"--node-rank={node.index}", f"--nproc-per-node={nproc_per_node}",
                f"--master-addr={master}", f"--master-port={master_port}",
            ]  # fmt: skip
            if module is None:
                argv = [sys.executable, "-m", "zeropp.cli", "train", *launch, *args]
            else:
                rdzv = ["--rdzv-backend=c10d", f"--rdzv-endpoint={master}:{master_port}", "--max-restarts=0"]
                argv = [sys.executable, "-m", "torch.distributed.run", *launch, *rdzv, "-m", module, *args]
            if module is None or wanted is not None:  # a module takes --summary-json only if asked
                argv += ["--summary-json", str(summary_path)]
            proc = cluster.start(node, argv, child_env, cwd=str(work_dir))
            pump = _Pump(proc.stdout, log_dir / f"node{node.index}.log", echo if node.index == 0 else None)  # type: ignore[arg-type]
            pump.start()
            procs.append(proc)
            pumps.append(pump)
        timed_out = _wait_all(procs, timeout_s, failure_grace_s, cluster)
        wall_s = time.monotonic() - tick
        for pump in pumps:
            pump.join(timeout=5)
        after = cluster.counters()
        drops = cluster.qdisc_drops() if bandwidth_bps is not None else 0
        links = cluster.link_names()
        codes = [_exit_status(p.returncode) for p in procs]
        returncode = 124 if timed_out else next((c for c in codes if c != 0), 0)
        summary = None
        if summary_path.exists() and summary_path.stat().st_mtime >= started - 1:
            with contextlib.suppress(ValueError, OSError):
                summary = json.loads(summary_path.read_text())
        result = ClusterResult(
            summary=summary,
            wire_bytes={k: a.tx_bytes - b.tx_bytes for k, a, b in zip(links, after, before, strict=True)},
            wall_s=wall_s,
            returncode=returncode,
            nodes=nodes,
            nproc_per_node=nproc_per_node,
            bandwidth_bps=bandwidth_bps,
            prefix=cluster.prefix,
            returncodes=codes,
            wire_rx_bytes={k: a.rx_bytes - b.rx_bytes for k, a, b in zip(links, after, before, strict=True)},
            wire_packets={k: a.tx_packets - b.tx_packets for k, a, b in zip(links, after, before, strict=True)},
            retransmitted_segments=sum(a.retrans_segs - b.retrans_segs for a, b in zip(after, before, strict=True)),
            qdisc_drops=drops,
            log_dir=str(log_dir) if keep_logs is not None else None,
            log_tails=[list(p.tail) for p in pumps],
            timed_out=timed_out,
        )
        if keep_logs is not None:
            (log_dir / "cluster.json").write_text(json.dumps(result.as_dict(), indent=2))
        return result
    raise AssertionError("unreachable")  # pragma: no cover


def _exit_status(code: int | None) -> int:
    """A shell's view of a child's exit: 128 + N for death by signal N."""
    if code is None:
        return 128 + signal.SIGKILL
    return 128 - code if code < 0 else code


def _wait_all(
    procs: list[subprocess.Popen], timeout_s: float | None, failure_grace_s: float, cluster: EmulatedCluster
) -> bool:
    """Wait for every node; stop the rest `failure_grace_s` after one fails. True if `timeout_s` passed."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    failed_at = None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            cluster._stop_processes()
            return True
        if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
            failed_at = now
        if failed_at is not None and now - failed_at >= failure_grace_s:
            cluster._stop_processes()
            break
        time.sleep(0.1)
    return False


# -- wire vs ledger -------------------------------------------------------------------------------


def gloo_broadcast_crossings(world: int, nproc_per_node: int, src: int = 0) -> list[int]:
    """How many times gloo's broadcast from `src` sends the whole buffer out of each node.

    gloo (gloo/broadcast.cc) broadcasts along a binomial tree, nearest first: in round k
    (k = 0, 1, ...) every rank at distance d < 2^k from the root sends to the rank at d + 2^k. With
    ranks laid out node by node, 0 -> 1 stays inside node 0 while 0 -> 2 and 1 -> 3 cross: for
    2 nodes x 2 ranks the weights leave node 0 twice (the ledger's ring model says once). Measured
    on the emulated wire (docs/cluster.md).
    """
    nodes = world // nproc_per_node
    out = [0] * nodes
    step = 1
    while step < world:
        for d in range(step):
            if d + step < world:
                a, b = (src + d) % world, (src + d + step) % world
                if a // nproc_per_node != b // nproc_per_node:
                    out[a // nproc_per_node] += 1
        step *= 2
    return out


def _eval_passes(summary: dict[str, Any]) -> int:
    train = summary.get("config", {}).get("train", {})
    steps, start = int(summary.get("steps", 0)), int(summary.get("start_step", 0))
    interval = int(train.get("eval_interval", 0) or 0)
    middle = sum(1 for k in range(start + 1, steps) if interval and k % interval == 0)
    return middle + 1


HEADER_BYTES = 66  # Ethernet 14 + IPv4 20 + TCP 20 + timestamps 12: once per packet the counters count


def compare_to_ledger(
    summary: dict[str, Any],
    nodes: int,
    nproc_per_node: int,
    node_tx_bytes: Sequence[int],
    node_tx_packets: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Set the bytes each node sent over its inter-node link beside what the ledger accounts for.

    Expected (application bytes out of node n):

    - ledger steps: the summary's inter-node bytes per step of each rank on n (rank r lives on node
      r // nproc_per_node) times the steps run; the ledger counts training steps only;
    - gloo reduce-scatter: gloo runs reduce_scatter as an all-reduce (measured: 2x the ring's bytes),
      so each reduce-scatter's inter-node bytes count twice (ZeRO-1/2/3 gradients; qgZ has none);
    - broadcast (outside the ledger): the initial weight broadcast from rank 0, fp32 parameters
      (4 bytes each) times gloo_broadcast_crossings() (gloo's binomial tree, not the ledger's ring);
    - eval (outside the ledger): at stage 3 each evaluation pass gathers the weights again: its
      first batch over the world (one forward gather), later batches from hpZ's secondary copy
      (inside a node: nothing) or over the world again (no hpZ); equal for every node (ring).

    Measured: the interface counters count each packet's 66 bytes of Ethernet/IP/TCP headers once
    (a GSO packet too), so wire - 66 x packets is the TCP payload, which is compared with the
    expected bytes (`ratio`; `wire_ratio` is the raw wire). The rest of the payload is what no
    ledger models: gloo's framing of every message, rendezvous/store traffic, the loss all-reduces,
    the summary's gathers and TCP retransmissions (docs/cluster.md has the measured sizes).
    """
    world = nodes * nproc_per_node
    steps_run = max(1, int(summary.get("steps", 0)) - int(summary.get("start_step", 0)))
    by_rank = summary["inter_node_bytes_per_step_by_rank"]
    ledger = summary.get("ledger", {})
    ledger_steps = [
        sum(by_rank[r] for r in range(n * nproc_per_node, (n + 1) * nproc_per_node)) * steps_run for n in range(nodes)
    ]
    reduce_scatter = sum(v.get("inter", 0.0) for v in ledger.get("reduce_scatter", {}).values()) * world
    rs_extra = [reduce_scatter * steps_run / nodes] * nodes  # ring: every node sends the same
    param_bytes = 4 * int(summary.get("param_count", 0))
    broadcast = [c * param_bytes for c in gloo_broadcast_crossings(world, nproc_per_node)]
    eval_bytes = [0.0] * nodes
    if int(summary.get("stage", 0)) == 3:
        config = summary.get("config", {})
        gathers = ledger.get("all_gather", {})
        accumulation = int(config.get("zero", {}).get("gradient_accumulation_steps", 1))
        hpz = int(summary.get("zeropp", {}).get("hpz_group_size", 1)) > 1
        forward = gathers.get("forward", {}).get("inter", 0.0) * world  # all ranks, per step
        backward = gathers.get("backward", {}).get("inter", 0.0) * world
        first = forward / (1 if hpz else accumulation)  # one world gather of every unit
        later = backward / accumulation if hpz else first  # one gather from the secondary copy, or the world's
        batches = int(config.get("train", {}).get("eval_batches", 1))
        per_pass = first + max(0, batches - 1) * later
        eval_bytes = [per_pass * _eval_passes(summary) / nodes] * nodes
    packets = list(node_tx_packets) if node_tx_packets is not None else [0] * nodes

    def row(wire: float, pkts: float, parts: dict[str, float]) -> dict[str, float]:
        expected = sum(parts.values())
        headers = HEADER_BYTES * pkts
        return {
            "wire_bytes": wire,
            "packets": pkts,
            "header_bytes": headers,
            "tcp_payload_bytes": wire - headers,
            **parts,
            "expected_bytes": expected,
            "ratio": (wire - headers) / expected if expected else math.inf,
            "wire_ratio": wire / expected if expected else math.inf,
        }

    rows = []
    for n in range(nodes):
        parts = {
            "ledger_step_bytes": ledger_steps[n],
            "gloo_reduce_scatter_extra_bytes": rs_extra[n],
            "broadcast_bytes": broadcast[n],
            "eval_bytes": eval_bytes[n],
        }
        rows.append({"node": n, **row(node_tx_bytes[n], packets[n], parts)})
    keys = ("ledger_step_bytes", "gloo_reduce_scatter_extra_bytes", "broadcast_bytes", "eval_bytes")
    total = row(sum(node_tx_bytes), sum(packets), {k: sum(r[k] for r in rows) for k in keys})
    return {
        "steps_run": steps_run,
        "world_size": world,
        "ledger_inter_node_bytes_per_step": summary.get("inter_node_bytes_per_step", 0.0) * world,
        "nodes": rows,
        "total": total,
    }


def per_step_wire_bytes(short: ClusterResult, long: ClusterResult) -> dict[str, float]:
    """Bytes of one training step on the wire, from two runs that differ only in --steps:
    everything that is not a step (set-up, broadcast, evaluation, summary) is the same in both and
    cancels. Beside it the ledger's bytes per step (all ranks; + gloo's reduce-scatter doubling)."""
    assert short.summary and long.summary, "both runs need a summary"
    steps = int(long.summary["steps"]) - int(short.summary["steps"])
    assert steps > 0, "the second run must have more steps"
    wire = (sum(long.node_tx_bytes) - sum(short.node_tx_bytes)) / steps
    packets = (sum(long.wire_packets.values()) - sum(short.wire_packets.values())) / steps
    comparison = long.comparison
    assert comparison is not None
    expected = (
        comparison["total"]["ledger_step_bytes"] + comparison["total"]["gloo_reduce_scatter_extra_bytes"]
    ) / comparison["steps_run"]
    payload = wire - HEADER_BYTES * packets
    return {
        "wire_bytes_per_step": wire,
        "packets_per_step": packets,
        "tcp_payload_bytes_per_step": payload,
        "ledger_bytes_per_step": comparison["ledger_inter_node_bytes_per_step"],
        "expected_bytes_per_step": expected,
        "ratio": payload / expected if expected else math.inf,
        "wire_ratio": wire / expected if expected else math.inf,
    }


# -- bandwidth probe ------------------------------------------------------------------------------

_RECEIVER = (
    "import socket, sys, time\n"
    "s = socket.create_server((sys.argv[1], int(sys.argv[2])))\n"
    "print('ready', flush=True)\n"
    "c, _ = s.accept(); n = 0; first = None\n"
    "while True:\n"
    "    b = c.recv(1 << 20)\n"
    "    if not b: break\n"
    "    first = first or time.perf_counter(); n += len(b)\n"
    "print(n, time.perf_counter() - first, flush=True)\n"
)
_SENDER = (
    "import socket, sys\n"
    "c = socket.create_connection((sys.argv[1], int(sys.argv[2])))\n"
    "block = bytes(1 << 20)\n"
    "for _ in range(int(sys.argv[3])): c.sendall(block)\n"
    "c.close()\n"
)


def probe_bandwidth(inter_node_bandwidth: str | float | None, megabytes: int = 32, timeout_s: float = 120.0) -> dict:
    """TCP throughput of one inter-node link: node 1 sends `megabytes` MiB to node 0 over one
    connection. Returns goodput (payload bits/s), wire bytes and the shaper's drops."""
    bandwidth_bps = parse_bandwidth(inter_node_bandwidth)
    with EmulatedCluster(2, bandwidth_bps) as cluster:
        server, client = cluster.nodes
        env = dict(os.environ)
        receiver = cluster.start(server, [sys.executable, "-c", _RECEIVER, server.address, "5001"], env)
        assert receiver.stdout is not None
        ready = receiver.stdout.readline().decode().strip()
        if ready != "ready":
            raise ClusterError(f"zeropp cluster: error: the probe's receiver did not start: {ready}", code=1)
        before = cluster.counters()
        sender = cluster.start(client, [sys.executable, "-c", _SENDER, server.address, "5001", str(megabytes)], env)
        sender.wait(timeout=timeout_s)
        received, seconds = receiver.stdout.readline().decode().split()
        receiver.wait(timeout=10)
        after = cluster.counters()
        return {
            "configured_bps": bandwidth_bps,
            "payload_bytes": int(received),
            "seconds": float(seconds),
            "goodput_bps": int(received) * 8 / float(seconds),
            "wire_bytes": after[1].tx_bytes - before[1].tx_bytes,
            "wire_bps": (after[1].tx_bytes - before[1].tx_bytes) * 8 / float(seconds),
            "retransmitted_segments": after[1].retrans_segs - before[1].retrans_segs,
            "qdisc_drops": cluster.qdisc_drops() if bandwidth_bps is not None else 0,
        }


# -- leftovers ------------------------------------------------------------------------------------


def cleanup_stale(everything: bool = False) -> list[str]:
    """Remove the namespaces (and /etc/netns files) of cluster runs whose process is gone (all of
    them with `everything`), after killing what still runs inside; return the names removed."""
    removed = []
    names = set(list_netns())
    if Path("/etc/netns").is_dir():
        names |= {p.name for p in Path("/etc/netns").iterdir()}
    for name in sorted(names):
        match = NAME_RE.match(name)
        if not match or (not everything and _alive(int(match[1]))):
            continue
        pids = netns_pids(name) if name in list_netns() else []
        _kill(pids, signal.SIGKILL)
        _wait_gone(pids, 10.0)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)
        removed.append(name)
    return removed


# -- command line ---------------------------------------------------------------------------------


def report(result: ClusterResult, out: IO[str]) -> None:
    """The wire-vs-ledger tables printed after a run."""

    def say(text: str = "") -> None:
        print(text, file=out)

    say()
    say(
        f"zeropp cluster: {result.nodes} nodes x {result.nproc_per_node} ranks, inter-node links "
        f"{format_rate(result.bandwidth_bps)}, wall {result.wall_s:.1f} s, exit status {result.returncode}"
    )
    comparison = result.comparison
    names = [*result.wire_bytes.keys(), "total"]
    if comparison is None:
        say("bytes each node sent over its inter-node link (no ledger in the summary to compare with):")
        for name in names[:-1]:
            say(f"  {name:<14} {result.wire_bytes[name]:>14,} B in {result.wire_packets.get(name, 0):,} packets")
    else:
        rows = [*comparison["nodes"], comparison["total"]]
        say(
            f"expected inter-node bytes, from the ledger: {comparison['steps_run']} steps x "
            f"{comparison['ledger_inter_node_bytes_per_step']:,.0f} B (all ranks), plus what it leaves out"
        )
        cols = (
            "ledger_step_bytes",
            "gloo_reduce_scatter_extra_bytes",
            "broadcast_bytes",
            "eval_bytes",
            "expected_bytes",
        )
        say(
            "  {:<14} {:>13} {:>13} {:>13} {:>11} {:>13}".format(
                "link", "ledger steps", "+ gloo RS", "+ broadcast", "+ eval", "= expected"
            )
        )
        for name, row in zip(names, rows, strict=True):
            say(f"  {name:<14} " + " ".join(f"{row[c]:>{11 if c == 'eval_bytes' else 13},.0f}" for c in cols))
        say("measured on the wire (interface tx counters), against the expected bytes:")
        say(
            "  {:<14} {:>13} {:>13} {:>13} {:>13} {:>11}".format(
                "link", "wire", "- headers", "= payload", "payload/exp", "wire/exp"
            )
        )
        for name, row in zip(names, rows, strict=True):
            say(
                f"  {name:<14} {row['wire_bytes']:>13,.0f} {row['header_bytes']:>13,.0f} "
                f"{row['tcp_payload_bytes']:>13,.0f} {row['ratio']:>13.3f} {row['wire_ratio']:>11.3f}"
            )
        say("  (headers: 66 B per packet counted; payload beyond the expected: gloo framing, rendezvous, losses)")
    extra = f"TCP retransmissions {result.retransmitted_segments}"
    if result.bandwidth_bps is not None:
        extra += f", shaper drops {result.qdisc_drops}"
    say(f"  {extra}")
    if result.log_dir:
        say(f"  logs: {result.log_dir}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zeropp cluster",
        description="An emulated multi-node cluster (network namespaces, veth links shaped by tc) "
        "running real multi-node torchrun launches. Needs root.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser(
        "run",
        help="train on N emulated nodes: zeropp cluster run [options] -- <zeropp train args>",
        description="Everything after '--' goes to zeropp train (or to --module).",
    )
    run.add_argument("--nodes", type=int, default=2, help="emulated nodes (default 2)")
    run.add_argument("--nproc-per-node", type=int, default=2, help="ranks per node (default 2)")
    run.add_argument(
        "--inter-node-bandwidth",
        default="200mbit",
        help="tc rate of every inter-node link, each direction (default 200mbit; 'none': unshaped)",
    )
    run.add_argument("--keep-logs", type=Path, metavar="DIR", help="keep node<i>.log and cluster.json here")
    run.add_argument("--json", type=Path, metavar="PATH", help="write the result (wire bytes, comparison) as JSON")
    run.add_argument("--timeout", type=float, default=None, metavar="S", help="stop the run after S seconds")
    run.add_argument("--omp-threads", type=int, default=None, help="OMP_NUM_THREADS of every rank")
    run.add_argument("--module", default=None, help="run `torchrun -m MODULE` instead of zeropp train")
    run.add_argument("--quiet", action="store_true", help="do not stream node 0's output")
    probe = commands.add_parser("probe", help="measure the TCP throughput of one shaped inter-node link")
    probe.add_argument("--inter-node-bandwidth", default="200mbit")
    probe.add_argument("--megabytes", type=int, default=32, help="MiB to send (default 32)")
    cleanup = commands.add_parser("cleanup", help="remove namespaces left by runs that were SIGKILLed")
    cleanup.add_argument("--all", action="store_true", help="also those of runs still alive")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1 :]
    args = build_parser().parse_args(argv)
    try:
        if args.command == "cleanup":
            check_privileges(shaped=False)
            removed = cleanup_stale(everything=args.all)
            print(
                f"zeropp cluster: removed {len(removed)} namespace(s)" + (f": {', '.join(removed)}" if removed else "")
            )
            return 0
        if args.command == "probe":
            result = probe_bandwidth(args.inter_node_bandwidth, args.megabytes)
            print(
                f"zeropp cluster probe: {result['payload_bytes'] / 2**20:.0f} MiB in {result['seconds']:.2f} s: "
                f"goodput {format_rate(result['goodput_bps'])}, wire {format_rate(result['wire_bps'])} "
                f"(configured {format_rate(result['configured_bps'])}); TCP retransmissions "
                f"{result['retransmitted_segments']}, shaper drops {result['qdisc_drops']}"
            )
            return 0
        result = run_cluster(
            args.nodes,
            args.nproc_per_node,
            args.inter_node_bandwidth,
            passthrough,
            module=args.module,
            keep_logs=args.keep_logs,
            echo=None if args.quiet else sys.stdout,
            timeout_s=args.timeout,
            omp_threads=args.omp_threads,
        )
    except ClusterError as error:
        print(str(error), file=sys.stderr)
        return error.code
    except KeyboardInterrupt:
        print("zeropp cluster: interrupted; cleaned up", file=sys.stderr)
        return 130
    except ClusterInterrupted as error:
        print(f"zeropp cluster: {error}; cleaned up", file=sys.stderr)
        return 128 + error.signum
    if result.returncode != 0:
        print(f"zeropp cluster: error: the run failed (exit status {result.returncode})", file=sys.stderr)
        for node, (code, tail) in enumerate(zip(result.returncodes, result.log_tails, strict=True)):
            if code != 0:
                print(f"--- node {node} (exit status {code}), last lines:", file=sys.stderr)
                print("\n".join(tail[-15:]), file=sys.stderr)
    report(result, sys.stdout)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result.as_dict(), indent=2))
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
