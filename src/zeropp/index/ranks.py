"""The rank layout of the mesh, as pure arithmetic: which global ranks form each group.

Ranks are laid out node-major: rank r lives on node r // ranks_per_node with local index
r % ranks_per_node (torchrun numbers ranks node by node; one machine simulating several nodes does
the same). The world is a (data-parallel x tensor-parallel) grid, the tensor-parallel dimension
innermost: runs of ``tensor_parallel_size`` consecutive ranks, inside one node. Everything ZeRO
uses is derived from one data-parallel group's ranks, so it follows that group's own node structure
(:mod:`zeropp.topology` builds the process groups from these lists, the estimator prices them).

Context parallelism (Ulysses) is a cut of each data-parallel group, not a dimension beside it: runs
of ``context_parallel_size`` consecutive members, inside one node, read the same sequences and hold
one slice of each; ZeRO still shards over the whole data-parallel group (DeepSpeed's layout), so
model states per rank shrink with it. The groups reading different data are the data-parallel
group's members divided by the context-parallel size (:meth:`Layout.reader`).

Expert parallelism is a cut of each data-parallel group too: runs of ``expert_parallel_size``
consecutive members, inside one node, split each mixture-of-experts layer's experts between them
and send tokens to them by all-to-all; they read different data. The members holding the same
experts (every E-th member of a data-parallel group: the expert-data-parallel group) shard those
experts ZeRO's way, while dense parameters shard over the whole data-parallel group (DeepSpeed-MoE's
and torchtitan's layout).
"""

from __future__ import annotations

from dataclasses import dataclass

from zeropp.errors import ConfigError

RankGroups = list[tuple[int, ...]]  # disjoint groups of global ranks covering the world, in a fixed order


@dataclass(frozen=True)
class Layout:
    """Pure rank arithmetic: no process groups, so it can be unit-tested and used by the estimator."""

    world_size: int
    nodes: int
    tensor_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.nodes < 1 or self.world_size % self.nodes:
            raise ConfigError(
                f"topology.nodes = {self.nodes} does not divide world size {self.world_size}; "
                f"allowed: a divisor of {self.world_size}"
            )
        tp, per_node = self.tensor_parallel_size, self.ranks_per_node
        if tp < 1 or per_node % tp:
            raise ConfigError(
                f"topology.tensor_parallel_size = {tp} does not divide the {per_node} ranks per node "
                f"({self.world_size} ranks on {self.nodes} node(s)); allowed: a divisor of {per_node}"
            )
        cp, dp_per_node = self.context_parallel_size, per_node // tp
        if cp < 1 or dp_per_node % cp:
            raise ConfigError(
                f"topology.context_parallel_size = {cp} does not divide the {dp_per_node} data-parallel ranks per "
                f"node ({self.world_size} ranks on {self.nodes} node(s), tensor parallel {tp}); allowed: a divisor "
                f"of {dp_per_node} (its all-to-alls stay inside a node)"
            )
        ep = self.expert_parallel_size
        if ep < 1 or dp_per_node % ep:
            raise ConfigError(
                f"topology.expert_parallel_size = {ep} does not divide the {dp_per_node} data-parallel ranks per "
                f"node ({self.world_size} ranks on {self.nodes} node(s), tensor parallel {tp}); allowed: a divisor "
                f"of {dp_per_node} (its all-to-alls stay inside a node)"
            )

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nodes

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def tensor_parallel_groups(self) -> RankGroups:
        """Runs of tensor_parallel_size consecutive ranks (inside one node, since it divides a node's ranks)."""
        tp = self.tensor_parallel_size
        return [tuple(range(start, start + tp)) for start in range(0, self.world_size, tp)]

    def node_groups(self) -> RankGroups:
        """The ranks of each node: DiLoCo's replicas (``zero.outer``), each training alone between syncs."""
        per_node = self.ranks_per_node
        return [tuple(range(start, start + per_node)) for start in range(0, self.world_size, per_node)]

    def data_parallel_groups(self) -> RankGroups:
        """The ranks with the same tensor-parallel index, one group per index (see the module docstring)."""
        tp = self.tensor_parallel_size
        return [tuple(range(index, self.world_size, tp)) for index in range(tp)]

    def context_parallel_groups(self) -> RankGroups:
        """Every data-parallel group cut into runs of context_parallel_size consecutive members (inside
        one node, since the size divides a node's data-parallel ranks): the ranks sharing sequences."""
        cp = self.context_parallel_size
        return [ranks[i : i + cp] for ranks in self.data_parallel_groups() for i in range(0, len(ranks), cp)]

    def expert_parallel_groups(self) -> RankGroups:
        """Every data-parallel group cut into runs of expert_parallel_size consecutive members (inside one
        node): the ranks splitting each layer's experts between them."""
        ep = self.expert_parallel_size
        return [ranks[i : i + ep] for ranks in self.data_parallel_groups() for i in range(0, len(ranks), ep)]

    def expert_data_parallel_groups(self) -> RankGroups:
        """Every E-th member of each data-parallel group: the ranks holding the same experts, which shard them."""
        ep = self.expert_parallel_size
        return [ranks[i::ep] for ranks in self.data_parallel_groups() for i in range(ep)]

    def expert_intra_node_groups(self) -> RankGroups:
        """The expert-data-parallel groups cut by node (qgZ's first hop over experts)."""
        return self._by_node(self.expert_data_parallel_groups())

    def expert_inter_node_groups(self) -> RankGroups:
        """The expert-data-parallel groups cut by position inside the node: one rank per node."""
        return self._by_position(self.expert_data_parallel_groups())

    def expert_hpz_group_size(self, hpz_group_size: int) -> int:
        """hpZ's secondary group size for experts units where the dense units' is `hpz_group_size`: the
        ranks of one dense secondary group holding the same experts; 1 (hpZ off for experts) where
        that is one rank or E does not divide the group."""
        ep = self.expert_parallel_size
        return hpz_group_size // ep if hpz_group_size % ep == 0 else 1

    def expert_hpz_groups(self, hpz_group_size: int) -> RankGroups:
        """Every dense hpZ secondary group's ranks holding the same experts (every E-th member)."""
        ep = self.expert_parallel_size
        return [ranks[i::ep] for ranks in self.hpz_groups(hpz_group_size) for i in range(ep)]

    def reader(self, rank: int) -> tuple[int, int]:
        """(which of the data-parallel group's readers `rank` is, how many readers there are): the
        members of one context-parallel group read the same rows, each its own slice of them."""
        members = next(ranks for ranks in self.data_parallel_groups() if rank in ranks)
        cp = self.context_parallel_size
        return members.index(rank) // cp, len(members) // cp

    def data_parallel_layout(self) -> Layout:
        """One data-parallel group seen as a world of its own on the same nodes (its ranks are
        node-major too): what the traffic model prices ZeRO's collectives on."""
        return Layout(self.data_parallel_size, self.nodes)

    def one_node(self) -> Layout:
        """One node as a world of its own (the same tensor-parallel size): what each of DiLoCo's replicas
        trains on (See [Note: the outer loop])."""
        return Layout(
            self.ranks_per_node, 1, self.tensor_parallel_size, self.context_parallel_size, self.expert_parallel_size
        )

    @property
    def data_parallel_size(self) -> int:
        return len(self.data_parallel_groups()[0])

    @property
    def data_parallel_per_node(self) -> int:
        """Ranks of one data-parallel group on each node."""
        return self.data_parallel_size // self.nodes

    def intra_node_groups(self) -> RankGroups:
        """Every data-parallel group cut by node."""
        return self._by_node(self.data_parallel_groups())

    def inter_node_groups(self) -> RankGroups:
        """Every data-parallel group cut by position inside the node: one rank per node."""
        return self._by_position(self.data_parallel_groups())

    def _by_node(self, groups: RankGroups) -> RankGroups:
        """Each of `groups` cut by node."""
        return [tuple(r for r in ranks if self.node_of(r) == node) for ranks in groups for node in range(self.nodes)]

    def _by_position(self, groups: RankGroups) -> RankGroups:
        """Each of `groups` (its ranks spread evenly over the nodes) cut by position inside the node."""
        per_node = len(groups[0]) // self.nodes
        return [ranks[i::per_node] for ranks in groups for i in range(per_node)]

    def hpz_group_size(self, partition_size: int) -> int:
        """hpZ's secondary group size for ``zero.hpz_partition_size`` (0: one node's data-parallel
        ranks), 1 when hpZ is off. A group as large as the data-parallel group would be the primary
        partition again (more memory, no fewer bytes), so that is off too. A group never straddles
        part of a node: it is whole nodes or divides one node's ranks. On one node a size that fits
        no such group is off too (:meth:`hpz_note` says so): hpZ saves inter-node traffic only."""
        world = self.data_parallel_size
        if partition_size < 0:
            raise ConfigError(
                f"zero.hpz_partition_size = {partition_size!r} is not allowed; expected an integer >= 0",
                "zero.hpz_partition_size", partition_size,
            )  # fmt: skip
        size = partition_size or self.data_parallel_per_node
        if size not in self.hpz_sizes():
            if self.nodes > 1:
                raise ConfigError(self._hpz_misfit(partition_size), "zero.hpz_partition_size", partition_size)
            size = world
        return 1 if size == world else size

    def hpz_sizes(self) -> list[int]:
        """The group sizes hpZ can use: the divisors of one node's data-parallel ranks and the whole
        nodes that divide the data-parallel world (the world itself is the primary partition)."""
        per_node, world = self.data_parallel_per_node, self.data_parallel_size
        return [
            size for size in range(1, world + 1) if world % size == 0 and (per_node % size == 0 or size % per_node == 0)
        ]

    def hpz_note(self, partition_size: int) -> str | None:
        """One line when hpZ was asked for (a size other than 0 and 1) and is off here."""
        if partition_size in (0, 1) or self.hpz_group_size(partition_size) > 1:
            return None
        world = self.data_parallel_size
        if self.nodes == 1:
            why = f"all {world} data-parallel ranks are on one node, where it saves no inter-node traffic"
        else:
            why = f"a group of all {world} data-parallel ranks is the primary partition; {self._hpz_fit(partition_size)} would work"
        return f"zero.hpz_partition_size = {partition_size}: hpZ is off, {why}"

    def _hpz_fit(self, partition_size: int) -> int:
        """The largest useful hpZ group size up to `partition_size`."""
        return max(size for size in self.hpz_sizes()[:-1] if size <= partition_size)

    def _hpz_misfit(self, partition_size: int) -> str:
        """Why `partition_size` fits no hpZ group here, with the node size zeropp sees and what would fit."""
        per_node, world = self.data_parallel_per_node, self.data_parallel_size
        return (
            f"zero.hpz_partition_size = {partition_size!r} is not allowed; zeropp sees {self.nodes} nodes of {per_node} "
            f"data-parallel ranks ({world} in all), and an hpZ group divides a node's ranks or is whole nodes dividing "
            f"all {world}: expected one of {', '.join(map(str, self.hpz_sizes()[:-1]))} (0: one node); "
            f"{self._hpz_fit(partition_size)} would work"
        )

    def hpz_groups(self, size: int) -> RankGroups:
        """Every data-parallel group cut into consecutive runs of `size` ranks (hpZ's secondary groups)."""
        return [ranks[i : i + size] for ranks in self.data_parallel_groups() for i in range(0, len(ranks), size)]
