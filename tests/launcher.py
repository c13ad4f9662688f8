"""Run a function on N real gloo ranks (forked processes) and collect what each rank returns."""

from __future__ import annotations

import importlib.util
import io
import multiprocessing as mp
import os
import socket
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

TIMEOUT_S = 240
# What a "forkserver" rank's server imports once, before it forks any rank: the libraries a rank of the
# integration tests imports anyway (each took about 6 s of CPU in every rank started fresh).
PRELOAD = ("torch", "zeropp", "zeropp.cli", "transformers", "accelerate", "peft", "trl", "lightning")


def forkserver() -> mp.context.ForkServerContext:
    """The context whose processes fork from a server that imported PRELOAD (those installed) once."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([name for name in PRELOAD if importlib.util.find_spec(name.split(".")[0]) is not None])
    return ctx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    tasks = Path(f"/proc/{pid}/task")
    return [int(c) for t in tasks.iterdir() for c in (t / "children").read_text().split()] if tasks.exists() else []


def rank_pids(launcher_pid: int) -> list[int]:
    """The ranks ``zeropp train`` (process `launcher_pid`) runs: the children of its fork server."""
    return [rank for child in children(launcher_pid) for rank in children(child)]


TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launcher_env(launcher: str, rank: int, world: int, nodes: int, port: int) -> dict[str, str]:
    """The variables `launcher` gives rank `rank` of `world` on `nodes` nodes (this machine's loopback)."""
    per_node = world // nodes
    if launcher == "torchrun":
        values = (rank, world, rank % per_node, per_node, "127.0.0.1", port)
        return dict(zip(TORCHRUN, map(str, values), strict=True))
    if launcher == "slurm":  # srun, one task per rank; the rendezvous address from the node list
        return dict(
            SLURM_PROCID=str(rank), SLURM_NTASKS=str(world), SLURM_LOCALID=str(rank % per_node),
            SLURM_TASKS_PER_NODE=f"{per_node}(x{nodes})", SLURM_JOB_NODELIST="localhost", MASTER_PORT=str(port),
            SLURM_JOB_ID="4242",
        )  # fmt: skip
    if launcher == "openmpi":
        return dict(
            OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_SIZE=str(world), OMPI_COMM_WORLD_LOCAL_RANK=str(rank % per_node),
            OMPI_COMM_WORLD_LOCAL_SIZE=str(per_node), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        )  # fmt: skip
    raise ValueError(launcher)


def _worker(
    fn: Callable,
    rank: int,
    world: int,
    nodes: int,
    port: int,
    queue: mp.Queue,
    kwargs: dict,
    launcher: str = "torchrun",
) -> None:
    for name in TORCHRUN:
        os.environ.pop(name, None)
    os.environ.update(launcher_env(launcher, rank, world, nodes, port))
    torch.set_num_threads(1)
    try:
        queue.put((rank, "ok", _serialize(fn(**kwargs))))
    except BaseException:  # report any failure to the parent instead of hanging it
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _serialize(value: Any) -> bytes:
    """Results travel as torch.save bytes: tensors in a multiprocessing queue would be passed as
    shared-memory handles that die with the rank's process."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def run_ranks(
    fn: Callable[..., Any], world: int, nodes: int = 1, start: str = "fork", launcher: str = "torchrun", **kwargs: Any
) -> list[Any]:
    """Start `world` processes that look like `launcher`'s ranks (torchrun, slurm, openmpi) on `nodes`
    nodes; return results by rank. `start`: "fork" (the default: the cheapest), "spawn" where a rank
    uses CUDA (a forked child cannot once the parent initialized it), "forkserver" where the pytest
    process's threads must not reach the rank (an OpenMP pool started before a fork deadlocks the
    child's first parallel region) but its imports should: ranks fork from a server that imported
    PRELOAD once, and ran no torch operation."""
    ctx = forkserver() if start == "forkserver" else mp.get_context(start)
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world, nodes, port, queue, kwargs, launcher)) for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world):
            rank, status, value = queue.get(timeout=TIMEOUT_S)
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]
