"""Pretrained weights straight into the shards: sharded Hugging Face folders, exported checkpoints,
and one line per missing, unexpected or wrongly shaped tensor."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
from launcher import run_ranks
from models import make_model
from safetensors.torch import save_file


def write_sharded_folder(state: dict[str, torch.Tensor], folder: Path, parts: int = 2) -> None:
    """The Hugging Face layout: weights split over files, listed in model.safetensors.index.json."""
    folder.mkdir(parents=True, exist_ok=True)
    keys = sorted(state)
    weight_map = {}
    for part in range(parts):
        name = f"model-{part + 1:05d}-of-{parts:05d}.safetensors"
        chunk = {k: state[k].contiguous() for k in keys[part::parts]}
        save_file(chunk, str(folder / name))
        weight_map.update(dict.fromkeys(chunk, name))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _reference(kind: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(7)
    model = make_model(kind)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))  # nothing like a fresh initialization
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def load_into_shards(simulated_nodes: int, kind: str, folder: str, tp: int = 1) -> dict[str, float]:
    import zeropp.checkpoint.pretrained as pretrained
    from zeropp import ZeroConfig, ZeroEngine, load_pretrained
    from zeropp.config.sections import TopologyConfig
    from zeropp.tensor_parallel.apply import parallelize
    from zeropp.topology import init_topology

    topology = init_topology(TopologyConfig(nodes=simulated_nodes, tensor_parallel_size=tp))
    expected = _reference(kind)
    errors = {}
    read = pretrained._read_elements
    counted = []

    def counting(handle, key, start, stop, *block):  # what this rank reads of the managed parameters
        rows = read(handle, key, start, stop, *block)
        counted.append(rows.numel())
        return rows

    pretrained._read_elements = counting
    for stage in (1, 2, 3):
        with torch.device("meta") if tp == 1 else contextlib.nullcontext():
            model = parallelize(make_model(kind), topology)  # tensor parallel: each rank its piece
        engine = ZeroEngine(model, torch.optim.AdamW, dict(lr=1e-3), ZeroConfig(stage=stage), topology)
        load_pretrained(engine, folder)
        loaded = engine.full_state_dict()
        errors[f"stage{stage}"] = max((loaded[k] - expected[k].float()).abs().max().item() for k in expected)
        errors[f"stage{stage}-keys"] = float(loaded.keys() != expected.keys())
        # a rank reads its shard of the flat buffer: at most 1/world of the parameters (plus padding;
        # with tensor parallelism its data-parallel shard of its tensor-parallel pieces)
        shards = sum(unit.master.numel() for unit in engine.units)
        errors[f"stage{stage}-read-beyond-shard"] = float(sum(counted) > shards)
        counted.clear()
    return errors


@pytest.mark.parametrize("kind,tp", [("gpt", 1), ("hf-llama", 1), ("gpt", 2), ("hf-gpt2", 2)])
def test_sharded_folder_loads_exactly_at_every_stage(tmp_path, kind, tp):
    if kind.startswith("hf-"):
        pytest.importorskip("transformers")
    state = _reference(kind)
    if kind == "gpt":
        del state["head.weight"]  # tied to wte.weight: stored once, as Hugging Face stores tied weights
    write_sharded_folder(state, tmp_path / "weights")
    folder = str(tmp_path / "weights")
    for errors in run_ranks(load_into_shards, 4, nodes=2, simulated_nodes=2, kind=kind, folder=folder, tp=tp):
        assert all(value == 0.0 for value in errors.values()), errors


def bad_weights(path: str) -> str:
    from zeropp import ZeroEngine, load_pretrained
    from zeropp.checkpoint.pretrained import PretrainedError
    from zeropp.topology import init_topology

    engine = ZeroEngine(make_model("gpt"), torch.optim.AdamW, dict(lr=1e-3), None, init_topology())
    try:
        load_pretrained(engine, path)
    except PretrainedError as error:
        return str(error)
    return "no error"


def test_every_bad_tensor_gets_one_line(tmp_path):
    state = _reference("gpt")
    del state["wpe.weight"]
    state["blocks.0.ln_1.weight"] = torch.ones(3)
    state["extra.bias"] = torch.zeros(2)
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "bad.safetensors"))
    lines = run_ranks(bad_weights, 1, path=str(tmp_path / "bad.safetensors"))[0].splitlines()
    assert len(lines) == 3, lines
    assert any(line.startswith("missing key 'wpe.weight'") for line in lines)
    assert any("'blocks.0.ln_1.weight' has shape (3,) there and (32,) in the model" in line for line in lines)
    assert "unexpected key 'extra.bias'" in lines
    message = run_ranks(bad_weights, 1, path=str(tmp_path / "nowhere"))[0]
    assert "nowhere" in message and "\n" not in message


def export_and_reload(root: str) -> float:
    from zeropp import ZeroConfig, ZeroEngine, load_pretrained
    from zeropp.checkpoint.dcp import export_checkpoint, save_checkpoint
    from zeropp.config.sections import TopologyConfig
    from zeropp.topology import init_topology

    topology = init_topology(TopologyConfig(nodes=2))
    trained = ZeroEngine(make_model("gpt"), torch.optim.AdamW, dict(lr=1e-2), ZeroConfig(stage=3), topology)
    x = torch.randint(0, 256, (2, 16))
    trained.backward(trained(x, x))
    trained.step()
    saved = save_checkpoint(trained, root, 1)
    if topology.rank == 0:
        export_checkpoint(saved, Path(root) / "model.safetensors")
    trained.comm.barrier(topology.world)
    with torch.device("meta"):
        model = make_model("gpt")
    fresh = ZeroEngine(model, torch.optim.AdamW, dict(lr=1e-2), ZeroConfig(stage=2), topology)
    load_pretrained(fresh, Path(root) / "model.safetensors")
    before, after = trained.full_state_dict(), fresh.full_state_dict()
    return max((before[k] - after[k]).abs().max().item() for k in before)


def test_round_trip_with_export(tmp_path):
    assert run_ranks(export_and_reload, 4, nodes=2, root=str(tmp_path)) == [0.0] * 4
