"""World, nodes and ranks per node, and the process groups built from them (once, in a fixed order).

Ranks are laid out node-major: rank r lives on node r // ranks_per_node with local index
r % ranks_per_node. That holds for torchrun (it numbers ranks node by node) and is how a single
machine simulates several nodes. The groups:

- world: every rank;
- intra-node: the ranks of one node;
- inter-node: the ranks with the same local index on every node.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from zeropp.config import ConfigError, TopologyConfig


@dataclass(frozen=True)
class Layout:
    """Pure rank arithmetic: no process groups, so it can be unit-tested and used by the estimator."""

    world_size: int
    nodes: int

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.nodes < 1 or self.world_size % self.nodes:
            raise ConfigError(
                f"topology.nodes = {self.nodes} does not divide world size {self.world_size}; "
                f"allowed: a divisor of {self.world_size}"
            )

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nodes

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def intra_node_ranks(self, node: int) -> tuple[int, ...]:
        start = node * self.ranks_per_node
        return tuple(range(start, start + self.ranks_per_node))

    def inter_node_ranks(self, local_index: int) -> tuple[int, ...]:
        return tuple(node * self.ranks_per_node + local_index for node in range(self.nodes))


@dataclass(frozen=True)
class Group:
    """A process group together with the global ranks it spans, in group-rank order."""

    pg: dist.ProcessGroup | None
    ranks: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass
class Topology:
    layout: Layout
    rank: int
    device: torch.device
    world: Group
    intra_node: Group
    inter_node: Group
    timeout: datetime.timedelta | None = None  # of every group built here (None: torch's default)
    _extra: dict[str, Group] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def nodes(self) -> int:
        return self.layout.nodes

    @property
    def ranks_per_node(self) -> int:
        return self.layout.ranks_per_node

    def node_of(self, rank: int) -> int:
        return self.layout.node_of(rank)

    def subgroups(self, name: str, partition: list[tuple[int, ...]]) -> Group:
        """Build (once) a partition of the world into groups, e.g. hpZ's secondary groups; return ours.

        Every rank must call this with the same partition, in the same order: new_group is collective.
        """
        if name not in self._extra:
            mine = None
            for ranks in partition:
                pg = dist.new_group(list(ranks), timeout=self.timeout) if len(ranks) > 1 else None
                if self.rank in ranks:
                    mine = Group(pg, tuple(ranks))
            assert mine is not None, f"rank {self.rank} is in no group of {name}"
            self._extra[name] = mine
        return self._extra[name]


def read_world_from_env() -> tuple[int, int, int | None]:
    """(rank, world_size, nodes) from torchrun's environment; nodes is None when it cannot be told."""
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local = os.environ.get("LOCAL_WORLD_SIZE")
    nodes = world_size // int(local) if local else None
    return rank, world_size, nodes


def init_topology(config: TopologyConfig | None = None) -> Topology:
    """Validate the topology against the environment, then initialise torch.distributed and build groups."""
    config = config or TopologyConfig()
    config.validate()
    rank, world_size, env_nodes = read_world_from_env()
    config.check_world(world_size)
    layout = Layout(world_size, config.nodes or env_nodes or 1)
    backend = config.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ and world_size == 1:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
        timeout = datetime.timedelta(seconds=config.timeout_s)
        dist.init_process_group(
            backend, store=_attempt_store(rank, world_size, timeout), rank=rank, world_size=world_size, timeout=timeout
        )
    return build_topology(layout, rank, device, datetime.timedelta(seconds=config.timeout_s))


def _attempt_store(rank: int, world_size: int, timeout: datetime.timedelta) -> dist.Store:
    """The rendezvous store under a prefix of its own for each torchrun restart.

    torchrun keeps one store across restarts (--max-restarts); without a fresh prefix, restarted
    ranks read the addresses that the killed attempt's ranks published and fail to connect
    (pytorch/pytorch#167288).
    """
    agent_hosted = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=rank == 0 and not agent_hosted,
        timeout=timeout,
    )
    return dist.PrefixStore(f"zeropp/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def build_topology(
    layout: Layout, rank: int, device: torch.device, timeout: datetime.timedelta | None = None
) -> Topology:
    """Build world, intra-node and inter-node groups (collective: every rank calls it identically)."""
    world = Group(dist.group.WORLD, tuple(range(layout.world_size)))
    topo = Topology(layout, rank, device, world, world, world, timeout)
    intra = [layout.intra_node_ranks(n) for n in range(layout.nodes)]
    inter = [layout.inter_node_ranks(i) for i in range(layout.ranks_per_node)]
    topo.intra_node = world if layout.nodes == 1 else topo.subgroups("intra_node", intra)
    topo.inter_node = world if layout.ranks_per_node == 1 else topo.subgroups("inter_node", inter)
    return topo


def shutdown() -> None:
    """Destroy the process groups (gloo's worker threads must be joined before the interpreter exits).

    Ranks that end normally meet in a barrier first (through comm, like every collective); a
    failing rank calls this directly, since it cannot count on the others arriving."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
