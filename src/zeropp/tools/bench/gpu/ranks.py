"""Ranks for ``zeropp bench gpu``: several processes sharing one device, and the collective probe.

:func:`launch` starts `world` processes from a fork server (not forked from this process: a forked
child cannot use CUDA once its parent did; the server imported torch and the measures once and never
touched CUDA, so its children can, and skip the imports: about 2 s of CPU per rank), each a rank of a
process group on `backend` whose tensors live on `device` (every rank on the same GPU,
or the CPU), and returns what a function returned on each rank. :func:`probe` tries every
collective zeropp issues on such a group.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from zeropp.app.launch import usable_cpus
from zeropp.index.ranks import Layout
from zeropp.topology import Topology, build_topology, free_port, shutdown

GROUP_TIMEOUT_S = 60
DEAD_GRACE_S = 3


def first_line(error: BaseException | str) -> str:
    """The first non-empty line of an error (its type named), at most 300 characters."""
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return (lines[0] if lines else "unknown error")[:300]


def rank_topology(backend: str, device_kind: str, rank: int, world: int, nodes: int) -> Topology:
    """Join the process group (the environment's rendezvous) and build zeropp's topology with its
    tensors on `device_kind` ("cuda": device 0, shared by every rank)."""
    device = torch.device("cuda", 0) if device_kind == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
    return build_topology(Layout(world, nodes), rank, device, timeout)


def _child(fn: Callable, rank: int, world: int, nodes: int, port: int, setup: tuple, results: Any, kwargs: dict):
    backend, device_kind = setup
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE=str(world // nodes),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    torch.set_num_threads(max(1, usable_cpus() // world))
    ok = False
    try:
        topology = rank_topology(backend, device_kind, rank, world, nodes)
        results.put((rank, "ok", fn(topology, **kwargs)))
        ok = True
    except BaseException as error:  # the parent records it and goes on
        results.put((rank, "error", first_line(error) + "\n" + traceback.format_exc()[-2000:]))
    finally:
        if dist.is_initialized():
            shutdown(wait_for_others=ok)


def launch(
    fn: Callable[..., Any], world: int, backend: str, device_kind: str, timeout_s: float, nodes: int = 1, **kwargs: Any
) -> list[Any]:
    """`fn(topology, **kwargs)` on `world` ranks; their results by rank. Raises RuntimeError
    (one line: the first rank's error, or a timeout) when a rank fails or hangs."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["zeropp.tools.bench.gpu.measures"])  # fn's module, torch and zeropp with it
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(fn, r, world, nodes, port, (backend, device_kind), results, kwargs))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    by_rank: dict[int, Any] = {}
    deadline, dead_since = time.monotonic() + timeout_s, {}
    try:
        while len(by_rank) < world:
            try:
                rank, status, value = results.get(timeout=1)
            except queue.Empty:
                _check_alive(procs, by_rank, deadline, f"{backend} world {world}", dead_since)
                continue
            if status == "error":
                raise RuntimeError(f"{backend} world {world} rank {rank}: {first_line(value)}")
            by_rank[rank] = value
    finally:
        failed = len(by_rank) < world  # the others may wait in a collective for ever: no grace
        for p in procs:
            if failed and p.is_alive():
                p.kill()
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [by_rank[r] for r in range(world)]


def _check_alive(procs: list, answered: dict[int, Any], deadline: float, what: str, dead_since: dict) -> None:
    """Raise (one line) once a rank that has not answered is dead for a few seconds (its answer may
    still be on its way through the queue), e.g. after a CUDA abort, or once time is up."""
    now = time.monotonic()
    for rank, p in enumerate(procs):
        if rank not in answered and p.exitcode is not None:
            if now - dead_since.setdefault(rank, now) > DEAD_GRACE_S:
                raise RuntimeError(f"{what}: rank {rank} died (exit code {p.exitcode}) without an answer")
    if now > deadline:
        raise RuntimeError(f"{what}: no answer within the time left")


def _collectives(device: torch.device, world: int, rank: int) -> dict[str, Callable[[bool], Any]]:
    """Each collective zeropp uses, as a call taking async_op."""
    n = 8
    mine = torch.full((n,), float(rank + 1), device=device)
    return {
        "all_gather_into_tensor": lambda a: dist.all_gather_into_tensor(
            torch.empty(world * n, device=device), mine, async_op=a
        ),
        "reduce_scatter_tensor": lambda a: dist.reduce_scatter_tensor(
            torch.empty(n // world, device=device), mine.clone(), async_op=a
        ),
        "all_reduce": lambda a: dist.all_reduce(mine.clone(), async_op=a),
        "all_to_all_single": lambda a: dist.all_to_all_single(torch.empty(n, device=device), mine, async_op=a),
        "broadcast": lambda a: dist.broadcast(mine.clone(), src=0, async_op=a),
    }


def probe(topology: Topology) -> dict[str, str]:
    """{collective (and ``... async``): "ok" or the error's first line} on this group's device."""
    device, out = topology.device, {}
    for name, call in _collectives(device, topology.world_size, topology.rank).items():
        for async_op in (False, True):
            key = f"{name} async" if async_op else name
            try:
                work = call(async_op)
                if async_op:
                    work.wait()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                out[key] = "ok"
            except Exception as error:  # the probe's answer: what this backend refuses
                out[key] = first_line(error)
    return out


def probe_backends(device_kind: str, timeout_s: float) -> dict[str, dict[str, str] | str]:
    """For gloo and nccl: {collective: "ok" or error} on 2 ranks sharing the device, or why none ran."""
    answers: dict[str, dict[str, str] | str] = {}
    for backend in ("nccl", "gloo"):
        if backend == "nccl" and (device_kind != "cuda" or not dist.is_nccl_available()):
            answers[backend] = "not available here"
            continue
        try:
            answers[backend] = launch(probe, 2, backend, device_kind, timeout_s)[0]
        except RuntimeError as error:
            answers[backend] = first_line(error)
    return answers


def working_backend(answers: dict[str, dict[str, str] | str]) -> str | None:
    """The first backend whose every probed collective worked (nccl before gloo), or None."""
    for backend, answer in answers.items():
        if isinstance(answer, dict) and all(v == "ok" for v in answer.values()):
            return backend
    return None
