"""Where this process sits in the world, as its launcher says: torchrun's, Open MPI's, PMI's or Slurm's variables.

The process's own launcher is the innermost one whose variables are present, read in this order:

- torchrun (and anything that sets its variables): ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``. ``srun torchrun ...`` (one torchrun per
  node) lands here: Slurm's variables then describe the per-node tasks, not the ranks;
- Open MPI's ``mpirun``: ``OMPI_COMM_WORLD_RANK``, ``_SIZE``, ``_LOCAL_RANK``, ``_LOCAL_SIZE``;
- PMI (MPICH's Hydra, Intel MPI, ``srun --mpi=pmi2``): ``PMI_RANK``, ``PMI_SIZE``, with
  ``MPI_LOCALRANKID`` / ``MPI_LOCALNRANKS`` for the node;
- Slurm's ``srun``, one task per rank: ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``,
  ``SLURM_NTASKS_PER_NODE`` (or ``SLURM_TASKS_PER_NODE``), the job's first node
  (``SLURM_JOB_NODELIST``) as the rendezvous address when ``MASTER_ADDR`` is unset, and a port
  derived from ``SLURM_JOB_ID`` when ``MASTER_PORT`` is unset (every task of the job derives the same).

MPI launchers say nothing about a rendezvous address: ``MASTER_ADDR`` and ``MASTER_PORT`` must be
exported to the ranks (``mpirun -x MASTER_ADDR=... -x MASTER_PORT=...``). A launcher whose own
variables contradict each other (a rank outside the world, a node size that does not divide it,
half of torchrun's variables) is refused in one line naming the variables, before any process
group is made.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from zeropp.errors import ConfigError

SLURM_PORT_BASE, SLURM_PORT_SPAN = 20000, 20000  # ports derived from the job id: 20000-39999


@dataclass(frozen=True)
class LaunchEnvironment:
    launcher: str  # "torchrun", "openmpi", "pmi", "slurm" or "none" (one process)
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int | None  # None: not told (one node assumed where it matters)
    master_addr: str | None
    master_port: int | None

    @property
    def nodes(self) -> int | None:
        return self.world_size // self.local_world_size if self.local_world_size else None


def read_launch_environment(env: Mapping[str, str]) -> LaunchEnvironment:
    """The process's place in the world from `env` (``os.environ``); ConfigError on a contradiction."""
    torchrun = [name for name in ("RANK", "WORLD_SIZE") if name in env]
    if len(torchrun) == 1:
        missing = "WORLD_SIZE" if torchrun == ["RANK"] else "RANK"
        raise ConfigError(f"the environment sets {torchrun[0]} without {missing}; a launcher sets both (torchrun does)")
    master = env.get("MASTER_ADDR"), _integer(env, "MASTER_PORT")
    if torchrun:
        return _checked("torchrun", env, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", *master)
    if "OMPI_COMM_WORLD_RANK" in env:
        names = (
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "OMPI_COMM_WORLD_LOCAL_SIZE",
        )
        return _with_address(_checked("openmpi", env, *names, *master), "mpirun")
    if "PMI_RANK" in env:
        names = ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
        return _with_address(_checked("pmi", env, *names, *master), "the MPI launcher")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return _slurm(env, *master)
    return LaunchEnvironment("none", 0, 1, 0, 1, *master)


def _integer(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    if value is None or value == "":
        return None
    if not value.strip().isdigit():
        raise ConfigError(f"the environment sets {name}={value!r}; expected a whole number")
    return int(value)


def _checked(
    launcher: str,
    env: Mapping[str, str],
    rank_name: str,
    world_name: str,
    local_rank_name: str,
    local_size_name: str,
    master_addr: str | None,
    master_port: int | None,
    local_world_size: int | None = None,
) -> LaunchEnvironment:
    rank, world = _integer(env, rank_name), _integer(env, world_name)
    if world is None or world < 1:
        raise ConfigError(
            f"the environment sets {rank_name} but {world_name} is {env.get(world_name)!r}; expected a world size >= 1"
        )
    local_rank = _integer(env, local_rank_name)
    local_size = local_world_size if local_world_size is not None else _integer(env, local_size_name)
    if rank is None or rank >= world:
        raise ConfigError(
            f"the environment sets {rank_name}={rank} with {world_name}={world}; a rank is below the world size"
        )
    if local_size is not None and (local_size < 1 or world % local_size):
        raise ConfigError(
            f"the environment sets {local_size_name}={local_size} with {world_name}={world}; "
            "ranks per node must divide the world size"
        )
    if local_rank is not None and local_size is not None and local_rank >= local_size:
        raise ConfigError(
            f"the environment sets {local_rank_name}={local_rank} with {local_size_name}={local_size}; "
            "a local rank is below the ranks per node"
        )
    default_local = rank % local_size if local_size else 0
    return LaunchEnvironment(
        launcher, rank, world, default_local if local_rank is None else local_rank, local_size, master_addr, master_port
    )


def _with_address(found: LaunchEnvironment, launcher: str) -> LaunchEnvironment:
    if found.world_size > 1 and (found.master_addr is None or found.master_port is None):
        raise ConfigError(
            f"started by {launcher} without MASTER_ADDR and MASTER_PORT: export them to every rank "
            "(mpirun -x MASTER_ADDR=<first host> -x MASTER_PORT=<free port>)"
        )
    return found


def _slurm(env: Mapping[str, str], master_addr: str | None, master_port: int | None) -> LaunchEnvironment:
    per_node = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    counts = _task_counts(per_node) if per_node else [None]
    if len(set(counts)) > 1:
        raise ConfigError(
            f"the environment sets SLURM_TASKS_PER_NODE={per_node!r}: nodes with different task counts; "
            "zeropp needs the same ranks on every node (sbatch --ntasks-per-node)"
        )
    found = _checked(
        "slurm", env, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE",
        master_addr, master_port, local_world_size=counts[0],
    )  # fmt: skip
    if found.world_size == 1:
        return found
    if master_addr is None:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not nodelist:
            raise ConfigError("started by srun without MASTER_ADDR or SLURM_JOB_NODELIST: export MASTER_ADDR")
        master_addr = first_host(nodelist)
    if master_port is None:
        job = _integer(env, "SLURM_JOB_ID")
        if job is None:
            raise ConfigError("started by srun without MASTER_PORT or SLURM_JOB_ID: export MASTER_PORT")
        master_port = SLURM_PORT_BASE + job % SLURM_PORT_SPAN
    return LaunchEnvironment("slurm", found.rank, found.world_size, found.local_rank, found.local_world_size,
                             master_addr, master_port)  # fmt: skip


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list: ``gpu[03-05,07],cpu1`` -> ``gpu03``."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if match is None:
        raise ConfigError(f"the environment sets SLURM_JOB_NODELIST={nodelist!r}; expected a Slurm host list")
    prefix, ranges = match.groups()
    return prefix + ranges.split(",")[0].split("-")[0] if ranges else prefix


def _task_counts(per_node: str) -> list[int]:
    """``2(x3),1`` -> [2, 2, 2, 1] (Slurm's SLURM_TASKS_PER_NODE)."""
    counts = []
    for part in per_node.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise ConfigError(f"the environment sets SLURM_TASKS_PER_NODE={per_node!r}; expected e.g. '4(x2)'")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts
