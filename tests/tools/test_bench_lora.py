"""zeropp bench lora: the report's paired gaps to LoRA on the exact base, memory and bytes per configuration."""

from __future__ import annotations

import argparse

from zeropp.tools.bench.quality import lora


def _run(losses: list[float], held: list[float], sent: float) -> dict:
    return {
        "val_losses": [[25 * (i + 1), v] for i, v in enumerate(losses)],
        "model_state_bytes_per_rank": held, "intra_node_bytes_per_step": sent, "inter_node_bytes_per_step": 0.0,
    }  # fmt: skip


def test_report_pairs_each_seed_with_lora_on_the_exact_base():
    runs = {
        "LoRA": {1: _run([3.0, 2.0], [4096, 4096], 2048), 2: _run([3.0, 2.5], [4096, 4096], 2048)},
        "LoRA + int4 frozen": {1: _run([3.0, 2.02], [1024, 2048], 512), 2: _run([3.0, 2.5], [1024, 2048], 512)},
    }
    args = argparse.Namespace(
        base_steps=200, rank=8, steps=50, lr=3e-3, warmup_steps=10, nproc_per_node=2, micro_batch_size=4,
        block_size=64, eval_batches=4,
    )  # fmt: skip
    report = lora.markdown(args, runs)
    # step 50: gaps +1% (seed 1) and 0% (seed 2): mean 0.50%, std 0.71%; 1.5 KiB held, 0.5 KiB sent
    assert "| LoRA + int4 frozen | 2.2600 ± 0.3394 | +0.50% ± 0.71% | 0.50% | 1.5 KiB | 0.5 KiB |" in report
    assert "| LoRA | 2.2500 ± 0.3536 | +0.00% ± 0.00% | 0.00% | 4.0 KiB | 2.0 KiB |" in report
    assert "| LoRA + int4 frozen | 3.0000 ± 0.0000 | 2.2600 ± 0.3394 |" in report
