"""ZeRO++ through ``ZeroTrainer``: a run driven by ``examples/ds_config.json`` (qwZ, hpZ over each node's
2 ranks, qgZ, bf16; passed as ``zero_config=`` since ``TrainingArguments(deepspeed=...)`` needs DeepSpeed
installed) on 2 simulated nodes x 2 ranks puts on the ledger, per rank and step, the cross-node bytes
that ``zeropp train`` reports for the same model and config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_runner import run_cli
from launcher import free_port, run_ranks
from trainer_runs import rows, tiny_llama, training_args

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

ROOT = Path(__file__).resolve().parents[2]
DS_CONFIG = str(ROOT / "examples" / "ds_config.json")
START = "forkserver"  # see test_transformers.py
STEPS = 2


def _cross_node_bytes(out: str) -> dict:
    """This rank's ledger bytes per step, by link, over the step's phases (as ``zeropp train`` counts)."""
    from zeropp.costs.volume import STEP_PHASES
    from zeropp.integrations.transformers import ZeroTrainer

    args = training_args(out, 4, per_device_train_batch_size=4, bf16=True, max_grad_norm=1.0, max_steps=STEPS)
    trainer = ZeroTrainer(tiny_llama(), args, train_dataset=rows(64), zero_config=DS_CONFIG)
    trainer.train()
    engine = trainer.engine
    ledger = engine.comm.ledger
    per_step = {
        link: sum(ledger.total(phase=p, link=link) for p in STEP_PHASES) / ledger.steps for link in ("intra", "inter")
    }
    zeropp = (engine.config.qwz.enabled, engine.hpz_group_size, engine.config.qgz.enabled)
    return dict(per_step=per_step, steps=ledger.steps, zeropp=zeropp, precision=engine.config.precision)


def test_zeropp_cross_node_bytes_equal_zeropp_trains(tmp_path):
    tiny_llama().config.to_json_file(tmp_path / "llama.json")
    summary_path = tmp_path / "summary.json"
    done = run_cli(
        "train", "--hf-config", str(tmp_path / "llama.json"), "--deepspeed", DS_CONFIG, "--steps", str(STEPS),
        "--eval-batches", "1", "--master-port", str(free_port()), "--summary-json", str(summary_path),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    assert (summary["world_size"], summary["nodes"], summary["precision"]) == (4, 2, "bf16")
    ranks = run_ranks(_cross_node_bytes, 4, nodes=2, start=START, out=str(tmp_path / "trainer"))
    for rank, got in enumerate(ranks):
        assert got["steps"] == STEPS and got["zeropp"] == (True, 2, True) and got["precision"] == "bf16"
        assert got["per_step"]["inter"] == summary["inter_node_bytes_per_step_by_rank"][rank] > 0
        assert got["per_step"]["intra"] == summary["intra_node_bytes_per_step_by_rank"][rank]
