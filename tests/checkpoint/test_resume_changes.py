"""A resume says what changed: resharding from another stage, world size or precision, and optimizer
settings that differ from the checkpoint's (the configured ones win unless asked otherwise)."""

from __future__ import annotations

import contextlib
import io

import torch
from cli_runner import run_cli
from launcher import free_port, run_ranks
from torch import nn


def engine_for(stage: int, precision: str = "fp32", weight_decay: float = 0.0):
    from zeropp import ZeroEngine
    from zeropp.config.sections import TopologyConfig, ZeroConfig
    from zeropp.topology import init_topology

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    optimizer = dict(lr=1e-2, weight_decay=weight_decay, betas=(0.9, 0.95))
    config = ZeroConfig(stage=stage, precision=precision)
    return ZeroEngine(model, torch.optim.AdamW, optimizer, config, init_topology(TopologyConfig()), units=list(model))


def said(call) -> tuple[str, object]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = call()
    return out.getvalue(), result


def save_then_load_worker(root: str) -> dict:
    from zeropp.checkpoint import load_checkpoint, save_checkpoint

    engine = engine_for(stage=1)
    engine.backward(engine(torch.ones(2, 8)).sum())
    engine.step()
    path = save_checkpoint(engine, root, 1)
    other = engine_for(stage=3, precision="bf16", weight_decay=0.05)
    lines, _ = said(lambda: load_checkpoint(other, path))
    asked = engine_for(stage=1, weight_decay=0.05)
    taken, _ = said(lambda: load_checkpoint(asked, path, optimizer_settings="checkpoint"))
    same, _ = said(lambda: load_checkpoint(engine_for(stage=1), path))
    groups = [e.optimizer.param_groups[0]["weight_decay"] for e in (other, asked)]
    return dict(lines=lines, taken=taken, same=same, weight_decays=groups, path=str(path))


def load_worker(path: str) -> str:
    from zeropp.checkpoint import load_checkpoint

    return said(lambda: load_checkpoint(engine_for(stage=1), path))[0]


def test_the_api_names_resharding_and_keeps_the_configured_optimizer_settings(tmp_path):
    ranks = run_ranks(save_then_load_worker, 2, root=str(tmp_path))
    first = ranks[0]
    path = first["path"]
    assert first["lines"].splitlines() == [
        f"zeropp: resharding checkpoint {path!r}, saved at stage 1, precision fp32, for this run's stage 3, precision bf16",
        f"zeropp: keeping the configured optimizer settings over checkpoint {path!r}'s: "
        "weight_decay = 0.05 (the checkpoint has 0.0)",
    ]
    assert first["taken"] == (
        f"zeropp: taking checkpoint {path!r}'s optimizer settings over the configured: "
        "weight_decay = 0.05 (the checkpoint has 0.0)\n"
    )
    assert first["same"] == "" and ranks[1]["lines"] == ranks[1]["taken"] == ""
    assert all(r["weight_decays"] == [0.05, 0.0] for r in ranks)
    # another world size: one rank loads what two saved
    assert run_ranks(load_worker, 1, path=path)[0] == (
        f"zeropp: resharding checkpoint {path!r}, saved at world size 2, for this run's world size 1\n"
    )


def test_zeropp_train_resume_names_the_stage_and_world_it_reshards_from(tmp_path):
    folder = str(tmp_path / "ckpt")
    base = ["train", "--preset", "tiny", "--eval-batches", "1", "--checkpoint-dir", folder]
    first = run_cli(*base, "--nproc-per-node", "2", "--steps", "2", "--stage", "1", "--master-port", str(free_port()))
    assert first.returncode == 0, first.stderr[-2000:]
    resumed = run_cli(
        *base,
        "--nproc-per-node",
        "1",
        "--steps",
        "3",
        "--stage",
        "2",
        "--resume",
        "auto",
        "--master-port",
        str(free_port()),
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    lines = [line for line in resumed.stdout.splitlines() if line.startswith("zeropp: resharding")]
    assert lines == [
        f"zeropp: resharding checkpoint '{folder}/step-00000002', saved at stage 1, world size 2, nodes 2, "
        "for this run's stage 2, world size 1, nodes 1"
    ], resumed.stdout[-2000:]
    assert "optimizer settings" not in resumed.stdout  # the schedule's lr at step 2 is the saved one


def test_a_resume_at_another_context_parallel_size_is_named():
    from zeropp.checkpoint.changes import resharding_line

    saved = dict(world_size=4, nodes=1, tensor_parallel_size=1, context_parallel_size=2, stage=3, precision="fp32")
    here = {**saved, "context_parallel_size": 1}
    assert resharding_line(saved, here, "ckpt") == (
        "zeropp: resharding checkpoint 'ckpt', saved at context parallel 2, for this run's context parallel 1"
    )
    older = {k: v for k, v in saved.items() if k != "context_parallel_size"}  # written before the key existed
    assert resharding_line(older, here, "ckpt") is None
