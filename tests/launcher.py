"""Run a function on N real gloo ranks (forked processes) and collect what each rank returns."""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch

TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn: Callable, rank: int, world: int, nodes: int, port: int, queue: mp.Queue, kwargs: dict) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank % (world // nodes)),
        LOCAL_WORLD_SIZE=str(world // nodes),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
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


def run_ranks(fn: Callable[..., Any], world: int, nodes: int = 1, start: str = "fork", **kwargs: Any) -> list[Any]:
    """Start `world` processes that look like torchrun's ranks on `nodes` nodes; return results by rank.
    `start`: "spawn" where a rank uses CUDA (a forked child cannot once the parent initialized it)."""
    ctx = mp.get_context(start)
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world, nodes, port, queue, kwargs)) for r in range(world)]
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
