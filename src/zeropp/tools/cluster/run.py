"""One training job on an emulated cluster: :func:`run_cluster` and its :class:`ClusterResult`."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from zeropp.app.launch import usable_cpus
from zeropp.app.summary import RunSummary
from zeropp.tools.cluster.emulated import Counters, EmulatedCluster
from zeropp.tools.cluster.errors import ClusterError
from zeropp.tools.cluster.links import check_privileges, parse_bandwidth
from zeropp.tools.cluster.processes import Pump, exit_status
from zeropp.tools.cluster.wire import compare_to_ledger

MASTER_PORT = 29500  # every node has a network namespace of its own: any port is free there
LAUNCH_FLAGS = ("--nnodes", "--node-rank", "--nproc-per-node", "--master-addr", "--master-port")


@dataclass
class ClusterResult:
    # rank 0's --summary-json: zeropp train's RunSummary, with `module` that module's own JSON; None if none written
    summary: RunSummary | dict[str, Any] | None
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
        """compare_to_ledger() of this run, when its summary carries a ledger (zeropp train's)."""
        if not isinstance(self.summary, RunSummary):
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
    same flags and ``-m <module> <train_args> --summary-json <path>`` (e.g. the rivals of
    zeropp.tools.bench.rivals). `summary_json` (or a ``--summary-json`` in `train_args`) keeps the
    summary there; otherwise it goes to a temporary file. `echo` receives node 0's output as it comes
    (the CLI passes stdout). When a node fails the others get `failure_grace_s` to fail too, then
    are stopped; past `timeout_s` everything is stopped (returncode 124). Raises ClusterError (before
    anything is created) when not root or without ``ip netns``; KeyboardInterrupt / ClusterInterrupted
    after cleanup when interrupted. (One function, long: the temporary folder, the cluster and the
    processes nest in one ExitStack, so that every way out removes them in order.)
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
        threads = omp_threads or max(1, usable_cpus() // (nodes * nproc_per_node))
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
            argv = _node_argv(launch, args, module, master, master_port)
            if module is None or wanted is not None:  # a module takes --summary-json only if asked
                argv += ["--summary-json", str(summary_path)]
            proc = cluster.start(node, argv, child_env, cwd=str(work_dir))
            pump = Pump(proc.stdout, log_dir / f"node{node.index}.log", echo if node.index == 0 else None)  # type: ignore[arg-type]
            pump.start()
            procs.append(proc)
            pumps.append(pump)
        timed_out = _wait_all(procs, timeout_s, failure_grace_s, cluster)
        wall_s = time.monotonic() - tick
        for pump in pumps:
            pump.join(timeout=5)
        result = _collect(cluster, before, procs, pumps, timed_out, wall_s, nproc_per_node)
        result.summary = _read_summary(summary_path, started, zeropp_train=module is None)
        if keep_logs is not None:
            result.log_dir = str(log_dir)
            (log_dir / "cluster.json").write_text(json.dumps(result.as_dict(), indent=2))
        return result
    raise AssertionError("unreachable")  # pragma: no cover


def _node_argv(launch: list[str], args: list[str], module: str | None, master: str, port: int) -> list[str]:
    """A node's command: zeropp train (its own launcher), or torchrun -m `module`."""
    if module is None:
        return [sys.executable, "-m", "zeropp.cli", "train", *launch, *args]
    rdzv = ["--rdzv-backend=c10d", f"--rdzv-endpoint={master}:{port}", "--max-restarts=0"]
    return [sys.executable, "-m", "torch.distributed.run", *launch, *rdzv, "-m", module, *args]


def _read_summary(path: Path, started: float, zeropp_train: bool) -> RunSummary | dict[str, Any] | None:
    """What this run wrote at `path` (an older file is not this run's); None if nothing readable."""
    if not path.exists() or path.stat().st_mtime < started - 1:
        return None
    with contextlib.suppress(ValueError, OSError):
        text = path.read_text()
        return RunSummary.from_json(text) if zeropp_train else json.loads(text)
    return None


def _collect(
    cluster: EmulatedCluster,
    before: list[Counters],
    procs: list[subprocess.Popen],
    pumps: list[Pump],
    timed_out: bool,
    wall_s: float,
    nproc_per_node: int,
) -> ClusterResult:
    """The run's result from the counters now and `before`, its exit statuses and output tails."""
    after = cluster.counters()
    links = cluster.link_names()
    codes = [exit_status(p.returncode) for p in procs]
    return ClusterResult(
        summary=None,
        wire_bytes={k: a.tx_bytes - b.tx_bytes for k, a, b in zip(links, after, before, strict=True)},
        wall_s=wall_s,
        returncode=124 if timed_out else next((c for c in codes if c != 0), 0),
        nodes=len(cluster.nodes),
        nproc_per_node=nproc_per_node,
        bandwidth_bps=cluster.bandwidth_bps,
        prefix=cluster.prefix,
        returncodes=codes,
        wire_rx_bytes={k: a.rx_bytes - b.rx_bytes for k, a, b in zip(links, after, before, strict=True)},
        wire_packets={k: a.tx_packets - b.tx_packets for k, a, b in zip(links, after, before, strict=True)},
        retransmitted_segments=sum(a.retrans_segs - b.retrans_segs for a, b in zip(after, before, strict=True)),
        qdisc_drops=cluster.qdisc_drops() if cluster.bandwidth_bps is not None else 0,
        log_tails=[list(p.tail) for p in pumps],
        timed_out=timed_out,
    )


def _wait_all(
    procs: list[subprocess.Popen], timeout_s: float | None, failure_grace_s: float, cluster: EmulatedCluster
) -> bool:
    """Wait for every node; stop the rest `failure_grace_s` after one fails. True if `timeout_s` passed."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    failed_at = None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            cluster.stop_processes()
            return True
        if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
            failed_at = now
        if failed_at is not None and now - failed_at >= failure_grace_s:
            cluster.stop_processes()
            break
        time.sleep(0.1)
    return False
