"""World, nodes, the mesh of parallel dimensions, and the process groups built from them (once, in a fixed order).

Ranks are laid out node-major: rank r lives on node r // ranks_per_node with local index
r % ranks_per_node. That holds for torchrun (it numbers ranks node by node) and is how a single
machine simulates several nodes.

The mesh. The world is a (data-parallel x tensor-parallel) grid, the tensor-parallel dimension
innermost: runs of ``tensor_parallel_size`` consecutive ranks, inside one node, split each weight
matrix between them (DTensor, :mod:`zeropp.tensor_parallel`). The data-parallel groups are the
ranks with the same tensor-parallel index: they hold one tensor-parallel shard's model states
between them, which ZeRO shards, gathers and reduces over (without tensor parallelism: one group,
every rank). Everything below is derived from a data-parallel group's ranks, so it follows the
group's own node structure (2 nodes x 4 ranks with tp 2: each data-parallel group has 2 ranks per
node). For each data-parallel group:

- intra-node: its ranks on one node;
- inter-node: its ranks with the same position inside their node, one per node;
- hpZ's secondary groups: consecutive runs of its ranks, whole nodes or parts of one.

Units and collectives receive these as :class:`ShardGroups` and never look at world or rank.
"""

from __future__ import annotations

import atexit
import datetime
import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from zeropp.config.launcher import read_launch_environment
from zeropp.config.sections import TopologyConfig
from zeropp.errors import ConfigError
from zeropp.index.ranks import Layout, RankGroups

GLOO_DRAIN_S = 0.1  # see shutdown()

# The process groups zeropp built, by handle. Groups refer to them through here so that shutdown() can
# drop the last references: a subgroup's gloo worker threads live as long as its Python object, and a
# thread still running at interpreter exit aborts the process.
_PROCESS_GROUPS: dict[int, dist.ProcessGroup] = {}


def _register(pg: dist.ProcessGroup) -> int:
    handle = len(_PROCESS_GROUPS)
    _PROCESS_GROUPS[handle] = pg
    return handle


@dataclass(frozen=True)
class Group:
    """A process group: the global ranks it spans in group-rank order, and this process's place in it."""

    handle: int | None  # in _PROCESS_GROUPS; None: a group of one rank, which needs no process group
    ranks: tuple[int, ...]
    rank: int  # this process's index in `ranks`

    @property
    def pg(self) -> dist.ProcessGroup | None:
        return None if self.handle is None else _PROCESS_GROUPS[self.handle]

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class ShardGroups:
    """The groups a unit shards, gathers and reduces over: this rank's data-parallel group, its
    intra-node and inter-node parts (qgZ's two hops) and, with hpZ, its secondary group."""

    shard: Group
    intra_node: Group
    inter_node: Group
    secondary: Group | None = None

    @property
    def hpz_group_size(self) -> int:
        return 1 if self.secondary is None else self.secondary.size


@dataclass
class Topology:
    layout: Layout
    rank: int
    device: torch.device
    world: Group
    intra_node: Group
    inter_node: Group
    data_parallel: Group
    tensor_parallel: Group
    context_parallel: Group  # the ranks sharing sequences, each holding a slice (zeropp.context_parallel)
    expert_parallel: Group  # the ranks splitting each layer's experts (zeropp.expert_parallel)
    timeout: datetime.timedelta | None = None  # of every group built here (None: torch's default)
    sequence_parallel: bool = False  # activations between the split layers sharded over the sequence (tensor_parallel)
    _built: dict[str, Group] = field(default_factory=dict)
    _named: dict[str, Group] = field(default_factory=dict)  # group_named's answers, by torch's group name

    def __enter__(self) -> Topology:
        return self

    def __exit__(self, kind: type | None, *exc: object) -> None:
        shutdown(wait_for_others=kind is None)

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

    def subgroups(self, name: str, groups: RankGroups) -> Group:
        """Build (once) the process groups of `groups` (disjoint, covering the world): the one holding this rank.

        Every rank must call this with the same groups, in the same order: new_group is collective.
        A group of every rank is the world's; a group of one rank needs no process group.
        """
        if name not in self._built:
            mine = None
            for ranks in groups:
                if ranks == self.world.ranks:
                    group = self.world
                else:
                    handle = _register(dist.new_group(list(ranks), timeout=self.timeout)) if len(ranks) > 1 else None
                    group = Group(handle, tuple(ranks), ranks.index(self.rank) if self.rank in ranks else -1)
                if self.rank in ranks:
                    mine = group
            assert mine is not None, f"rank {self.rank} is in no group of {name}"
            self._built[name] = mine
        return self._built[name]

    def group_named(self, name: str) -> Group:
        """The group of this rank spanning the ranks of the process group torch names `name` (functional
        collectives name theirs). Matched by ranks: DTensor caches sharding decisions by mesh ranks, so
        a model parallelized on an earlier topology's groups over the same ranks may issue on those.
        Resolved once per name: DTensor issues several collectives per block on the same group."""
        if name in self._named:
            return self._named[name]
        ranks = tuple(dist.get_process_group_ranks(_resolve_process_group(name)))
        for group in (self.world, *self._built.values()):
            if group.ranks == ranks:
                self._named[name] = group
                return group
        raise KeyError(f"zeropp: no process group over ranks {ranks} (named {name!r}) on rank {self.rank}")

    def shard_groups(self, hpz_partition_size: int = 1, per_node: bool = False) -> ShardGroups:
        """The groups units shard over, with hpZ's secondary groups for ``zero.hpz_partition_size``
        (built on first use; collective then). `per_node`: each node's data-parallel ranks alone, no
        collective of ZeRO's crossing a node (DiLoCo's replicas: See [Note: the outer loop]); hpZ's
        secondary partition would be the primary one again, so it is off."""
        if per_node:
            alone = Group(None, (self.rank,), 0)
            return ShardGroups(self.intra_node, self.intra_node, alone)
        size = self.layout.hpz_group_size(hpz_partition_size)
        secondary = None
        if size > 1:
            same_as_node = size == self.layout.data_parallel_per_node
            secondary = self.intra_node if same_as_node else self.subgroups(f"hpz{size}", self.layout.hpz_groups(size))
        return ShardGroups(self.data_parallel, self.intra_node, self.inter_node, secondary)

    def expert_shard_groups(self, hpz_group_size: int = 1) -> ShardGroups:
        """The groups expert units shard over: the ranks holding the same experts, with their intra- and
        inter-node parts, and where the dense units' hpZ secondary group (`hpz_group_size` ranks) holds
        more than one rank of the same experts, those ranks as the experts' secondary group (built on
        first use; collective then)."""
        layout = self.layout
        size = layout.expert_hpz_group_size(hpz_group_size)
        secondary = self.subgroups(f"expert_hpz{size}", layout.expert_hpz_groups(hpz_group_size)) if size > 1 else None
        return ShardGroups(
            self.subgroups("expert_data_parallel", layout.expert_data_parallel_groups()),
            self.subgroups("expert_intra_node", layout.expert_intra_node_groups()),
            self.subgroups("expert_inter_node", layout.expert_inter_node_groups()),
            secondary,
        )

    def alone(self) -> Group:
        """This rank alone, with a process group (a DeviceMesh needs one; built on first use by this rank
        only, not collective)."""
        if "alone" not in self._built:
            pg = dist.new_group([self.rank], timeout=self.timeout, use_local_synchronization=True)
            self._built["alone"] = Group(_register(pg), (self.rank,), 0)
        return self._built["alone"]

    def node(self) -> Group:
        """The ranks of this rank's node (built on first use; collective then)."""
        return self.subgroups("node", self.layout.node_groups())


def init_topology(config: TopologyConfig | None = None) -> Topology:
    """Validate the topology against the environment, then initialise torch.distributed and build groups."""
    config = config or TopologyConfig()
    config.validate()
    launch = read_launch_environment(os.environ)  # torchrun's, Open MPI's, PMI's or Slurm's variables
    rank, world_size = launch.rank, launch.world_size
    layout = Layout(
        world_size, config.nodes or launch.nodes or 1, config.tensor_parallel_size, config.context_parallel_size,
        config.expert_parallel_size,
    )  # fmt: skip
    backend = resolve_backend(config)
    if backend == "nccl":
        torch.cuda.set_device(launch.local_rank)
        device = torch.device("cuda", launch.local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        if world_size == 1 and launch.master_addr is None:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
        elif launch.master_addr is not None:  # derived under Slurm: the store reads them from here
            os.environ.setdefault("MASTER_ADDR", launch.master_addr)
            os.environ.setdefault("MASTER_PORT", str(launch.master_port))
        timeout = datetime.timedelta(seconds=config.timeout_s)
        dist.init_process_group(
            backend, store=_attempt_store(rank, world_size, timeout), rank=rank, world_size=world_size, timeout=timeout
        )
    topology = build_topology(layout, rank, device, datetime.timedelta(seconds=config.timeout_s))
    topology.sequence_parallel = config.sequence_parallel
    return topology


def resolve_backend(config: TopologyConfig) -> str:
    """topology.backend made concrete ("auto": NCCL where CUDA is available, else gloo); refuses NCCL
    without CUDA (ConfigError)."""
    if config.backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if config.backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("topology.backend = 'nccl' is not allowed here: no CUDA device; expected 'gloo' or 'auto'")
    return config.backend


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
    """Build the mesh's groups: data-parallel, tensor-parallel, intra-node, inter-node, context- and
    expert-parallel (collective: every rank calls it identically)."""
    # An exit without shutdown() must not leave gloo's threads to the C++ runtime, also where another
    # library (accelerate under the Trainer, Lightning) started the process group: none destroys it.
    atexit.unregister(shutdown)
    atexit.register(shutdown, wait_for_others=False)
    world = Group(_register(dist.group.WORLD), tuple(range(layout.world_size)), rank)
    topo = Topology(layout, rank, device, world, world, world, world, world, world, world, timeout)
    topo.data_parallel = topo.subgroups("data_parallel", layout.data_parallel_groups())
    topo.tensor_parallel = topo.subgroups("tensor_parallel", layout.tensor_parallel_groups())
    topo.intra_node = topo.subgroups("intra_node", layout.intra_node_groups())
    topo.inter_node = topo.subgroups("inter_node", layout.inter_node_groups())
    topo.context_parallel = topo.subgroups("context_parallel", layout.context_parallel_groups())
    topo.expert_parallel = topo.subgroups("expert_parallel", layout.expert_parallel_groups())
    return topo


def shutdown(wait_for_others: bool = True) -> None:
    """Destroy the process groups (gloo's worker threads must be joined before the interpreter exits).

    ``zeropp.shutdown()``; leaving ``with zeropp.init_topology() as topology:`` calls it, and so does
    an exit without either (an atexit hook, which does not wait), since gloo's threads abort a
    process whose groups outlive the interpreter ("terminate called without an active exception").

    With `wait_for_others`, the ranks first meet in a barrier (within topology.timeout_s): a rank that
    tears its connections down while another still reads from them aborts. A failing rank passes
    False, since it cannot count on the others arriving. (The one collective outside comm.)"""
    if not dist.is_initialized():
        return
    if wait_for_others:
        dist.barrier()
    dist.destroy_process_group()
    _PROCESS_GROUPS.clear()  # our references: gloo joins a group's worker threads once none is left
    # A gloo worker thread frees the last collective's work (and its tensors, which takes the GIL) just
    # after the collective completes; torch may still hold a group past this point, so give those
    # threads the GIL before the interpreter finalizes (one holding it then aborts the process).
    time.sleep(GLOO_DRAIN_S)


def free_port() -> int:
    """A TCP port free on this machine now (the kernel picks it)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
