"""``zeropp bench generate``: tokens/s of ``generate`` at stage 3, unit by unit vs ``engine.gathered()`` vs the plain model.

A small Hugging Face Llama (built from a config, seeded; fp32, ZeRO++ off, every unit sharded)
generates ``--new-tokens`` tokens greedily for ``--batch`` prompts of ``--prompt`` tokens on each
world size of ``--worlds`` (gloo ranks started here, one thread each): ``engine.generate(gathered=False)``
(every unit gathered for every token), ``engine.generate()`` (every unit gathered once) and the plain
unsharded model's ``generate`` (in every rank's process at once, so each variant runs under the
same load). The variants alternate, ``--repeats`` times; the table gives the median tokens/s
(batch x new tokens per second) of rank 0, the ledger's all-gather bytes per call and whether the
tokens equal the plain model's. The CPU model (``lscpu``) and the date go with the results.

    zeropp bench generate [--worlds 2 4] [--layers 6] [--hidden 256] [--new-tokens 64] [--batch 4]
                          [--prompt 16] [--repeats 3] [--out results/bench_generate.json]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from zeropp.app.launch import usable_cpus
from zeropp.tools.bench.runs import cpu_model, output_file
from zeropp.topology import free_port

VARIANTS = ("unit by unit", "gathered", "plain model")


def _llama(args: argparse.Namespace) -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=2048, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3, num_hidden_layers=args.layers,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=args.prompt + args.new_tokens,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    from zeropp.config.sections import ZeroConfig
    from zeropp.engine import ZeroEngine
    from zeropp.topology import init_topology, shutdown

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    topology = init_topology()
    model = _llama(args)
    plain = copy.deepcopy(model)
    engine = ZeroEngine(model, torch.optim.AdamW, {}, ZeroConfig(stage=3, persistence_threshold=0), topology)
    ids = torch.randint(1, 2048, (args.batch, args.prompt), generator=torch.Generator().manual_seed(1))
    kwargs = dict(
        input_ids=ids, attention_mask=torch.ones_like(ids), pad_token_id=0, max_new_tokens=args.new_tokens,
        min_new_tokens=args.new_tokens, do_sample=False,
    )  # fmt: skip
    with torch.no_grad():
        expected = plain.generate(**kwargs)
    runs = {
        "unit by unit": lambda: engine.generate(**kwargs, gathered=False),
        "gathered": lambda: engine.generate(**kwargs),
        "plain model": lambda: plain.generate(**kwargs),
    }
    seconds: dict[str, list[float]] = {name: [] for name in VARIANTS}
    sent, same = {}, {}
    for _ in range(args.repeats):
        for name in VARIANTS:
            engine.comm.barrier(topology.world)
            engine.comm.ledger.reset()
            tick = time.perf_counter()
            with torch.no_grad():
                tokens = runs[name]()
            seconds[name].append(time.perf_counter() - tick)
            sent[name] = engine.comm.ledger.total(op="all_gather")
            same[name] = torch.equal(tokens, expected)
    if rank == 0:
        queue.put(dict(world=world, params=engine.param_count, seconds=seconds, bytes=sent, same=same))
    shutdown()


def measure(world: int, args: argparse.Namespace) -> dict[str, Any]:
    """Rank 0's times, bytes and token checks at `world` ranks."""
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    result = queue.get(timeout=3600)
    for p in procs:
        p.join()
    return result


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    tokens = args.batch * args.new_tokens
    lines = [
        "| world | variant | median s per call | tokens/s | x unit by unit | all-gather bytes per call (rank 0) | tokens = plain |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        base = statistics.median(row["seconds"]["unit by unit"])
        for name in VARIANTS:
            median = statistics.median(row["seconds"][name])
            lines.append(
                f"| {row['world']} | {name} | {median:.3f} | {tokens / median:,.0f} | {base / median:.1f} | "
                f"{row['bytes'][name]:,} | {'yes' if row['same'][name] else 'NO'} |"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zeropp bench generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("results/bench_generate.json"))
    args = parser.parse_args(argv)
    args.out = output_file(parser, args.out, "bench_generate.json")
    when, cpu = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"), cpu_model()
    print(f"{cpu}, {usable_cpus()} CPUs, {when}; Llama of {args.layers} layers x {args.hidden}, fp32, stage 3")
    rows = []
    for world in args.worlds:
        rows.append(measure(world, args))
        print(markdown(rows[-1:], args), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(dict(cpu=cpu, date=when, options=vars(args) | {"out": str(args.out)}, rows=rows), indent=2)
        )
    print(markdown(rows, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
