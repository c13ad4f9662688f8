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

Modules: ``links`` (iproute2, tc, rates), ``processes`` (markers, stopping, output), ``emulated``
(:class:`EmulatedCluster`, cleanup of dead runs), ``run`` (:func:`run_cluster`), ``wire`` (wire bytes
against the ledger), ``probe`` (one link's throughput), ``cli`` (:func:`main`, :func:`report`).
"""

from zeropp.tools.cluster.cli import build_parser, main, report
from zeropp.tools.cluster.emulated import Counters, EmulatedCluster, Node, cleanup_stale
from zeropp.tools.cluster.errors import ClusterError, ClusterInterrupted
from zeropp.tools.cluster.links import check_privileges, format_rate, list_netns, netns_pids, parse_bandwidth, tbf_args
from zeropp.tools.cluster.probe import probe_bandwidth
from zeropp.tools.cluster.processes import MARKER_ENV, marked_pids
from zeropp.tools.cluster.run import ClusterResult, run_cluster
from zeropp.tools.cluster.wire import HEADER_BYTES, compare_to_ledger, gloo_broadcast_crossings, per_step_wire_bytes

__all__ = [
    "HEADER_BYTES",
    "MARKER_ENV",
    "ClusterError",
    "ClusterInterrupted",
    "ClusterResult",
    "Counters",
    "EmulatedCluster",
    "Node",
    "build_parser",
    "check_privileges",
    "cleanup_stale",
    "compare_to_ledger",
    "format_rate",
    "gloo_broadcast_crossings",
    "list_netns",
    "main",
    "marked_pids",
    "netns_pids",
    "parse_bandwidth",
    "per_step_wire_bytes",
    "probe_bandwidth",
    "report",
    "run_cluster",
    "tbf_args",
]
