"""``zeropp bench sequence``: what the collective-sequence check costs per step (digest and comparison).

``--world`` ranks (4, gloo, 2 simulated nodes) train the embedded GPT (``--n-layer`` x ``--d-model``)
at stage 3 and with ZeRO++ (qwZ, hpZ over a node, qgZ). Steps alternate: *on* traces every
collective into the running digest, *off* replaces the trace by a no-op. The comparison itself (one
all-gather of 16 bytes per rank) is timed apart, ``--checks`` times, and charged per step at the
default ``zero.sequence_check_interval`` (100). Reported per variant: median step time on and off,
their difference, the collectives per step, the digest's own time per collective timed in isolation
(collectives x that time: the digest's floor) and the check's share of a step.

    zeropp bench sequence [--world 4] [--n-layer 4] [--d-model 128] [--pairs 15] [--checks 20]
                          [--out results/bench_sequence.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
import timeit
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from zeropp.comm.trace import CollectiveTrace, Entry
from zeropp.tools.bench.runs import cpu_model, output_file

VARIANTS = {
    "stage 3": {"stage": 3},
    "ZeRO++": {"stage": 3, "quantized_weights": True, "hpz_partition_size": 0, "quantized_gradients": True},
}
_NOTHING = Entry(0, "", 0, "", "", "", 0, 0, 0.0)


def _untraced(op: str, phase: str, nbytes: int, group: str = "") -> Entry:
    return _NOTHING


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from zeropp.app.models.gpt import GPT, GPTConfig
    from zeropp.comm.sequence import check_sequences
    from zeropp.config.sections import TopologyConfig, ZeroConfig
    from zeropp.engine import ZeroEngine
    from zeropp.topology import init_topology, shutdown

    topology = init_topology(TopologyConfig(nodes=2))
    results = {}
    for name, zero in VARIANTS.items():
        torch.manual_seed(0)
        model = GPT(GPTConfig(block_size=64, n_layer=args.n_layer, n_head=4, d_model=args.d_model))
        engine = ZeroEngine(model, torch.optim.AdamW, dict(lr=1e-3), ZeroConfig(**zero), topology)
        trace, traced = engine.comm.trace, engine.comm.trace.issue
        times: dict[str, list[float]] = {"on": [], "off": []}
        counts = []
        for i in range(2 * args.pairs + 2):
            on = i % 2 == 0
            trace.issue = traced if on else _untraced
            engine.config.sequence_check_interval = 0
            x = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(i))
            before = trace.count
            tick = time.perf_counter()
            engine.backward(engine(x, x))
            engine.step()
            seconds = time.perf_counter() - tick
            if i >= 2:  # the first pair warms up
                times["on" if on else "off"].append(seconds)
                if on:
                    counts.append(trace.count - before)
        tick = time.perf_counter()
        for _ in range(args.checks):
            check_sequences(engine.comm, engine.global_step)
        check = (time.perf_counter() - tick) / args.checks
        results[name] = dict(times=times, collectives_per_step=statistics.median(counts), check_s=check)
    if rank == 0:
        out.put(results)
    shutdown()


def issue_seconds() -> float:
    """One digest update (CollectiveTrace.issue) on a typical label, timed in isolation."""
    trace = CollectiveTrace(0, 4)
    n = 20000
    return timeit.timeit(lambda: trace.issue("all_gather", "forward", 1 << 20, "data_parallel"), number=n) / n


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zeropp bench sequence", description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--pairs", type=int, default=15, help="on/off step pairs timed (after one of warm-up)")
    parser.add_argument("--checks", type=int, default=20, help="comparisons timed per variant")
    parser.add_argument("--out", type=Path, default=Path("results/bench_sequence.json"))
    args = parser.parse_args(argv)
    args.out = output_file(parser, args.out, "bench_sequence.json")
    from zeropp.topology import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, args.world, port, args, queue)) for r in range(args.world)]
    for p in procs:
        p.start()
    results = queue.get(timeout=1800)
    for p in procs:
        p.join()
    per_issue = issue_seconds()
    rows = {}
    print(
        f"world {args.world}, GPT {args.n_layer} x {args.d_model}; digest update {per_issue * 1e6:.2f} us per collective"
    )
    print(
        f"{'variant':<10}{'off (ms)':>10}{'on (ms)':>10}{'on-off':>9}{'colls':>7}{'digest':>9}{'check (ms)':>12}{'check/100':>11}"
    )
    for name, r in results.items():
        off, on = statistics.median(r["times"]["off"]), statistics.median(r["times"]["on"])
        floor = r["collectives_per_step"] * per_issue
        rows[name] = dict(
            off_step_s=off, on_step_s=on, difference=(on - off) / off, collectives_per_step=r["collectives_per_step"],
            digest_s_per_step=floor, digest_share=floor / off, check_s=r["check_s"],
            check_share_at_100=r["check_s"] / 100 / off, times=r["times"],
        )  # fmt: skip
        print(
            f"{name:<10}{off * 1e3:>10.1f}{on * 1e3:>10.1f}{(on - off) / off:>+9.2%}"
            f"{r['collectives_per_step']:>7.0f}{floor / off:>9.3%}{r['check_s'] * 1e3:>12.2f}{r['check_s'] / 100 / off:>11.3%}"
        )
    record = dict(
        date=datetime.date.today().isoformat(), cpu=cpu_model(), torch=torch.__version__, args=vars(args) | {"out": str(args.out)},
        digest_s_per_collective=per_issue, variants=rows,
    )  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
