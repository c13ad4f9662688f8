"""Adapter checkpoints: a LoRA run on a frozen base saved with ``frozen_base=PATH`` holds the adapters'
masters and optimizer states only (the base referenced by path and sha256), resumes exactly, refuses
another base in one line, exports in full as the full checkpoint does, and ``zeropp export
--adapter-only`` writes a folder ``peft.PeftModel.from_pretrained`` loads with the engine's logits."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from launcher import run_ranks
from models import global_batch, loss_of, make_model, rows

peft = pytest.importorskip("peft")

PROBE = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8]])


def _engine(base: Path, topology, seed: int, perturb: bool = False):
    import transformers

    from zeropp import ZeroConfig, ZeroEngine

    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    if perturb:  # another base: one frozen weight differs
        with torch.no_grad():
            model.model.layers[0].mlp.up_proj.weight[0, 0] += 1.0
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    lora = peft.get_peft_model(model, config)
    return ZeroEngine(lora, torch.optim.AdamW, dict(lr=1e-2), ZeroConfig(stage=3, persistence_threshold=0), topology)


def _logits(engine) -> torch.Tensor:
    engine.eval()
    with torch.no_grad():
        return engine(input_ids=PROBE).logits


def adapter_worker(base: Path, out: Path) -> dict:
    from zeropp.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
    from zeropp.topology import init_topology

    topology = init_topology()
    engine = _engine(base, topology, seed=1)
    for step in range(2):
        x, _ = rows(global_batch("hf-llama", step, 0, topology.world_size), topology.rank)
        engine.backward(loss_of("hf-llama", engine, x, None))
        assert engine.step()
    save_checkpoint(engine, out / "full", 2)
    path = save_checkpoint(engine, out / "adapter", 2, frozen_base=base)
    fresh = _engine(base, topology, seed=2)
    load_checkpoint(fresh, path)
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(_engine(base, topology, seed=1, perturb=True), path)
    return dict(logits=_logits(engine), resumed=_logits(fresh), refused=str(refused.value))


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir())


def test_adapter_checkpoint_references_the_base_and_exports_a_peft_folder(tmp_path, capsys):
    import transformers
    from safetensors.torch import load_file

    from zeropp.checkpoint.dcp import read_meta
    from zeropp.cli import main

    base = tmp_path / "base"
    make_model("hf-llama").save_pretrained(base)
    result = run_ranks(adapter_worker, 2, base=base, out=tmp_path)[0]
    full, adapter = tmp_path / "full" / "step-00000002", tmp_path / "adapter" / "step-00000002"

    meta = read_meta(adapter)
    frozen = meta["frozen_base"]["params"]
    assert meta["frozen_base"]["path"] == str(base.resolve()) and len(meta["frozen_base"]["sha256"]) == 64
    assert frozen and not frozen.keys() & meta["fixed"].keys() and all("lora_" in name for name in meta["params"])
    frozen_bytes = 4 * sum(math.prod(shape) for shape in frozen.values())  # fp32 run
    assert frozen_bytes <= _size(full) - _size(adapter) <= frozen_bytes + 64 * 1024  # DCP's metadata too
    assert torch.equal(result["resumed"], result["logits"])
    assert "trained on the frozen base" in result["refused"] and "\n" not in result["refused"]

    for source in (full, adapter):  # the full export reads the base back from its path
        assert main(["export", str(source), str(tmp_path / f"{source.parent.name}.safetensors")]) == 0
    assert load_file(tmp_path / "full.safetensors").keys() == load_file(tmp_path / "adapter.safetensors").keys()
    for key, value in load_file(tmp_path / "full.safetensors").items():
        assert torch.equal(value, load_file(tmp_path / "adapter.safetensors")[key]), key

    assert main(["export", str(adapter), str(tmp_path / "peft"), "--adapter-only"]) == 0
    assert "peft adapter folder" in capsys.readouterr().out
    assert json.loads((tmp_path / "peft" / "adapter_config.json").read_text())["r"] == 4
    loaded = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), tmp_path / "peft")
    with torch.no_grad():
        logits = loaded.eval()(input_ids=PROBE).logits
    assert torch.allclose(logits, result["logits"], atol=1e-5, rtol=0), (logits - result["logits"]).abs().max()


def plain_worker(out: Path) -> Path:
    from zeropp import ZeroEngine
    from zeropp.checkpoint import save_checkpoint
    from zeropp.topology import init_topology

    return save_checkpoint(ZeroEngine(make_model("mlp"), torch.optim.AdamW, {}, None, init_topology()), out, 1)


def test_adapter_only_export_of_a_model_without_adapters_is_refused_in_one_line(tmp_path, capsys):
    from zeropp.cli import main

    checkpoint = run_ranks(plain_worker, 1, out=tmp_path)[0]
    assert main(["export", str(checkpoint), str(tmp_path / "out"), "--adapter-only"]) == 2
    assert capsys.readouterr().err == (
        f"zeropp: error: checkpoint {str(checkpoint)!r} is not of a peft model: it holds no adapter to export\n"
    )
