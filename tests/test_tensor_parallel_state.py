"""Tensor parallelism and the training state: DCP checkpoints across meshes (dp 2 x tp 2 saved, loaded
at dp 4, dp 1 x tp 2 and on one rank), exact resume, export."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from launcher import run_ranks
from test_checkpoint import PROBE, _config, _weights

STEPS, SAVED_AT = 8, 4


def save_tp_worker(root: str) -> dict:
    """dp 2 x tp 2 on 2 nodes: the uninterrupted run, and a run saved at step 4 then resumed."""
    from zeropp.train import Trainer

    def config(name: str, **checkpoint):
        tp = {"tensor_parallel_size": 2}
        return _config(Path(root) / name, STEPS, nodes=2, micro_batch=2, zero={"stage": 3}, topology=tp, **checkpoint)

    straight = Trainer(config("straight"))
    straight_losses = [straight.train_step(step) for step in range(STEPS)]
    first = Trainer(config("saved"))
    for step in range(SAVED_AT):
        first.train_step(step)
    first.save(SAVED_AT)
    saved = _weights(first)
    with torch.no_grad():
        logits = first.engine.eval()(PROBE)
    resumed = Trainer(config("saved", checkpoint={"resume": "auto"}))
    resumed_losses = [resumed.train_step(step) for step in range(resumed.start_step, STEPS)]
    a, b = _weights(straight), _weights(resumed)
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
    from zeropp.train import Trainer

    checkpoint = {"resume": str(Path(root) / "saved" / f"step-{SAVED_AT:08d}")}
    topology = {"tensor_parallel_size": tp}
    trainer = Trainer(
        _config(Path(root) / f"tp{tp}", STEPS, nodes=1, micro_batch=micro_batch, zero={"stage": stage},
                topology=topology, checkpoint=checkpoint)  # fmt: skip
    )
    loaded = _weights(trainer)
    for step in range(trainer.start_step, STEPS):
        trainer.train_step(step)
    return dict(start=trainer.start_step, loaded=loaded, final=_weights(trainer))


def test_a_dp2_tp2_checkpoint_resumes_exactly_and_loads_on_other_meshes_and_exports(tmp_path):
    from safetensors.torch import load_file

    from zeropp.checkpoint import export_checkpoint
    from zeropp.models.gpt import GPT, gpt_config

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
    model = GPT(gpt_config(_config(tmp_path, STEPS, nodes=1).model))
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

    from zeropp.checkpoint import FLAT_FORMAT, CheckpointError, consolidated_state, load_checkpoint

    shutil.copytree(path, copy)
    meta = json.loads((copy / "zeropp.json").read_text())
    (copy / "zeropp.json").write_text(json.dumps({**meta, "format": FLAT_FORMAT}))
    with pytest.raises(CheckpointError, match="older zeropp .* export it .* --init-from") as refused:
        load_checkpoint(None, copy)
    assert "\n" not in str(refused.value)
    assert all(torch.equal(consolidated_state(copy)[1][k], whole[k]) for k in whole)
