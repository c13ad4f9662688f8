"""``zeropp cluster``'s command line: run, probe, cleanup, and the wire-vs-ledger report."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from zeropp.tools.cluster.emulated import cleanup_stale
from zeropp.tools.cluster.errors import ClusterError, ClusterInterrupted
from zeropp.tools.cluster.links import check_privileges, format_rate
from zeropp.tools.cluster.probe import probe_bandwidth
from zeropp.tools.cluster.run import ClusterResult, run_cluster


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
