"""``zeropp.integrations.transformers.ZeroTrainer`` against the real ``transformers.Trainer``: a tiny
Llama built from a config (no downloads) on fixed token rows, fp32, sequential batches, no dropout.
World 1 equals the plain Trainer; worlds 2 and 4 (2 nodes x 2) at stages 1-3 equal world 1 with the
same global batch; a resumed run is bit-identical to a straight one; ``save_model`` loads with
``from_pretrained``; a DeepSpeed config reaches the engine; the example runs under torchrun."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launcher import run_ranks
from trainer_runs import PROBE, STEPS, TOLERANCE, max_difference, rows, tiny_llama, training_args

from examples import docs_include, run_example

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

ROOT = Path(__file__).resolve().parents[2]
# Ranks fork from a server, not from pytest: accelerate raises the rank's thread count, and an OpenMP pool
# that the pytest process started before a fork deadlocks the child's first parallel region (seen in the
# full suite). The server imported transformers once (see launcher.PRELOAD), which a spawned rank repeats.
START = "forkserver"


def _zero_run(out: str, world: int, stage: int, **overrides) -> dict[str, torch.Tensor]:
    import zeropp
    from zeropp.integrations.transformers import ZeroTrainer

    trainer = ZeroTrainer(
        tiny_llama(),
        training_args(out, world, **overrides),
        train_dataset=rows(),
        zero_config=zeropp.ZeroConfig(stage=stage),
    )
    trainer.train()
    return {
        "state": trainer.engine.full_state_dict(),
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
    }


def _world_one_run(out: str) -> dict:
    return _zero_run(out, 1, 3)


def _plain_and_zero(out: str) -> tuple[dict, dict]:
    import transformers

    model = tiny_llama()
    plain = transformers.Trainer(model, training_args(out + "/plain", 1), train_dataset=rows())
    plain.train()
    reference = {"state": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    reference["losses"] = [e["loss"] for e in plain.state.log_history if "loss" in e]
    return reference, _zero_run(out + "/zero", 1, 3)


@pytest.fixture(scope="module")
def world_one(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("world1"))
    return run_ranks(_world_one_run, 1, start=START, out=out)[0]


def test_world_one_equals_the_plain_trainer(tmp_path):
    """Stage 3, fp32, accumulation 2, warm-up + linear decay, decay / no-decay groups, clipping."""
    reference, zero = run_ranks(_plain_and_zero, 1, start=START, out=str(tmp_path))[0]
    assert len(zero["losses"]) == STEPS and zero["losses"] == pytest.approx(reference["losses"], abs=TOLERANCE)
    assert max_difference(zero["state"], reference["state"]) < TOLERANCE
    start = tiny_llama().state_dict()
    assert max_difference(zero["state"], start) > 1e-3  # it trained


def _stages(out: str, ranks: int) -> list[dict]:
    return [_zero_run(f"{out}/stage{stage}", ranks, stage) for stage in (1, 2, 3)]


@pytest.mark.parametrize("world,nodes", [(2, 1), (4, 2)])
def test_more_ranks_equal_world_one(world_one, world, nodes, tmp_path):
    """The same global batch (per_device_train_batch_size x world) at stages 1-3 gives world 1's run."""
    results = run_ranks(_stages, world, start=START, nodes=nodes, out=str(tmp_path), ranks=world)
    for rank_result in results:
        for run in rank_result:
            assert max_difference(run["state"], world_one["state"]) < TOLERANCE
            assert run["losses"] == pytest.approx(world_one["losses"], abs=TOLERANCE)


def _resume(out: str) -> tuple[dict, dict, list[str]]:
    straight = _zero_run(f"{out}/straight", 2, 3, max_steps=6, save_strategy="steps", save_steps=3)
    import zeropp
    from zeropp.integrations.transformers import ZeroTrainer

    args = training_args(f"{out}/straight", 2, max_steps=6, save_strategy="no")
    trainer = ZeroTrainer(tiny_llama(), args, train_dataset=rows(), zero_config=zeropp.ZeroConfig(stage=3))
    trainer.train(resume_from_checkpoint=f"{out}/straight/checkpoint-3")
    files = sorted(p.name for p in Path(f"{out}/straight/checkpoint-3").iterdir())
    return straight["state"], trainer.engine.full_state_dict(), files


def test_resume_is_bit_identical(tmp_path):
    """Saved at step 3 (zeropp's sharded checkpoint in checkpoint-3/zeropp), resumed, equal at step 6."""
    straight, resumed, files = run_ranks(_resume, 2, start=START, out=str(tmp_path))[0]
    assert {"zeropp", "scheduler.pt", "trainer_state.json", "config.json", "rng_state_0.pth"} <= set(files)
    for key in straight:
        assert torch.equal(straight[key], resumed[key]), key


def _save(out: str) -> torch.Tensor:
    import zeropp
    from zeropp.integrations.transformers import ZeroTrainer

    trainer = ZeroTrainer(
        tiny_llama(), training_args(out, 2, max_steps=2), train_dataset=rows(), zero_config=zeropp.ZeroConfig(stage=3)
    )
    trainer.train()
    trainer.save_model(f"{out}/final")
    trainer.engine.eval()
    with torch.no_grad():
        return trainer.engine(input_ids=PROBE).logits


def test_save_model_loads_with_from_pretrained(tmp_path):
    import transformers

    logits = run_ranks(_save, 2, start=START, out=str(tmp_path))[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "final").eval()
    with torch.no_grad():
        assert (model(input_ids=PROBE).logits - logits).abs().max().item() < TOLERANCE


def test_the_example_runs_under_torchrun(tmp_path):
    done = run_example("hf_trainer.py", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "wrote" in done.stdout
    assert (tmp_path / "out" / "final" / "config.json").is_file()


def test_the_docs_include_the_example():
    assert docs_include("trainer-and-lightning.md", "hf_trainer.py")


def test_importing_zeropp_imports_no_transformers():
    """The core never imports the integrations (checked in a fresh interpreter: this one has transformers)."""
    code = "import sys, zeropp, zeropp.engine, zeropp.app.trainer; assert 'transformers' not in sys.modules, 'imported'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_deepspeed_config_takes_the_training_arguments_values(tmp_path):
    """ "auto" and left-out keys take the TrainingArguments'; a contradiction is refused in one line."""
    from zeropp.integrations.transformers import TrainerError, resolve_zero_config

    args = training_args(str(tmp_path), 1, bf16=True)
    ds = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": 2},
    }
    zero = resolve_zero_config(ds, args, world_size=2, hidden_size=32)
    assert (zero.stage, zero.gradient_accumulation_steps, zero.max_grad_norm, zero.precision) == (2, 2, 0.5, "bf16")
    assert resolve_zero_config({"stage": 1, "quantized_weights": False}, args, 1).stage == 1
    with pytest.raises(TrainerError, match="gradient_accumulation_steps 4 but the TrainingArguments say 2"):
        resolve_zero_config({**ds, "gradient_accumulation_steps": 4}, args, world_size=2)
    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"stage": 1}, "fp16": {"enabled": true}}')
    with pytest.raises(TrainerError, match="precision 'fp16' but the TrainingArguments say 'bf16'"):
        resolve_zero_config(str(path), args, world_size=1)


def _from_args_deepspeed(out: str) -> tuple[int, bool, float]:
    import json

    from zeropp.integrations.transformers import ZeroTrainer

    ds = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": 2},
    }
    Path(f"{out}/ds.json").write_text(json.dumps(ds))
    trainer = ZeroTrainer(tiny_llama(), training_args(out, 2, deepspeed=f"{out}/ds.json"), train_dataset=rows())
    trainer.train()
    same = max_difference(trainer.engine.full_state_dict(), _zero_run(f"{out}/b", 2, 2)["state"])
    return trainer.engine.config.stage, trainer.is_deepspeed_enabled, same


def test_args_deepspeed_is_read_by_zeropp(tmp_path):
    """TrainingArguments(deepspeed=...) constructs only where DeepSpeed is installed (transformers 5.24
    fails with a TypeError otherwise); there ZeroTrainer reads the file and DeepSpeed never starts."""
    pytest.importorskip("deepspeed")
    for stage, deepspeed_on, difference in run_ranks(_from_args_deepspeed, 2, start=START, out=str(tmp_path)):
        assert (stage, deepspeed_on, difference) == (2, False, 0.0)


ADAFACTOR = dict(optim="adafactor")  # transformers' own Adafactor (factored moments), weight decay 0.1: its two groups


def _plain_adafactor(out: str) -> dict[str, torch.Tensor]:
    import transformers

    model = tiny_llama()
    transformers.Trainer(model, training_args(out, 1, **ADAFACTOR), train_dataset=rows()).train()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _zero_adafactor(out: str) -> dict[str, torch.Tensor]:
    return _zero_run(out, 2, 3, **ADAFACTOR)["state"]


def test_adafactor_with_the_trainers_decay_groups_equals_the_plain_trainer(tmp_path):
    """A shape-aware optimizer with the Trainer's decay / no-decay groups: whole parameters on owner ranks."""
    reference = run_ranks(_plain_adafactor, 1, start=START, out=str(tmp_path / "plain"))[0]
    for state in run_ranks(_zero_adafactor, 2, start=START, out=str(tmp_path / "zero")):
        assert max_difference(state, reference) < TOLERANCE
    assert max_difference(reference, tiny_llama().state_dict()) > 1e-3  # it trained


def _context_parallel_run(out: str) -> dict:
    from accelerate import ParallelismConfig

    import zeropp
    from zeropp.integrations.transformers import ZeroTrainer

    # transformers' own switch for DeepSpeed's Ulysses: read as topology.context_parallel_size
    args = training_args(out, 2, per_device_eval_batch_size=2, parallelism_config=ParallelismConfig(sp_size=2))
    trainer = ZeroTrainer(
        tiny_llama(), args, train_dataset=rows(), eval_dataset=rows(8, seed=1), zero_config=zeropp.ZeroConfig(stage=3)
    )
    assert trainer.topology.context_parallel.size == 2 and trainer.args.parallelism_config is None
    trainer.train()
    gathered = trainer.engine.comm.ledger.as_dict().get("cp.all_gather", {})
    return {
        "state": trainer.engine.full_state_dict(),
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
        "eval_loss": trainer.evaluate()["eval_loss"],
        "gathered": gathered,
    }


@pytest.mark.unit
def test_a_parallelism_config_is_read_as_the_context_parallel_size_or_refused_in_one_line():
    from accelerate import ParallelismConfig

    from zeropp.integrations.transformers import TrainerError, context_parallel_size

    assert context_parallel_size(ParallelismConfig(sp_size=4)) == 4
    assert context_parallel_size(ParallelismConfig(cp_size=2, dp_shard_size=2)) == 2
    with pytest.raises(
        TrainerError, match=r"^parallelism_config tp_size = 2 is not allowed with ZeroTrainer; expected 1"
    ):
        context_parallel_size(ParallelismConfig(tp_size=2))


def test_context_parallelism_shares_the_loaders_rows_and_trains_world_ones_weights(world_one, tmp_path):
    """C 2 at world 2: each rank's loader rows shared over the run, each rank keeping half of every
    token row; the weights and losses of world 1 with the same global batch, and an evaluation loss
    that is the mean of each evaluation batch's loss (as the data-parallel Trainer reports it)."""
    results = run_ranks(_context_parallel_run, 2, start=START, out=str(tmp_path))
    model = tiny_llama()
    model.load_state_dict(results[0]["state"])
    held_out = torch.stack([row["input_ids"] for row in rows(8, seed=1)])
    with torch.no_grad():
        expected = sum(model(input_ids=b, labels=b).loss.item() for b in held_out.split(2)) / 4
    for result in results:
        assert max_difference(result["state"], world_one["state"]) < TOLERANCE
        assert result["losses"] == pytest.approx(world_one["losses"], abs=TOLERANCE)
        assert result["eval_loss"] == pytest.approx(expected, rel=1e-5)
        assert sum(sum(links.values()) for links in result["gathered"].values()) > 0  # shared rows: on the ledger
