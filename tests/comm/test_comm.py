"""Collectives that cannot complete end in one clear error after topology.timeout_s, not a hang."""

from __future__ import annotations

import time

import torch
from launcher import run_ranks

TIMEOUT_S = 2.0


def stuck_peer_worker() -> str:
    from zeropp.comm.communicator import CollectiveTimeout, Communicator
    from zeropp.config.sections import TopologyConfig
    from zeropp.topology import init_topology

    topology = init_topology(TopologyConfig(nodes=2, timeout_s=TIMEOUT_S))
    comm = Communicator(topology)
    if topology.rank == 1:  # never joins: stands for a rank stuck in a long computation or a dead loop
        time.sleep(3 * TIMEOUT_S)
        return "stuck"
    start = time.monotonic()
    try:
        comm.all_to_all(torch.zeros(2), torch.ones(2), topology.intra_node)  # a subgroup: it has the timeout too
    except CollectiveTimeout as error:
        return f"{time.monotonic() - start:.1f}|{error}"
    return "no error"


def test_a_stuck_rank_turns_into_one_line_timeout_error():
    waited, message = run_ranks(stuck_peer_worker, 4)[0].split("|", 1)
    assert TIMEOUT_S <= float(waited) < 3 * TIMEOUT_S
    assert message.startswith("zeropp: a collective timed out (topology.timeout_s)") and "\n" not in message
