"""``zeropp bench lora``: does LoRA on a frozen base stored int8 or int4 converge like LoRA on the exact base, over seeds?

First a base: a small Llama (transformers' ``LlamaConfig``, written here) trained in full with ``zeropp
train`` on the embedded corpus for ``--base-steps`` steps (seed 0) and exported as a Hugging Face folder
(kept in OUT/base, reused by later runs). Then ``zeropp train --hf-model OUT/base --lora-rank R`` at
stage 3, ZeRO++'s communication switches off, once per seed and configuration:

- LoRA: the frozen base in the compute dtype (fp32);
- LoRA + int8 frozen: ``--quantized-nontrainable-weights`` (blocks of 256);
- LoRA + int4 frozen: the same with ``--nontrainable-weight-bits 4``.

A seed fixes the adapters' initial values and the batches, so the runs of one seed are paired. Per
configuration: validation loss every ``--eval-interval`` steps, mean and standard deviation over the
seeds, the paired gap to LoRA on the exact base (:func:`zeropp.tools.bench.quality.convergence.curves`), and
the measured model-state bytes and bytes sent per rank and step.

    zeropp bench lora [--seeds 1 2 3] [--steps 100] [--base-steps 200] [--rank 8] [--nproc-per-node 2]
                      [--out results/bench_lora]

Writes results.json (every run's summary), results.md and curves.png (means with +-1 std bands).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from zeropp.app.flags import as_flags
from zeropp.tools.bench.quality.convergence import curves, markdown_table, plot
from zeropp.tools.bench.runs import ZEROPP_OFF, publish_report, train_summary

BASE = "LoRA"
CONFIGS: dict[str, dict[str, Any]] = {  # zero keys of each configuration
    BASE: {},
    "LoRA + int8 frozen": {"quantized_nontrainable_weights": True},
    "LoRA + int4 frozen": {"quantized_nontrainable_weights": True, "nontrainable_weight_bits": 4},
}
LLAMA = dict(  # 229,952 parameters; vocabulary: the corpus's bytes
    hidden_size=64, intermediate_size=192, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=128, vocab_size=256, bos_token_id=0, eos_token_id=0,
)  # fmt: skip
TARGETS = "q_proj,k_proj,v_proj,o_proj"


def _common(args: argparse.Namespace) -> list[str]:
    """The zeropp train flags every run shares: fp32, stage 3 without ZeRO++'s communication switches."""
    return [
        "--stage", "3", "--precision", "fp32", "--block-size", str(args.block_size), "--nproc-per-node",
        str(args.nproc_per_node), "--micro-batch-size", str(args.micro_batch_size), *as_flags(ZEROPP_OFF),
    ]  # fmt: skip


def base_model(args: argparse.Namespace) -> Path:
    """OUT/base: the small Llama trained in full for --base-steps steps and exported (made once)."""
    from transformers import LlamaConfig

    from zeropp.app.hf import export_folder

    folder = args.out / "base"
    if (folder / "model.safetensors").is_file():
        return folder
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "llama.json"
        LlamaConfig(**LLAMA).to_json_file(config)
        flags = [
            "--hf-config", str(config), "--steps", str(args.base_steps), "--lr", "3e-3", "--warmup-steps", "20",
            "--eval-interval", str(args.base_steps), "--eval-batches", str(args.eval_batches), "--seed", "0",
            "--checkpoint-dir", f"{tmp}/ck", *_common(args),
        ]  # fmt: skip
        summary = train_summary(flags)
        export_folder(Path(tmp) / "ck" / f"step-{args.base_steps:08d}", folder)
    print(f"base: {args.base_steps} steps, validation loss {summary.final_val_loss:.4f} ({folder})", flush=True)
    return folder


def markdown(args: argparse.Namespace, runs: dict[str, dict[int, dict]]) -> str:
    table = curves(runs, BASE)
    steps = table[BASE]["steps"]
    after = [i for i, s in enumerate(steps) if s > args.warmup_steps]
    rows = []
    for name, row in table.items():
        summaries = list(runs[name].values())
        held = statistics.fmean(statistics.fmean(s["model_state_bytes_per_rank"]) for s in summaries)
        sent = statistics.fmean(s["intra_node_bytes_per_step"] + s["inter_node_bytes_per_step"] for s in summaries)
        rows.append([
            name, f"{row['mean'][-1]:.4f} ± {row['std'][-1]:.4f}",
            f"{row['gap_mean'][-1]:+.2%} ± {row['gap_std'][-1]:.2%}",
            f"{max((abs(row['gap_mean'][i]) for i in after), default=0):.2%}",
            f"{held / 2**10:.1f} KiB", f"{sent / 2**10:.1f} KiB",
        ])  # fmt: skip
    return "\n".join([
        f"seeds {' '.join(map(str, sorted(runs[BASE])))}; base: {args.base_steps} full steps of a "
        f"{LLAMA['num_hidden_layers']}-layer Llama (d {LLAMA['hidden_size']}); LoRA rank {args.rank} on {TARGETS}, "
        f"{args.steps} steps, lr {args.lr:g} ({args.warmup_steps} warm-up, cosine), fp32, stage 3 (ZeRO++ "
        f"communication off), world {args.nproc_per_node}, {args.micro_batch_size} sequences of {args.block_size} "
        f"bytes per rank; validation loss over {args.eval_batches} batches per rank, mean ± std over seeds",
        "",
        *markdown_table(
            ["run", *(f"step {s}" for s in steps)],
            [[name, *(f"{m:.4f} ± {d:.4f}" for m, d in zip(r["mean"], r["std"], strict=True))] for name, r in table.items()],
        ),
        "",
        *markdown_table(
            ["run", f"val loss, step {steps[-1]}", f"paired gap to {BASE}", "largest absolute mean gap after warm-up",
             "model states per rank", "sent per rank per step"],
            rows,
        ),  # fmt: skip
    ])  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="zeropp bench lora", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=100, help="LoRA steps per run")
    parser.add_argument("--base-steps", type=int, default=200, help="full training steps of the base")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--eval-interval", type=int, default=25)
    parser.add_argument("--eval-batches", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=4, help="sequences per rank and step")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--nproc-per-node", type=int, default=2, help="ranks (one node)")
    parser.add_argument("--out", type=Path, default=Path("results/bench_lora"))
    args = parser.parse_args(argv)
    if len(args.seeds) < 2:
        parser.error("--seeds: give at least 2 seeds (a standard deviation needs two)")
    args.out.mkdir(parents=True, exist_ok=True)
    base = base_model(args)
    lora = ["--hf-model", str(base), "--lora-rank", str(args.rank), "--lora-targets", TARGETS, "--lr", str(args.lr)]
    schedule = ["--steps", str(args.steps), "--warmup-steps", str(args.warmup_steps), "--eval-interval",
                str(args.eval_interval), "--eval-batches", str(args.eval_batches)]  # fmt: skip
    runs: dict[str, dict[int, dict]] = {name: {} for name in CONFIGS}
    for seed in args.seeds:  # seed by seed, configurations alternating: a partial result is still paired
        for name, keys in CONFIGS.items():
            flags = [*lora, *schedule, *_common(args), "--seed", str(seed), *as_flags(keys)]
            runs[name][seed] = train_summary(flags).as_dict()
            print(f"seed {seed} {name}: final val loss {runs[name][seed]['final_val_loss']:.4f}", flush=True)
    report = markdown(args, runs)
    args.out.joinpath("results.json").write_text(
        json.dumps({"args": vars(args) | {"out": str(args.out)}, "runs": runs, "curves": curves(runs, BASE)}, indent=1)
    )
    publish_report(args.out, report, lambda: plot(runs, args.out, BASE))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
