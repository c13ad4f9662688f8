"""DeepSpeed checkpoints imported (zeropp import-deepspeed): DeepSpeed itself (on the CPU, gloo, data
parallel 2) trains a tiny GPT and a tiny Hugging Face Llama at ZeRO stages 1, 2 and 3 in fp32 and
bf16 (and fp16) and saves; the import equals DeepSpeed's zero_to_fp32 exactly, and 5 more fp32 steps
in zeropp at world 1, 2 and 4 end where 5 more steps in DeepSpeed from the same checkpoint end.
Damaged or unsupported checkpoints are refused in one line, with nothing written.

DeepSpeed trains, in one launch, only the cases the selected tests read; a case in a precision
DeepSpeed's CPU accelerator refuses on this CPU (fp16 without oneDNN fp16 kernels) is skipped with
that reason, and the others run."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
from pathlib import Path

import pytest
import torch
from cli_runner import run_cli
from launcher import run_ranks
from machine import deepspeed_cpu_refuses
from models import ADAM_EPS, TOLERANCE, global_batch, loss_of, make_model, rows

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed's import picks and caches an accelerator
pytest.importorskip("deepspeed")

LR = 3e-3
STEPS = 5
DATA_PARALLEL = 2
PER_RANK = 2  # DeepSpeed's micro-batch: the global batch is 4 rows at every world size
CASES = {
    f"{kind}-stage{stage}-{precision}": (kind, stage, precision)
    for kind in ("gpt", "hf-llama")
    for stage in (1, 2, 3)
    for precision in ("fp32", "bf16")
}
CASES["gpt-stage2-fp16"] = ("gpt", 2, "fp16")
GROUPED = "gpt-groups-stage2-fp32"  # AdamW in two param groups of their own decay and betas; always continued
CASES[GROUPED] = ("gpt", 2, "fp32")
CONTINUED = [name for name, (_, _, precision) in CASES.items() if precision == "fp32" and name != GROUPED]
REFUSED = {name: why for name, (_, _, precision) in CASES.items() if (why := deepspeed_cpu_refuses(precision))}
# what each test reads of DeepSpeed's runs, beyond its own `case`: ("continued" also trains the fp32 cases on)
READS = {
    "test_five_more_steps_match_deepspeed": ["continued"],
    "test_cli_imports_then_train_resumes_and_export_reads_it": ["gpt-stage3-fp32"],
    "test_damaged_checkpoint_is_one_line_and_writes_nothing": ["gpt-stage1-fp32"],
    "test_cli_refusal_is_one_line_with_status_2": ["gpt-stage3-fp32"],
    "test_param_groups_import_and_resume_where_deepspeed_continues": [GROUPED],
}


def cases(names) -> list:
    """`names` as parameters, each skipped with DeepSpeed's reason where this CPU lacks its precision."""
    return [
        pytest.param(name, marks=pytest.mark.skip(reason=REFUSED[name])) if name in REFUSED else name for name in names
    ]


def ds_config(stage: int, precision: str) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": PER_RANK,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**6,
        "zero_optimization": {"stage": stage},
        # a constant rate, so that the lr scheduler's state is saved and zeropp's steps match
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": LR, "warmup_max_lr": LR, "warmup_num_steps": 1}},
    }
    if precision != "fp32":
        config[precision] = {"enabled": True, **({"initial_scale_power": 8} if precision == "fp16" else {})}
    return config


def grouped_adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    """Decay and betas of their own for the matrices and the rest (DeepSpeed's WarmupLR sets every
    group's lr, so the lr is one)."""
    matrices = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    groups = [{"params": matrices, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0, "betas": (0.8, 0.95)}]
    return torch.optim.AdamW(groups, lr=LR, eps=ADAM_EPS)


def _ds_engine(kind: str, stage: int, precision: str, grouped: bool = False):
    import deepspeed

    model = make_model(kind)
    optimizer = (
        grouped_adamw(model)
        if grouped
        else torch.optim.AdamW(model.parameters(), lr=LR, eps=ADAM_EPS, weight_decay=0.01)
    )
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(stage, precision))
    return engine


def _ds_steps(engine, kind: str, steps: range) -> None:
    rank = torch.distributed.get_rank()
    for step in steps:
        x, y = rows(global_batch(kind, step, 0, DATA_PARALLEL, PER_RANK), rank, PER_RANK)
        engine.backward(loss_of(kind, engine, x, y))
        engine.step()


def deepspeed_worker(root: str, names: list[str], continued: list[str]) -> None:
    """Each case in `names`: 5 steps, saved (``first``); for those in `continued`, a new engine loads
    it, 5 more (``continued``)."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    for name in names:
        kind, stage, precision = CASES[name]
        folder, grouped = Path(root) / name, name == GROUPED
        engine = _ds_engine(kind, stage, precision, grouped)
        _ds_steps(engine, kind, range(STEPS))
        engine.save_checkpoint(str(folder / "first"))
        if name in continued or grouped:
            engine = _ds_engine(kind, stage, precision, grouped)
            engine.load_checkpoint(str(folder / "first"))
            _ds_steps(engine, kind, range(STEPS, 2 * STEPS))
            engine.save_checkpoint(str(folder / "continued"))


def selected_reads(session: pytest.Session) -> set[str]:
    """What the selected tests of this module read: case names, and "continued"."""
    reads: set[str] = set()
    for item in session.items:
        if isinstance(item, pytest.Function) and item.module.__name__ == __name__:
            case = item.callspec.params.get("case") if hasattr(item, "callspec") else None
            reads.update(READS.get(item.originalname, [case] if case not in (None, *REFUSED) else []))
    return reads


@pytest.fixture(scope="module")
def deepspeed_runs(request, tmp_path_factory) -> Path:
    reads = selected_reads(request.session)
    continued = CONTINUED if "continued" in reads else []
    names = [name for name in CASES if name in reads or name in continued]
    root = tmp_path_factory.mktemp("deepspeed")
    run_ranks(deepspeed_worker, DATA_PARALLEL, root=str(root), names=names, continued=continued)
    return root


@pytest.fixture(scope="module")
def imported(deepspeed_runs, tmp_path_factory) -> dict[str, Path]:
    """Every case DeepSpeed trained, imported."""
    from zeropp.checkpoint.deepspeed_import import import_deepspeed

    out = tmp_path_factory.mktemp("imported")
    trained = [name for name in CASES if (deepspeed_runs / name).is_dir()]
    return {name: import_deepspeed(deepspeed_runs / name / "first", out / name).path for name in trained}


def zero_to_fp32(folder: Path) -> dict[str, torch.Tensor]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return get_fp32_state_dict_from_zero_checkpoint(str(folder))


@pytest.mark.parametrize("case", cases(CASES))
def test_imported_masters_equal_zero_to_fp32_exactly(deepspeed_runs, imported, case):
    from zeropp.checkpoint.dcp import consolidated_state

    meta, ours = consolidated_state(imported[case])
    theirs = zero_to_fp32(deepspeed_runs / case / "first")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k].float()) for k in theirs)
    kind, stage, precision = CASES[case]
    assert (meta["step"], meta["stage"], meta["precision"], meta["world_size"]) == (STEPS, stage, precision, 2)
    assert meta["optimizer"] == "torch.optim.adamw.AdamW" and meta["param_groups"][0]["lr"] == LR
    assert meta["extra"]["deepspeed"]["lr_scheduler"] == {"last_batch_iteration": STEPS - 1}
    if precision == "fp16":
        assert meta["scaler"] == {"scale": 256.0, "clean_steps": STEPS, "hysteresis": 2}


def zeropp_worker(paths: dict[str, str]) -> dict[str, dict[str, torch.Tensor]]:
    """5 more steps in zeropp (stage 3, fp32) from each imported checkpoint, on this world."""
    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.checkpoint.dcp import load_checkpoint
    from zeropp.topology import init_topology

    topology = init_topology()
    per_rank = DATA_PARALLEL * PER_RANK // topology.world_size
    out = {}
    for name, path in paths.items():
        kind = CASES[name][0]
        engine = ZeroEngine(
            make_model(kind), torch.optim.AdamW, dict(lr=LR, eps=ADAM_EPS), ZeroConfig(stage=3), topology
        )
        load_checkpoint(engine, path)
        for step in range(STEPS, 2 * STEPS):
            x, y = rows(global_batch(kind, step, 0, DATA_PARALLEL, PER_RANK), topology.rank, per_rank)
            engine.backward(loss_of(kind, engine, x, y))
            engine.step()
        out[name] = engine.full_state_dict()
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_five_more_steps_match_deepspeed(deepspeed_runs, imported, world):
    paths = {name: str(imported[name]) for name in CONTINUED}
    ours = run_ranks(zeropp_worker, world, paths=paths)[0]
    diffs = {}
    for name in CONTINUED:
        theirs = zero_to_fp32(deepspeed_runs / name / "continued")
        before = zero_to_fp32(deepspeed_runs / name / "first")
        assert any(not torch.equal(theirs[k], before[k]) for k in theirs), name  # DeepSpeed did train on
        diffs[name] = max((ours[name][k] - theirs[k]).abs().max().item() for k in theirs)
    print(f"world {world}: max |zeropp - DeepSpeed| after 5 more steps: {diffs}")
    assert all(d <= TOLERANCE for d in diffs.values()), diffs


def grouped_worker(path: str) -> dict:
    """5 more steps from the two-group import with the same two groups (whole parameters on owner
    ranks), and the line a one-group run gets when it loads it."""
    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.checkpoint.dcp import load_checkpoint
    from zeropp.topology import init_topology

    topology = init_topology()
    model = make_model("gpt")
    engine = ZeroEngine(model, grouped_adamw(model), None, ZeroConfig(stage=3), topology)
    load_checkpoint(engine, path)
    for step in range(STEPS, 2 * STEPS):
        x, y = rows(global_batch("gpt", step, 0, DATA_PARALLEL, PER_RANK), topology.rank)
        engine.backward(loss_of("gpt", engine, x, y))
        engine.step()
    one_group = ZeroEngine(make_model("gpt"), torch.optim.AdamW, dict(lr=LR), ZeroConfig(stage=3), topology)
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        load_checkpoint(one_group, path)
    return {"state": engine.full_state_dict(), "said": said.getvalue()}


def test_param_groups_import_and_resume_where_deepspeed_continues(deepspeed_runs, imported):
    from zeropp.checkpoint.dcp import read_meta

    groups = read_meta(imported[GROUPED])["param_groups"]
    assert [(g["weight_decay"], g["betas"]) for g in groups] == [(0.01, [0.9, 0.999]), (0.0, [0.8, 0.95])]
    theirs = zero_to_fp32(deepspeed_runs / GROUPED / "continued")
    for rank, ours in enumerate(run_ranks(grouped_worker, 2, path=str(imported[GROUPED]))):
        assert max((ours["state"][k] - theirs[k]).abs().max().item() for k in theirs) <= TOLERANCE
        expected = "keeping the configured optimizer settings (1 param group) over checkpoint"
        assert (expected in ours["said"]) == (rank == 0), ours["said"]


def test_cli_imports_then_train_resumes_and_export_reads_it(deepspeed_runs, tmp_path):
    out = tmp_path / "zeropp"
    done = run_cli("import-deepspeed", str(deepspeed_runs / "gpt-stage3-fp32" / "first"), str(out))
    assert done.returncode == 0, done.stderr
    assert "wrote" in done.stdout and "stage 3, 2 data-parallel ranks, fp32" in done.stdout
    model = ["--preset", "tiny", "--block-size", "16", "--n-layer", "2", "--n-head", "2", "--d-model", "32"]
    resumed = run_cli(
        "train", *model, "--steps", "7", "--eval-batches", "1", "--nproc-per-node", "2", "--stage", "1",
        "--resume", str(out / "step-00000005"), "--checkpoint-dir", str(tmp_path / "run"),
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert (tmp_path / "run" / "step-00000007").is_dir()
    exported = run_cli("export", str(out / "step-00000005"), str(tmp_path / "model.safetensors"))
    assert exported.returncode == 0, exported.stderr


# -- refusals: one line each, nothing written -------------------------------------------------------


def _copy(deepspeed_runs: Path, name: str, tmp_path: Path) -> tuple[Path, Path]:
    source = tmp_path / "ds"
    shutil.copytree(deepspeed_runs / name / "first", source)
    return source, source / "global_step5"


def _with_model_states(tag: Path, change) -> None:
    from zeropp.checkpoint.deepspeed_files import load_file

    path = tag / "mp_rank_00_model_states.pt"
    states = load_file(path)
    change(states)
    torch.save(states, path)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGE = {
    "missing rank file": (
        lambda tag: (tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink(),
        "the optimizer states of rank 1 are missing",
    ),
    "truncated file": (
        lambda tag: _truncate(tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
        "is truncated or not a torch.save file",
    ),
    "wrong tag": (lambda tag: (tag.parent / "latest").write_text("global_step9"), "names tag 'global_step9'"),
    "tensor parallel": (
        lambda tag: shutil.copy(tag / "mp_rank_00_model_states.pt", tag / "mp_rank_01_model_states.pt"),
        "is a tensor-parallel checkpoint",
    ),
    "pipeline": (
        lambda tag: shutil.copy(tag / "mp_rank_00_model_states.pt", tag / "layer_01-model_states.pt"),
        "is a pipeline-parallel checkpoint",
    ),
    "other optimizer": (
        lambda tag: _with_model_states(tag, lambda s: s["ds_config"].update(optimizer={"type": "Lamb"})),
        "optimizer Lamb; zeropp imports Adam, AdamW and SGD states only",
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_checkpoint_is_one_line_and_writes_nothing(deepspeed_runs, tmp_path, damage):
    from zeropp.checkpoint.deepspeed_import import import_deepspeed
    from zeropp.errors import ZeroppError

    source, tag = _copy(deepspeed_runs, "gpt-stage1-fp32", tmp_path)
    spoil, message = DAMAGE[damage]
    spoil(tag)
    out = tmp_path / "out"
    with pytest.raises(ZeroppError) as refused:
        import_deepspeed(source, out)
    assert "\n" not in str(refused.value) and message in str(refused.value), str(refused.value)
    assert not out.exists()


def test_cli_refusal_is_one_line_with_status_2(deepspeed_runs, tmp_path):
    source, tag = _copy(deepspeed_runs, "gpt-stage3-fp32", tmp_path)
    (tag / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    done = run_cli("import-deepspeed", str(source), str(tmp_path / "out"))
    assert done.returncode == 2 and done.stdout == "", done.stdout
    assert done.stderr.count("\n") == 1 and "lacks zero_pp_rank_1_mp_rank_00_model_states.pt" in done.stderr, (
        done.stderr
    )
    assert not (tmp_path / "out").exists()
