"""bf16 and fp16 through ``ZeroTrainer`` (``TrainingArguments(bf16=True)`` / ``fp16=True``): world 2
ends near the plain Trainer on one process (autocast there, bf16/fp16 weights with fp32 masters here),
and an fp16 step skipped for overflow is in the logs and leaves the scheduler where it was, as
DeepSpeed's engine does under the Trainer."""

from __future__ import annotations

import pytest
from launcher import run_ranks
from models import BF16_TOLERANCE
from trainer_runs import max_difference, rows, tiny_llama, training_args

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

START = "forkserver"  # see test_transformers.py
FLAGS = ("bf16", "fp16")
OVERFLOW = {"stage": 3, "loss_scale": {"initial_scale": 2.0**40, "backoff_factor": 2.0**-24}}  # step 1 overflows


def _plain(out: str) -> dict:
    import transformers

    states = {}
    for flag in FLAGS:
        model = tiny_llama()
        transformers.Trainer(model, training_args(f"{out}/{flag}", 1, **{flag: True}), train_dataset=rows()).train()
        states[flag] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return states


def _zero(out: str) -> dict:
    from zeropp.integrations.transformers import ZeroTrainer

    runs = {}
    for flag in FLAGS:
        trainer = ZeroTrainer(
            tiny_llama(),
            training_args(f"{out}/{flag}", 2, **{flag: True}),
            train_dataset=rows(),
            zero_config={"stage": 3},
        )
        trainer.train()
        runs[flag] = trainer.engine.full_state_dict()
    trainer = ZeroTrainer(
        tiny_llama(), training_args(f"{out}/skip", 2, fp16=True), train_dataset=rows(), zero_config=OVERFLOW
    )
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    runs["skip"] = dict(logs=logs, scheduler_steps=trainer.lr_scheduler.last_epoch, steps=trainer.state.global_step)
    return runs


def test_bf16_and_fp16_train_near_the_plain_trainer(tmp_path):
    plain = run_ranks(_plain, 1, start=START, out=str(tmp_path / "plain"))[0]
    start = tiny_llama().state_dict()
    for rank in run_ranks(_zero, 2, start=START, out=str(tmp_path / "zero")):
        for flag in FLAGS:
            moved = max_difference(plain[flag], start)
            difference = max_difference(rank[flag], plain[flag])
            assert 1e-6 < difference <= min(BF16_TOLERANCE, moved / 4), (flag, difference, moved)  # lower precision ran
        skip = rank["skip"]
        assert skip["steps"] == 4 and skip["scheduler_steps"] == 3  # the skipped step did not step the scheduler
        first, second, third, _ = skip["logs"]
        assert "grad_norm" not in first and first["skipped_steps"] == 1 and first["loss_scale"] == 2.0**16
        assert second["learning_rate"] == first["learning_rate"] == 0.0  # warm-up did not advance, then did
        assert third["learning_rate"] == pytest.approx(1.5e-3)
        assert [e["skipped_steps"] for e in skip["logs"]] == [1, 1, 1, 1]
