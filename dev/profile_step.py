"""Where each rank's time goes in a ZeRO-3 and a ZeRO++ step at world 4 (2 nodes x 2 on loopback, gloo).

The small GPT of ``zeropp bench cluster`` (fp32, one sequence of 128 tokens per rank, AdamW); after
warm-up steps, each rank runs the timed steps under cProfile and reports its median step time, its mean CPU time per step (all its threads) and
its functions by own time. Not a benchmark: the profiler slows Python-heavy code more than the
kernels; compare the rows of one variant with the other's.

    PYTHONPATH=src python dev/profile_step.py [--steps 10] [--top 25] [--variants zero3 zeropp]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import multiprocessing as mp
import os
import pstats
import socket
import statistics
import time

import torch

WORLD, NODES = 4, 2
VARIANTS = {
    "zero3": dict(stage=3),
    "zeropp": dict(stage=3, quantized_weights=True, hpz_partition_size=0, quantized_gradients=True),
    "zeropp-intra8": dict(
        stage=3, quantized_weights=True, hpz_partition_size=0, quantized_gradients=True, gradient_intra_node_bits=8
    ),
    "zeropp-intra0": dict(
        stage=3, quantized_weights=True, hpz_partition_size=0, quantized_gradients=True, gradient_intra_node_bits=0
    ),
    "zeropp-1chunk": dict(
        stage=3, quantized_weights=True, hpz_partition_size=0, quantized_gradients=True, qgz_pipeline_chunks=1
    ),
    "qwz+hpz": dict(stage=3, quantized_weights=True, hpz_partition_size=0),
    "qgz": dict(stage=3, quantized_gradients=True),
}


def _rank(variant: str, steps: int, warmup: int, top: int, profile: bool) -> dict:
    import zeropp
    from zeropp.app.models.gpt import GPT, PRESETS

    topology = zeropp.init_topology(zeropp.TopologyConfig())
    try:
        torch.manual_seed(0)
        model = GPT(PRESETS["small"])
        engine = zeropp.ZeroEngine(model, torch.optim.AdamW, dict(lr=1e-3), zeropp.ZeroConfig(**VARIANTS[variant]), topology)
        gen = torch.Generator().manual_seed(topology.rank)
        batches = [torch.randint(0, 256, (1, 129), generator=gen) for _ in range(warmup + steps)]
        times, cpu = [], []
        profiler = cProfile.Profile(time.thread_time)  # the main thread's CPU time: waits cost nothing
        for i, batch in enumerate(batches):
            timed = i >= warmup
            if timed and profile:
                profiler.enable()
            start, start_cpu = time.perf_counter(), time.process_time()
            loss = engine(batch[:, :-1], batch[:, 1:])
            engine.backward(loss)
            engine.step()
            if timed:
                times.append(time.perf_counter() - start)
                cpu.append(time.process_time() - start_cpu)
            if timed and profile:
                profiler.disable()
        out = io.StringIO()
        if profile:
            pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
        return {"median_s": statistics.median(times), "cpu_s": statistics.mean(cpu), "profile": out.getvalue()}
    finally:
        zeropp.shutdown()


def _worker(variant, steps, warmup, top, profile, rank, port, queue):
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank % (WORLD // NODES)),
        LOCAL_WORLD_SIZE=str(WORLD // NODES), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    torch.set_num_threads(1)
    queue.put((rank, _rank(variant, steps, warmup, top, profile)))


def run(variant: str, steps: int, warmup: int, top: int, profile: bool) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_worker, args=(variant, steps, warmup, top, profile, r, port, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    out = dict(queue.get(timeout=600) for _ in range(WORLD))
    for p in procs:
        p.join(timeout=30)
    return [out[r] for r in range(WORLD)]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--rounds", type=int, default=1, help="untimed-profile rounds, variants alternating")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--no-profile", action="store_true")
    args = parser.parse_args()
    for round_ in range(args.rounds):
        for variant in args.variants:
            ranks = run(variant, args.steps, args.warmup, args.top, not args.no_profile)
            medians = [f"{r['median_s']:.3f}" for r in ranks]
            cpu = [f"{r['cpu_s']:.3f}" for r in ranks]
            print(f"== {variant} round {round_}: median step per rank {medians}, CPU s per step {cpu}", flush=True)
            if not args.no_profile and round_ == 0:
                print(ranks[0]["profile"], flush=True)
