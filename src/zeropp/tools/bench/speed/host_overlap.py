"""The host optimizer step inside backward, timed (``zeropp bench optimizer --in-backward``): how much of
ZeRO-Offload's host step ``zero.step_in_backward`` hides behind backward, and a timeline of one step.

One process (world 1, gloo), a GPT of ``--n-layer`` x ``--d-model`` at stage 3 with the optimizer
offloaded (``--offload cpu``, or ``nvme`` with ``--offload-path``), two engines from the same weights:
one stepping after backward, one stepping each unit on the worker thread as its reduction lands
(:mod:`zeropp.zero.optim.in_backward`). Their steps alternate, so load changes reach both alike. The
host step is what ``engine.step()`` takes after backward in the first; in the second it is only
waited for where the worker has not finished when backward ends: the share hidden is 1 - that wait /
the host step, per pair of steps. Beside it what the whole step gained over the host step (the
worker competes with backward for the cores: less than what is hidden), the worker's busy time (the
sum of its units' steps, their gradients' reads included, the states' read-ahead not), and the last
step's timeline: each unit's landing, step start and end from the start of backward, beside
backward's end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("--in-backward: the host step inside backward")
    group.add_argument("--in-backward", action="store_true", help="time the step inside backward instead")
    group.add_argument("--n-layer", type=int, default=12)
    group.add_argument("--d-model", type=int, default=512)
    group.add_argument("--block-size", type=int, default=128)
    group.add_argument("--steps", type=_positive, default=6, help="timed steps of each engine, after two warm-up steps")
    group.add_argument("--offload", choices=["cpu", "nvme"], default="cpu")
    group.add_argument("--offload-path", default=None, help="the disk tier's folder (--offload nvme)")


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Both engines' step times, the hidden share per step and the last step's timeline."""
    from zeropp.config.sections import TopologyConfig
    from zeropp.topology import free_port, init_topology, shutdown

    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port())), ("RANK", "0"), ("WORLD_SIZE", "1")):  # fmt: skip
        os.environ.setdefault(key, value)
    topology = init_topology(TopologyConfig(backend="gloo"))
    try:
        return _measure(args, topology)
    finally:
        shutdown()


def _measure(args: argparse.Namespace, topology: Any) -> dict[str, Any]:
    from zeropp.tools.bench.speed.overhead import model_and_batches

    args.micro_batch_size = 1
    _, batches = model_and_batches(args)
    after, inside = (_engine(args, topology, on, f"in-backward-{on}") for on in (False, True))
    times: dict[str, list[float]] = {"after": [], "inside": []}
    host_step, hidden, busy, waited = [], [], [], []
    for step in range(2 + args.steps):
        for name, engine in (("after", after), ("inside", inside)):
            x, y = batches.local_batch(step)
            tick = time.perf_counter()
            loss = engine(x, y)
            backward_start = time.perf_counter()
            engine.backward(loss)
            backward_end = time.perf_counter()
            engine.step()
            if step < 2:  # warm-up: the first records the execution order, the second fills the pools
                continue
            times[name].append(time.perf_counter() - tick)
            if name == "after":
                host_step.append(time.perf_counter() - backward_end)
            else:
                worker = inside.early
                busy.append(sum(done - started for _, _, started, done in worker.timeline))
                waited.append(worker.waited_s)
                hidden.append(1 - waited[-1] / host_step[-1])
                timeline = [
                    {"unit": k, "landed_s": landed - backward_start, "started_s": started - backward_start,
                     "done_s": done - backward_start}
                    for k, landed, started, done in worker.timeline
                ]  # fmt: skip
                backward_s = backward_end - backward_start
    return {
        "after_step_s": statistics.median(times["after"]),
        "inside_step_s": statistics.median(times["inside"]),
        "host_step_after_s": statistics.median(host_step),
        "worker_busy_s": statistics.median(busy),
        "step_waited_s": statistics.median(waited),
        "hidden_share": statistics.median(hidden),
        # what the step itself gained, against the host step: the worker also slows backward down
        "step_gain_share": (statistics.median(times["after"]) - statistics.median(times["inside"]))
        / statistics.median(host_step),
        "hidden_share_range": [min(hidden), max(hidden)],
        "last_backward_s": backward_s,
        "last_timeline": timeline,
    }


def _engine(args: argparse.Namespace, topology: Any, in_backward: bool, folder: str) -> Any:
    from zeropp.app.models.gpt import GPT
    from zeropp.config.sections import ZeroConfig
    from zeropp.engine import ZeroEngine
    from zeropp.tools.bench.speed.overhead import model_and_batches

    config, _ = model_and_batches(args)
    with torch.device("meta"):
        gpt = GPT(config)
    offload: dict[str, Any] = dict(offload_optimizer=args.offload)
    if args.offload == "nvme":
        path = os.path.join(args.offload_path, folder)
        os.makedirs(path, exist_ok=True)
        offload["offload_path"] = path
    zero = ZeroConfig(stage=3, step_in_backward=in_backward, **offload)
    return ZeroEngine(gpt, torch.optim.AdamW, dict(lr=1e-4), zero, topology, seed=0)


def report(result: dict[str, Any]) -> None:
    """The numbers, then the timeline as a table."""
    print(
        f"step after backward {result['after_step_s']:.3f} s, inside backward {result['inside_step_s']:.3f} s "
        f"({result['inside_step_s'] / result['after_step_s']:.2f}x); the host step after backward "
        f"{result['host_step_after_s']:.3f} s, inside it engine.step() waited {result['step_waited_s']:.3f} s for the "
        f"worker (busy {result['worker_busy_s']:.3f} s): {100 * result['hidden_share']:.0f}% of the host step hidden "
        f"({100 * result['hidden_share_range'][0]:.0f}-{100 * result['hidden_share_range'][1]:.0f}% over the steps); "
        f"the step gained {100 * result['step_gain_share']:.0f}% of the host step"
    )
    print(
        f"the last step's timeline, seconds from the start of backward (backward ended at {result['last_backward_s']:.3f}):"
    )
    print("| unit | reduced | step started | step done |")
    print("| --- | --- | --- | --- |")
    for row in result["last_timeline"]:
        print(f"| {row['unit']} | {row['landed_s']:.3f} | {row['started_s']:.3f} | {row['done_s']:.3f} |")
