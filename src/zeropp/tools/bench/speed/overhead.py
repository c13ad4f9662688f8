"""``zeropp bench overhead``: where zeropp's host time goes per unit and per step, on a deep GPT of small units.

One process (world 1, gloo), ``--n-layer`` blocks of width ``--d-model`` (32 x 128: 33 units whose
compute is small, so bookkeeping shows), ``--micro-batch-size`` sequences of ``--block-size`` tokens,
fp32, AdamW. Plain PyTorch and zeropp at ``--stage`` alternate step by step on the same batches;
each step's minor page faults (fresh memory touched) are counted beside its time. With
``--contiguous-memory`` zeropp runs with MD, its gradient buffers kept across steps.

The breakdown times zeropp's own functions for a second set of steps: each is wrapped, here only,
in a timer that charges a call its *own* time (its callees' time goes to them), so the rows add up
to the time spent inside zeropp's code during the step. Rows are grouped by what they do (hooks,
gathering, gradients, the ledger, the optimizer step's bookkeeping); ``torch.profiler`` counts the
operator calls and allocations (``aten::empty*``, ``aten::zeros``, storage resizes) per step of both.
The timed steps run on a second engine built with the timers in place (hooks bind their methods
when they are registered). The timers add their own cost (two ``perf_counter`` calls and a list
append per call); the untimed step times at the top are the ones to compare.

    zeropp bench overhead [--n-layer 32] [--d-model 128] [--stage 3] [--steps 30] [--contiguous-memory]
                          [--out results/bench_overhead.json]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import resource
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from zeropp.app.launch import usable_cpus
from zeropp.tools.bench.runs import output_file

# (row, owner module path, owner attribute (None: the module's own function), function name): what the breakdown wraps
TIMED = (
    ("hooks: pre-forward", "zeropp.runtime.hooks", "Runtime", "_pre_forward"),
    ("hooks: post-forward", "zeropp.runtime.hooks", "Runtime", "_post_forward"),
    ("hooks: pre-backward", "zeropp.runtime.hooks", "Runtime", "_pre_backward"),
    ("hooks: per-parameter gradient", "zeropp.runtime.hooks", "Runtime", "_on_param_grad"),
    ("hooks: unit's gradients ready", "zeropp.runtime.hooks", "Runtime", "_grads_ready"),
    ("prefetch and order", "zeropp.runtime.hooks", "Runtime", "_prefetch"),
    ("unit: unshard (storage re-grown)", "zeropp.zero.unit", "FlatUnit", "unshard"),
    ("unit: start gather", "zeropp.zero.unit", "FlatUnit", "_start_gather"),
    ("unit: reshard (storage freed)", "zeropp.zero.unit", "FlatUnit", "reshard"),
    ("unit: add gradient into flat buffer", "zeropp.zero.unit", "FlatUnit", "add_grad"),
    ("unit: reduce gradients", "zeropp.zero.unit", "FlatUnit", "reduce_gradients"),
    ("unit: accumulate reduced shard", "zeropp.zero.unit", "FlatUnit", "_accumulate_reduced"),
    ("unit: training-state changes", "zeropp.zero.unit", "FlatUnit", "begin_backward"),
    ("unit: training-state changes", "zeropp.zero.unit", "FlatUnit", "enter_backward"),
    ("unit: training-state changes", "zeropp.zero.unit", "FlatUnit", "finish_backward"),
    ("unit: training-state changes", "zeropp.zero.unit", "FlatUnit", "end_backward"),
    ("comm: all-gather (copy at world 1)", "zeropp.comm", "Communicator", "all_gather"),
    ("comm: reduce-scatter (copy at world 1)", "zeropp.comm", "Communicator", "reduce_scatter"),
    ("comm: pending waits", "zeropp.comm", "Pending", "wait"),
    ("ledger records", "zeropp.comm.ledger", "Ledger", "record"),
    ("reduction queue", "zeropp.runtime.reductions", "ReductionQueue", "push"),
    ("reduction queue", "zeropp.runtime.reductions", "ReductionQueue", "drain"),
    ("step: optimizer (AdamW on the masters)", "torch.optim", "AdamW", "step"),
    ("step: unit bookkeeping (grads to masters, publish, clear)", "zeropp.zero.unit", "FlatUnit", "reduced_gradient"),
    ("step: unit bookkeeping (grads to masters, publish, clear)", "zeropp.zero.unit", "FlatUnit", "publish_master"),
    ("step: unit bookkeeping (grads to masters, publish, clear)", "zeropp.zero.unit", "FlatUnit", "clear_gradients"),
    ("step: gradient norm", "zeropp.zero.optim.stepping", None, "unit_statistics"),
    ("step: model-state bytes (measurement)", "zeropp.engine", "ZeroEngine", "model_state_bytes"),
)
COUNTED_OPS = ("aten::empty", "aten::empty_strided", "aten::zeros", "aten::resize_", "aten::copy_", "aten::add_")


class OwnTimer:
    """Charges each wrapped call its own time: the time between entering and leaving it, less the
    time spent in wrapped calls it made."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._children: list[float] = []

    def wrap(self, row: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._children.append(0.0)
            tick = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - tick
                children = self._children.pop()
                self.seconds[row] += elapsed - children
                self.calls[row] += 1
                if self._children:
                    self._children[-1] += elapsed

        return timed

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        import importlib

        originals = []
        for row, module, owner, name in TIMED:
            cls = importlib.import_module(module)
            cls = cls if owner is None else getattr(cls, owner)
            original = cls.__dict__[name]
            originals.append((cls, name, original))
            setattr(cls, name, self.wrap(row, original))
        try:
            yield
        finally:
            for cls, name, original in reversed(originals):
                setattr(cls, name, original)


def model_and_batches(args: argparse.Namespace) -> tuple[Any, Any]:
    from zeropp.app.data.batches import Batches
    from zeropp.app.models.gpt import gpt_config
    from zeropp.config.model import ModelConfig

    heads = max(1, args.d_model // 64)
    config = gpt_config(
        ModelConfig(n_layer=args.n_layer, d_model=args.d_model, n_head=heads, block_size=args.block_size)
    )
    return config, Batches("train", config.block_size, args.micro_batch_size, 1, 0, seed=0)


def plain_step(args: argparse.Namespace) -> Callable[[int], None]:
    """Plain PyTorch's step on step i's batch, from the weights zeropp starts from."""
    from zeropp.app.models.gpt import GPT
    from zeropp.zero.grouping import repeated_blocks
    from zeropp.zero.materialize import initialize_model

    config, batches = model_and_batches(args)
    with torch.device("meta"):
        model = GPT(config)
    initialize_model(model, repeated_blocks(model), seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def plain(step: int) -> None:
        x, y = batches.local_batch(step)
        model(x, y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return plain


def zeropp_step(args: argparse.Namespace, topology: Any) -> tuple[Callable[[int], None], int]:
    """zeropp's step on step i's batch, and its number of units."""
    from zeropp.app.models.gpt import GPT
    from zeropp.config.sections import ZeroConfig
    from zeropp.engine import ZeroEngine

    config, batches = model_and_batches(args)
    with torch.device("meta"):
        gpt = GPT(config)
    zero = ZeroConfig(stage=args.stage, contiguous_memory_optimization=args.contiguous_memory)
    engine = ZeroEngine(gpt, torch.optim.AdamW, dict(lr=1e-3), zero, topology, seed=0)

    def zeropp(step: int) -> None:
        x, y = batches.local_batch(step)
        engine.backward(engine(x, y))
        engine.step()

    return zeropp, len(engine.units)


def op_counts(step: Callable[[int], None], steps: int) -> dict[str, float]:
    """Calls per step of COUNTED_OPS and of every operator together."""
    from torch.profiler import profile

    with profile() as prof:
        for i in range(steps):
            step(i)
    events = prof.key_averages()
    counts = {e.key: e.count / steps for e in events if e.key in COUNTED_OPS}
    return counts | {"all aten ops": sum(e.count for e in events if e.key.startswith("aten::")) / steps}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="zeropp bench overhead", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n-layer", type=int, default=32)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    parser.add_argument(
        "--contiguous-memory", action="store_true", help="MD: zeropp's gradient buffers are ranges of one kept buffer"
    )
    parser.add_argument("--out", type=Path, default=Path("results/bench_overhead.json"))
    args = parser.parse_args(argv)
    args.out = output_file(parser, args.out, "bench_overhead.json")
    for key, value in (
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", str(_free_port())),
        ("RANK", "0"),
        ("WORLD_SIZE", "1"),
    ):
        os.environ.setdefault(key, value)
    torch.set_num_threads(args.threads)
    from zeropp.config.sections import TopologyConfig
    from zeropp.topology import init_topology

    topology = init_topology(TopologyConfig(backend="gloo"))
    plain = plain_step(args)
    zeropp, units = zeropp_step(args, topology)
    for i in range(3):  # warm-up: zeropp records its execution order in the first step
        plain(i)
        zeropp(i)
    times: dict[str, list[float]] = {"plain": [], "zeropp": []}
    faults: dict[str, list[int]] = {"plain": [], "zeropp": []}  # minor page faults: fresh memory touched
    for i in range(args.steps):  # alternated, so load changes reach both alike
        for name, step in (("plain", plain), ("zeropp", zeropp)):
            tick, faulted = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            step(i)
            times[name].append(time.perf_counter() - tick)
            faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faulted)
    plain_s, zeropp_s = (statistics.median(times[k]) for k in ("plain", "zeropp"))
    timer = OwnTimer()
    with timer.installed():  # a second engine, built with the timers in: its hooks are timed too
        timed, _ = zeropp_step(args, topology)
        for i in range(3):
            timed(i)
        timer.seconds.clear()
        timer.calls.clear()
        for i in range(args.steps):
            timed(i)
    rows = {
        row: {"us_per_step": s / args.steps * 1e6, "us_per_unit_step": s / args.steps / units * 1e6,
              "calls_per_step": timer.calls[row] / args.steps}
        for row, s in sorted(timer.seconds.items(), key=lambda kv: -kv[1])
    }  # fmt: skip
    counts = {"plain": op_counts(plain, 5), "zeropp": op_counts(zeropp, 5)}
    results = {
        "machine": f"{usable_cpus()} CPU cores, torch {torch.__version__}, {args.threads} thread(s); other jobs may share the CPU",
        "model": {"n_layer": args.n_layer, "d_model": args.d_model, "block_size": args.block_size, "units": units},
        "stage": args.stage,
        "contiguous_memory": args.contiguous_memory,
        "steps": args.steps,
        "plain_step_s": plain_s,
        "zeropp_step_s": zeropp_s,
        "ratio": zeropp_s / plain_s,
        "overhead_us_per_unit_step": (zeropp_s - plain_s) / units * 1e6,
        "minor_faults_per_step": {name: statistics.median(f) for name, f in faults.items()},
        "breakdown": rows,
        "op_calls_per_step": counts,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(markdown(results))
    print(f"\nwritten to {args.out}")
    return 0


def markdown(r: dict[str, Any]) -> str:
    m = r["model"]
    lines = [
        f"{m['n_layer']} layers x {m['d_model']} ({m['units']} units), stage {r['stage']}"
        f"{' with MD' if r['contiguous_memory'] else ''}, world 1, {r['machine']}",
        f"\nplain PyTorch {r['plain_step_s'] * 1e3:.2f} ms/step, zeropp {r['zeropp_step_s'] * 1e3:.2f} ms/step: "
        f"{r['ratio']:.3f}x, {r['overhead_us_per_unit_step']:.0f} us per unit per step above plain; minor page "
        f"faults per step {r['minor_faults_per_step']['plain']:,.0f} and {r['minor_faults_per_step']['zeropp']:,.0f}\n",
        "| zeropp code (own time, timers on) | us/step | us/unit/step | calls/step |",
        "|---|---|---|---|",
    ]
    for row, v in r["breakdown"].items():
        lines.append(f"| {row} | {v['us_per_step']:,.0f} | {v['us_per_unit_step']:.1f} | {v['calls_per_step']:.0f} |")
    lines += ["", "| operator calls per step | plain | zeropp |", "|---|---|---|"]
    plain, zeropp = r["op_calls_per_step"]["plain"], r["op_calls_per_step"]["zeropp"]
    for op in [*COUNTED_OPS, "all aten ops"]:
        lines.append(f"| {op} | {plain.get(op, 0):.0f} | {zeropp.get(op, 0):.0f} |")
    return "\n".join(lines)


def _free_port() -> int:
    from zeropp.topology import free_port

    return free_port()


if __name__ == "__main__":
    raise SystemExit(main())
