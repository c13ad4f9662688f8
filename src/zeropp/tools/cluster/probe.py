"""``zeropp cluster probe``: the TCP throughput of one shaped inter-node link."""

from __future__ import annotations

import os
import sys

from zeropp.tools.cluster.emulated import EmulatedCluster
from zeropp.tools.cluster.errors import ClusterError
from zeropp.tools.cluster.links import parse_bandwidth

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
