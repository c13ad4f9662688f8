"""The world as the launcher says: torchrun's, Open MPI's, PMI's or Slurm's variables; contradictions in one line;
ranks started with only Slurm's or Open MPI's variables train like torchrun's."""

from __future__ import annotations

import pytest
import torch
from launcher import run_ranks
from models import global_batch, loss_of, make_model, rows

from zeropp.config.launcher import LaunchEnvironment, first_host, read_launch_environment
from zeropp.errors import ConfigError

TORCHRUN = dict(RANK="5", WORLD_SIZE="8", LOCAL_RANK="1", LOCAL_WORLD_SIZE="4", MASTER_ADDR="n1", MASTER_PORT="29500")
SLURM = dict(
    SLURM_PROCID="6", SLURM_NTASKS="8", SLURM_LOCALID="2", SLURM_TASKS_PER_NODE="4(x2)",
    SLURM_JOB_NODELIST="gpu[07-08]", SLURM_JOB_ID="123456",
)  # fmt: skip
OPENMPI = dict(
    OMPI_COMM_WORLD_RANK="3", OMPI_COMM_WORLD_SIZE="4", OMPI_COMM_WORLD_LOCAL_RANK="1",
    OMPI_COMM_WORLD_LOCAL_SIZE="2", MASTER_ADDR="h0", MASTER_PORT="1234",
)  # fmt: skip


def test_each_launcher_read():
    assert read_launch_environment(TORCHRUN) == LaunchEnvironment("torchrun", 5, 8, 1, 4, "n1", 29500)
    assert read_launch_environment(SLURM) == LaunchEnvironment("slurm", 6, 8, 2, 4, "gpu07", 20000 + 123456 % 20000)
    assert read_launch_environment(OPENMPI) == LaunchEnvironment("openmpi", 3, 4, 1, 2, "h0", 1234)
    pmi = dict(PMI_RANK="1", PMI_SIZE="2", MPI_LOCALRANKID="1", MPI_LOCALNRANKS="2", MASTER_ADDR="h", MASTER_PORT="9")
    assert read_launch_environment(pmi) == LaunchEnvironment("pmi", 1, 2, 1, 2, "h", 9)
    assert read_launch_environment({}) == LaunchEnvironment("none", 0, 1, 0, 1, None, None)
    assert read_launch_environment(SLURM).nodes == 2


def test_the_innermost_launcher_wins():
    """srun torchrun (one torchrun per node): Slurm's variables describe the per-node tasks, torchrun's the ranks;
    mpirun inside an sbatch job: the batch step's Slurm variables are not the ranks'."""
    per_node_tasks = dict(SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_LOCALID="0", SLURM_TASKS_PER_NODE="1(x2)")
    assert read_launch_environment({**per_node_tasks, **TORCHRUN}).launcher == "torchrun"
    batch_step = dict(SLURM_PROCID="0", SLURM_NTASKS="4", SLURM_JOB_NODELIST="a[1-2]", SLURM_JOB_ID="7")
    assert read_launch_environment({**batch_step, **OPENMPI}).rank == 3
    assert read_launch_environment({**SLURM, "MASTER_ADDR": "given", "MASTER_PORT": "77"}).master_addr == "given"


@pytest.mark.parametrize(
    "env,fragment",
    [
        (dict(RANK="0"), "sets RANK without WORLD_SIZE"),
        (dict(WORLD_SIZE="2"), "sets WORLD_SIZE without RANK"),
        (dict(RANK="4", WORLD_SIZE="4"), "RANK=4 with WORLD_SIZE=4"),
        (dict(RANK="0", WORLD_SIZE="6", LOCAL_WORLD_SIZE="4"), "LOCAL_WORLD_SIZE=4 with WORLD_SIZE=6"),
        (dict(RANK="0", WORLD_SIZE="4", LOCAL_RANK="2", LOCAL_WORLD_SIZE="2"), "LOCAL_RANK=2 with LOCAL_WORLD_SIZE=2"),
        (dict(RANK="x", WORLD_SIZE="2"), "RANK='x'; expected a whole number"),
        ({**SLURM, "SLURM_TASKS_PER_NODE": "4,2(x2)", "SLURM_NTASKS": "8"}, "nodes with different task counts"),
        ({k: v for k, v in OPENMPI.items() if not k.startswith("MASTER")}, "started by mpirun without MASTER_ADDR"),
        ({k: v for k, v in SLURM.items() if k != "SLURM_JOB_ID"}, "without MASTER_PORT or SLURM_JOB_ID"),
    ],
)
def test_contradictions_are_one_line(env, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")) as error:
        read_launch_environment(env)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "nodelist,first", [("gpu[03-05,07],cpu1", "gpu03"), ("node17", "node17"), ("a-b[9]", "a-b9"), ("x1,x2", "x1")]
)
def test_first_host_of_a_slurm_node_list(nodelist, first):
    assert first_host(nodelist) == first


def _train(steps: int = 3) -> dict:
    import zeropp

    with zeropp.init_topology() as topology:
        engine = zeropp.ZeroEngine(
            make_model("gpt"), torch.optim.AdamW, dict(lr=1e-2), zeropp.ZeroConfig(stage=3), topology
        )
        for step in range(steps):
            x, y = rows(global_batch("gpt", step, 0, topology.world_size), topology.rank)
            engine.backward(loss_of("gpt", engine, x, y))
            engine.step()
        return dict(world=(topology.rank, topology.world_size, topology.nodes), weights=engine.full_state_dict())


@pytest.mark.parametrize("launcher", ["slurm", "openmpi"])
@pytest.mark.parametrize("world,nodes", [(2, 1), (4, 2)])
def test_ranks_started_by_slurm_or_mpi_alone_train_like_torchruns(launcher, world, nodes):
    ours = run_ranks(_train, world, nodes=nodes, launcher=launcher)
    reference = run_ranks(_train, world, nodes=nodes)
    for rank, (got, want) in enumerate(zip(ours, reference, strict=True)):
        assert got["world"] == want["world"] == (rank, world, nodes)
        assert all(torch.equal(got["weights"][k], want["weights"][k]) for k in want["weights"])
