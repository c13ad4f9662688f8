"""The emulated cluster: network namespaces joined by (shaped) veth links, and what runs in them."""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zeropp.tools.cluster.errors import ClusterError, ClusterInterrupted
from zeropp.tools.cluster.links import check_privileges, disable_ipv6, list_netns, netns_pids, run_ip, tbf_args
from zeropp.tools.cluster.processes import MARKER_ENV, alive, kill, marked_pids, wait_gone

MAX_NODES = 250  # one /24: node i is 10.77.0.(i+1)
SUBNET = "10.77.0"
TORCHRUN_ENV = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "GLOO_SOCKET_IFNAME",
)  # fmt: skip
NAME_RE = re.compile(r"^zpp(\d+)-(\d+)-(?:n\d+|hub)$")  # <prefix>-n<i>, <prefix>-hub; prefix zpp<pid>-<run>

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
            self.stop_processes()
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

    def stop_processes(self, grace_s: float = 10.0) -> None:
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
        kill(strays, signal.SIGKILL)
        wait_gone(strays, 10.0)

    # -- network ----------------------------------------------------------------------------------

    def _add_namespace(self, name: str) -> None:
        self._namespaces.append(name)  # tracked before it exists: a signal in between still cleans it
        run_ip("ip", "netns", "add", name)

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
            run_ip("ip", "link", "add", a.device, "netns", a.namespace, "type", "veth",
                "peer", "name", b.device, "netns", b.namespace)  # fmt: skip
        else:
            self._add_namespace(self.hub)
            run_ip("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
            for node in self.nodes:
                assert node.hub_port is not None
                run_ip("ip", "link", "add", node.device, "netns", node.namespace, "type", "veth",
                    "peer", "name", node.hub_port, "netns", self.hub)  # fmt: skip
                run_ip("ip", "-n", self.hub, "link", "set", node.hub_port, "master", "br0")
            disable_ipv6(self.hub)
            for node in self.nodes:
                assert node.hub_port is not None
                run_ip("ip", "-n", self.hub, "link", "set", node.hub_port, "up")
            run_ip("ip", "-n", self.hub, "link", "set", "br0", "up")
        for node in self.nodes:
            disable_ipv6(node.namespace)  # no router solicitations or MLD reports on the counted wire
            run_ip("ip", "-n", node.namespace, "addr", "add", f"{node.address}/24", "dev", node.device)
            run_ip("ip", "-n", node.namespace, "link", "set", "lo", "up")
            run_ip("ip", "-n", node.namespace, "link", "set", node.device, "up")
        if self.bandwidth_bps is not None:
            for namespace, device in self.shaped_devices():
                run_ip("tc", "-n", namespace, "qdisc", "add", "dev", device, "root", *tbf_args(self.bandwidth_bps))

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


def cleanup_stale(everything: bool = False) -> list[str]:
    """Remove the namespaces (and /etc/netns files) of cluster runs whose process is gone (all of
    them with `everything`), after killing what still runs inside; return the names removed."""
    removed = []
    names = set(list_netns())
    if Path("/etc/netns").is_dir():
        names |= {p.name for p in Path("/etc/netns").iterdir()}
    for name in sorted(names):
        match = NAME_RE.match(name)
        if not match or (not everything and alive(int(match[1]))):
            continue
        pids = netns_pids(name) if name in list_netns() else []
        kill(pids, signal.SIGKILL)
        wait_gone(pids, 10.0)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)
        removed.append(name)
    return removed
