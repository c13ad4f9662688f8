"""Tensor parallelism and the training state: DCP checkpoints across meshes (dp 2 x tp 2 saved, loaded
at dp 4, dp 1 x tp 2 and on one rank), exact resume, export."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from launcher import run_ranks
from models import ADAM_EPS, TOLERANCE
from runs import PROBE, run_config, weights_of

STEPS, SAVED_AT = 8, 4


def save_tp_worker(root: str) -> dict:
    """dp 2 x tp 2 on 2 nodes: the uninterrupted run, and a run saved at step 4 then resumed."""
    from zeropp.app.trainer import Trainer

    def config(name: str, **checkpoint):
        tp = {"tensor_parallel_size": 2}
        return run_config(
            Path(root) / name, STEPS, nodes=2, micro_batch=2, zero={"stage": 3}, topology=tp, **checkpoint
        )

    straight = Trainer(config("straight"))
    straight_losses = [straight.train_step(step) for step in range(STEPS)]
    first = Trainer(config("saved"))
    for step in range(SAVED_AT):
        first.train_step(step)
    first.save(SAVED_AT)
    saved = weights_of(first)
    with torch.no_grad():
        logits = first.engine.eval()(PROBE)
    resumed = Trainer(config("saved", checkpoint={"resume": "auto"}))
    resumed_losses = [resumed.train_step(step) for step in range(resumed.start_step, STEPS)]
    a, b = weights_of(straight), weights_of(resumed)
    return dict(
        start=resumed.start_step,
        losses_equal=straight_losses[SAVED_AT:] == resumed_losses,
        weights_equal=all(torch.equal(a[k], b[k]) for k in a),
        saved=saved,
        logits=logits,
        final=a,
    )


def load_worker(root: str, tp: int, micro_batch: int, stage: int) -> dict:
    """Resume the dp 2 x tp 2 checkpoint on another mesh and train to the end."""
    from zeropp.app.trainer import Trainer

    checkpoint = {"resume": str(Path(root) / "saved" / f"step-{SAVED_AT:08d}")}
    topology = {"tensor_parallel_size": tp}
    trainer = Trainer(
        run_config(
            Path(root) / f"tp{tp}",
            STEPS,
            nodes=1,
            micro_batch=micro_batch,
            zero={"stage": stage},
            topology=topology,
            checkpoint=checkpoint,
        )  # fmt: skip
    )
    loaded = weights_of(trainer)
    for step in range(trainer.start_step, STEPS):
        trainer.train_step(step)
    return dict(start=trainer.start_step, loaded=loaded, final=weights_of(trainer))


def test_a_dp2_tp2_checkpoint_resumes_exactly_and_loads_on_other_meshes_and_exports(tmp_path):
    from safetensors.torch import load_file

    from zeropp.app.models.gpt import GPT, gpt_config
    from zeropp.checkpoint.dcp import export_checkpoint

    saved_run = run_ranks(save_tp_worker, 4, nodes=2, root=str(tmp_path))
    for rank, result in enumerate(saved_run):
        assert (result["start"], result["losses_equal"], result["weights_equal"]) == (SAVED_AT, True, True), rank
    reference = saved_run[0]
    exported = tmp_path / "model.safetensors"
    meta = export_checkpoint(tmp_path / "saved" / f"step-{SAVED_AT:08d}", exported)
    assert (meta["world_size"], meta["tensor_parallel_size"]) == (4, 2)
    whole = load_file(str(exported))
    assert whole.keys() == reference["saved"].keys()
    assert all(torch.equal(whole[k], reference["saved"][k]) for k in whole), "export differs from the run's weights"
    model = GPT(gpt_config(run_config(tmp_path, STEPS, nodes=1).model))
    model.load_state_dict(whole)  # the unmodified model, unsharded
    with torch.no_grad():
        assert torch.allclose(model(PROBE), reference["logits"], atol=1e-6, rtol=0)
    _older_format_is_refused_but_exports(tmp_path / "saved" / f"step-{SAVED_AT:08d}", tmp_path / "old", whole)
    # (world, tp, micro-batch, stage): the same global batch of 4 rows on every mesh
    for world, tp, micro, stage in ((4, 1, 1, 2), (2, 2, 4, 1), (1, 1, 4, 3)):
        for result in run_ranks(load_worker, world, root=str(tmp_path), tp=tp, micro_batch=micro, stage=stage):
            assert result["start"] == SAVED_AT
            assert all(torch.equal(result["loaded"][k], whole[k]) for k in whole), (world, tp)
            # weights and Adam's moments resharded: training goes on as in the uninterrupted run
            error = max((result["final"][k] - reference["final"][k]).abs().max().item() for k in whole)
            assert error <= 1e-5, f"dp {world // tp} x tp {tp} continued {error:.3g} away from dp 2 x tp 2"


def _older_format_is_refused_but_exports(path: Path, copy: Path, whole: dict[str, torch.Tensor]) -> None:
    """A checkpoint marked as written before the whole-shaped layout (zeropp-checkpoint/1) cannot be
    resumed, refused in one line from zeropp.json alone (before any collective); it still exports."""
    import json
    import shutil

    from zeropp.checkpoint.dcp import FLAT_FORMAT, CheckpointError, consolidated_state, load_checkpoint

    shutil.copytree(path, copy)
    meta = json.loads((copy / "zeropp.json").read_text())
    (copy / "zeropp.json").write_text(json.dumps({**meta, "format": FLAT_FORMAT}))
    with pytest.raises(CheckpointError, match="older zeropp .* export it .* --init-from") as refused:
        load_checkpoint(None, copy)
    assert "\n" not in str(refused.value)
    assert all(torch.equal(consolidated_state(copy)[1][k], whole[k]) for k in whole)


# -- Hugging Face GPT-2, whose c_attn pieces are strided (several blocks of the whole per rank) -----------

GPT2_OPTIM = dict(lr=1e-2, eps=ADAM_EPS, weight_decay=0.01)


def gpt2_engine(tp: int, stage: int, nodes: int = 1):
    from models import make_model

    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.config.sections import TopologyConfig
    from zeropp.tensor_parallel.apply import parallelize
    from zeropp.topology import init_topology

    topology = init_topology(TopologyConfig(nodes=nodes, tensor_parallel_size=tp))
    model = parallelize(make_model("hf-gpt2"), topology)
    return ZeroEngine(model, torch.optim.AdamW, dict(GPT2_OPTIM), ZeroConfig(stage=stage), topology)


def gpt2_steps(engine, steps: range) -> list[float]:
    """Train on the same global batch of 4 rows at every mesh (its data-parallel ranks' share each)."""
    from models import global_batch, loss_of, rows

    dp = engine.topology.data_parallel
    losses = []
    for step in steps:
        x, y = rows(global_batch("hf-gpt2", step, 0, dp.size, 4 // dp.size), dp.rank, 4 // dp.size)
        loss = loss_of("hf-gpt2", engine, x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def save_gpt2_worker(root: str) -> dict:
    """dp 2 x tp 2 on 2 nodes: train, save at step 4, go on; a second engine (other weights) resumes it."""
    from zeropp.checkpoint.dcp import load_checkpoint, save_checkpoint

    straight = gpt2_engine(2, 3, nodes=2)
    gpt2_steps(straight, range(SAVED_AT))
    save_checkpoint(straight, root, SAVED_AT)
    saved = straight.full_state_dict()
    straight_losses = gpt2_steps(straight, range(SAVED_AT, STEPS))
    resumed = gpt2_engine(2, 3, nodes=2)
    gpt2_steps(resumed, range(STEPS, STEPS + 1))  # weights and moments unlike the checkpoint's
    meta = load_checkpoint(resumed, Path(root) / f"step-{SAVED_AT:08d}")
    resumed_losses = gpt2_steps(resumed, range(SAVED_AT, STEPS))
    a, b = straight.full_state_dict(), resumed.full_state_dict()
    return dict(
        step=meta["step"],
        losses_equal=straight_losses == resumed_losses,
        weights_equal=all(torch.equal(a[k], b[k]) for k in a),
        saved=saved,
        final=a,
    )


def load_gpt2_worker(root: str, tp: int, stage: int) -> dict:
    """The dp 2 x tp 2 checkpoint loaded on another mesh, trained to the end."""
    from zeropp.checkpoint.dcp import load_checkpoint

    engine = gpt2_engine(tp, stage)
    load_checkpoint(engine, Path(root) / f"step-{SAVED_AT:08d}")
    loaded = engine.full_state_dict()
    gpt2_steps(engine, range(SAVED_AT, STEPS))
    return dict(loaded=loaded, final=engine.full_state_dict())


def test_a_dp2_tp2_gpt2_checkpoint_resumes_exactly_loads_on_other_meshes_and_exports(tmp_path):
    pytest.importorskip("transformers")
    from models import make_model, reference_state
    from safetensors.torch import load_file

    from zeropp.checkpoint.dcp import export_checkpoint

    saved_run = run_ranks(save_gpt2_worker, 4, nodes=2, root=str(tmp_path))
    for rank, result in enumerate(saved_run):
        assert (result["step"], result["losses_equal"], result["weights_equal"]) == (SAVED_AT, True, True), rank
    reference = saved_run[0]
    exported = tmp_path / "model.safetensors"
    export_checkpoint(tmp_path / f"step-{SAVED_AT:08d}", exported)
    whole = load_file(str(exported))
    # the standard unsharded Hugging Face layout: the single-process model's keys, shapes and values
    one_process = reference_state("hf-gpt2", SAVED_AT, 2, 1, None, GPT2_OPTIM)
    assert {k: v.shape for k, v in whole.items()} == {k: v.shape for k, v in make_model("hf-gpt2").state_dict().items()}
    assert all(torch.equal(whole[k], reference["saved"][k]) for k in whole), "export differs from the run's weights"
    assert max((whole[k] - one_process[k]).abs().max().item() for k in whole) <= TOLERANCE
    make_model("hf-gpt2").load_state_dict(whole)  # the unmodified model takes it
    for world, tp, stage in ((4, 1, 2), (2, 2, 1), (1, 1, 3)):  # dp 4, dp 1 x tp 2, one rank
        for result in run_ranks(load_gpt2_worker, world, root=str(tmp_path), tp=tp, stage=stage):
            assert all(torch.equal(result["loaded"][k], whole[k]) for k in whole), (world, tp)
            error = max((result["final"][k] - reference["final"][k]).abs().max().item() for k in whole)
            assert error <= 1e-5, f"dp {world // tp} x tp {tp} continued {error:.3g} away from dp 2 x tp 2"
