"""The wire between emulated nodes: iproute2 (``ip netns``, veth), tc's shaper, and link rates."""

from __future__ import annotations

import math
import os
import shutil
import subprocess

from zeropp.config.rates import RateError
from zeropp.config.rates import parse_bandwidth as parse_rate
from zeropp.tools.cluster.errors import ClusterError

TBF_LATENCY = "50ms"  # longest a packet may wait in the shaper's queue before it is dropped


def parse_bandwidth(text: str | float | None) -> float | None:
    """Bits per second of ``--inter-node-bandwidth``: tc's rate syntax as :func:`zeropp.config.rates.parse_bandwidth`
    reads it ('200mbit', '25mbps' = bytes/s, a bare number of bits/s), or a number; None for 'none',
    'unlimited', 'off', '0' or None (links left unshaped). At least 8kbit."""
    if text is None:
        return None
    if isinstance(text, (int, float)):
        bps = float(text)
    elif text.strip().lower() in ("none", "unlimited", "off", "0"):
        return None
    else:
        try:
            bps = parse_rate(text, tc_syntax=True)
        except RateError as error:
            raise ClusterError(f"zeropp cluster: error: bandwidth {error}, or 'none'") from None
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


def run_ip(*args: str) -> None:
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


def disable_ipv6(namespace: str) -> None:
    subprocess.run(
        ["ip", "netns", "exec", namespace, "sh", "-c",
         "for f in /proc/sys/net/ipv6/conf/*/disable_ipv6; do echo 1 > $f; done 2>/dev/null; true"],
        capture_output=True,
    )  # fmt: skip
