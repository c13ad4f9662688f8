"""``zeropp train --hf-model DIR --lora-rank R`` (zeropp.app.lora): LoRA adapters trained with peft on a tiny
Llama saved here (no downloads), 2 ranks, frozen base stored int8; the adapter written as a peft folder that
``PeftModel.from_pretrained`` loads with the checkpoint's trained values; bad LoRA input refused in one line
before any rank starts; on the meta device the adapters start as peft initializes them (B zero, A
Kaiming-uniform), where the model's initializer alone would not."""

from __future__ import annotations

import json
import math
import random
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from cli_runner import run_cli
from launcher import free_port
from test_cli_errors import one_line

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

LORA = ("--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "q_proj,v_proj", "--lora-dropout", "0.1")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """A tiny Llama with seeded random weights saved as a Hugging Face folder, and 40 lines of text."""
    folder = tmp_path_factory.mktemp("lora-inputs")
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, vocab_size=256, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder / "base")
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hum".split()
    (folder / "corpus.txt").write_text("\n".join(" ".join(rng.choice(words) for _ in range(60)) for _ in range(40)))
    return folder


@pytest.fixture(scope="module")
def run(inputs, tmp_path_factory) -> Path:
    """2 LoRA steps at world 2 on the int8 base, checkpointed, the adapter exported (the run's folder)."""
    folder = tmp_path_factory.mktemp("lora-run")
    result = run_cli(
        "train", "--hf-model", str(inputs / "base"), "--data", str(inputs / "corpus.txt"), "--block-size", "32",
        *LORA, "--quantized-nontrainable-weights", "--steps", "2", "--eval-interval", "2", "--eval-batches", "1",
        "--micro-batch-size", "2", "--nproc-per-node", "2", "--checkpoint-dir", str(folder / "ck"),
        "--adapter-out", str(folder / "adapter"), "--summary-json", str(folder / "summary.json"),
        "--master-port", str(free_port()),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"wrote {folder / 'adapter'}" in result.stdout and "peft adapter folder" in result.stdout
    return folder


def test_lora_run_exports_an_adapter_peft_loads(inputs, run):
    import peft
    from safetensors.torch import load_file

    from zeropp.checkpoint.dcp import consolidated_state

    base, tmp_path = inputs / "base", run
    summary = json.loads((tmp_path / "summary.json").read_text())
    adapters = 2 * (4 * 32 + 32 * 4 + 4 * 32 + 16 * 4)  # 2 layers: q_proj 32 -> 32, v_proj 32 -> 16 (2 kv heads)
    assert summary["model"].endswith(", LoRA rank 4)") and summary["param_count"] == adapters
    # model states: the adapters' 16 bytes a parameter and the int8 base's 1 + 4/256, over 2 ranks, counted
    # over the flat buffers as laid out (each parameter on a block of 256: this 32-wide model's norms pad 8x)
    analytic = summary["analytic_model_state_bytes_per_rank"]
    assert all(abs(b - analytic) <= 0.02 * analytic for b in summary["model_state_bytes_per_rank"]), (analytic, summary)
    # plain ZeRO-3 gathers the fp32 base too: more than this run's int8 base, qwZ and qgZ send
    sent, plain = ({link: summary[f"{prefix}{link}_node_bytes_per_step"] for link in ("intra", "inter")}
                   for prefix in ("", "zero3_"))  # fmt: skip
    assert sum(sent.values()) < sum(plain.values()) / 2, summary
    model = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(base), tmp_path / "adapter"
    )
    loaded = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    _, trained = consolidated_state(tmp_path / "ck" / "step-00000002", trained_only=True)
    assert sorted(loaded) == sorted(trained) and len(trained) == 2 * 2 * 2  # A and B of q_proj and v_proj, 2 layers
    assert all(torch.equal(loaded[k], trained[k]) for k in trained)
    assert all(trained[k].abs().max() > 0 for k in trained if "lora_B" in k)  # B starts at zero and trained
    config = model.peft_config["default"]
    assert (config.r, config.lora_alpha, sorted(config.target_modules), config.lora_dropout) == (
        4, 8, ["q_proj", "v_proj"], 0.1
    )  # fmt: skip
    # the checkpoint references the base folder (hashed from its files: the engine's int8 base is not them)
    # instead of copying it; a full export reads the base back from the folder, unchanged
    meta = json.loads((tmp_path / "ck" / "step-00000002" / "zeropp.json").read_text())
    assert meta["frozen_base"]["path"] == str(base.resolve()) and meta["frozen_base"]["hashed"] == "files"
    _, state = consolidated_state(tmp_path / "ck" / "step-00000002")
    weights = load_file(base / "model.safetensors")
    for name, value in weights.items():
        adapted = any(f"{t}.weight" in name for t in ("q_proj", "v_proj"))
        ours = state["base_model.model." + (name.replace(".weight", ".base_layer.weight") if adapted else name)]
        assert torch.equal(ours, value), name
    # the checkpoint holds the adapters' weights and optimizer states (and the ranks' RNG), not the base
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(tmp_path / "ck" / "step-00000002")).read_metadata().state_dict_metadata
    assert {k for k in saved if not k.startswith("rng.")} == {
        f"{kind}.{name}{suffix}" for name in trained for kind, suffix in
        (("model", ""), ("optim", ".exp_avg"), ("optim", ".exp_avg_sq"), ("optim", ".step"))
    }  # fmt: skip


def test_lora_run_resumes_from_its_referenced_base(inputs, run, tmp_path):
    """One more step from the run's checkpoint: the base is read from the folder again and checked by
    its hash; a changed base folder is refused in one line."""
    args = (
        "train", "--hf-model", str(inputs / "base"), "--data", str(inputs / "corpus.txt"), "--block-size", "32",
        *LORA, "--quantized-nontrainable-weights", "--steps", "3", "--eval-interval", "3", "--eval-batches", "1",
        "--micro-batch-size", "2", "--nproc-per-node", "2", "--checkpoint-dir", str(tmp_path / "ck"),
        "--resume", str(run / "ck" / "step-00000002"),
    )  # fmt: skip
    result = run_cli(*args, "--master-port", str(free_port()))
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "ck" / "step-00000003").is_dir()
    changed = tmp_path / "changed"
    shutil.copytree(inputs / "base", changed)
    checkpoint = tmp_path / "moved"
    shutil.copytree(run / "ck" / "step-00000002", checkpoint)
    meta = json.loads((checkpoint / "zeropp.json").read_text())
    meta["frozen_base"]["path"] = str(changed)
    (checkpoint / "zeropp.json").write_text(json.dumps(meta))
    from safetensors.torch import load_file, save_file

    weights = load_file(changed / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] + 1
    save_file(weights, changed / "model.safetensors", metadata={"format": "pt"})
    refused = run_cli(*args[:-1], str(checkpoint), "--master-port", str(free_port()))
    assert refused.returncode != 0
    assert "changed since the checkpoint was saved (sha256)" in refused.stderr, refused.stderr[-2000:]


def test_resume_refuses_other_lora_keys_and_reads_a_checkpoint_from_before_them(inputs, run, tmp_path):
    from zeropp.app.trainer import checkpoint_to_resume
    from zeropp.checkpoint.dcp import CheckpointError
    from zeropp.config.sections import load_config

    saved = run / "ck" / "step-00000002"
    base = {"hf_model": str(inputs / "base"), "block_size": 32}
    lora = {"lora_rank": 8, "lora_alpha": 8.0, "lora_targets": "q_proj,v_proj", "lora_dropout": 0.1}  # rank 4 saved
    config = load_config({"model": base | lora, "checkpoint": {"resume": str(saved)}})
    with pytest.raises(CheckpointError, match="saved with model.lora_rank = 4, this run has model.lora_rank = 8"):
        checkpoint_to_resume(config)
    older = tmp_path / "older"  # its config written before the model.lora_* keys existed
    shutil.copytree(saved, older)
    meta = json.loads((older / "zeropp.json").read_text())
    meta["extra"]["config"]["model"] = {k: v for k, v in meta["extra"]["config"]["model"].items() if "lora" not in k}
    (older / "zeropp.json").write_text(json.dumps(meta))
    plain = load_config({"model": base, "checkpoint": {"resume": str(older)}})
    assert checkpoint_to_resume(plain) == older


def test_bad_lora_input_is_refused_in_one_line(inputs, capsys, tmp_path):
    from zeropp.cli import main

    model = ["--hf-model", str(inputs / "base"), "--data", str(inputs / "corpus.txt"), "--block-size", "32"]
    cases = [
        ([*model, "--lora-rank", "0"], "model.lora_rank = 0", "an integer >= 1"),
        (["--lora-rank", "4"], "model.lora_rank = 4", "unset without model.hf_model or model.hf_config"),
        ([*model, "--lora-alpha", "16"], "model.lora_alpha = 16.0", "unless model.lora_rank is set"),
        (
            [*model, "--lora-rank", "4", "--lora-targets", "q_proj,qkv"],
            "model.lora_targets = 'q_proj,qkv'", "no module named 'qkv'", "down_proj, embed_tokens",
        ),
        ([*model, "--lora-rank", "4", "--lora-dropout", "1"], "model.lora_dropout = 1.0", "[0, 1)"),
        ([*model, "--adapter-out", str(tmp_path / "a")], "--adapter-out", "needs --lora-rank"),
        ([*model, "--lora-rank", "4", "--adapter-out", str(tmp_path / "a")], "needs --checkpoint-dir"),
    ]  # fmt: skip
    for args, *fragments in cases:
        assert main(["train", *args]) == 2, args
        one_line(subprocess.CompletedProcess(args, 2, "", capsys.readouterr().err), *fragments)


def test_meta_adapters_start_as_peft_initializes_them():
    from zeropp.app import lora
    from zeropp.config.model import ModelConfig
    from zeropp.zero.grouping import repeated_blocks
    from zeropp.zero.materialize import default_init, initialize_model

    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, vocab_size=256,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
        model = lora.add_adapters(model, ModelConfig(hf_config="llama.json", lora_rank=4))
    initialize_model(model, repeated_blocks(model), 0, default_init(model))  # the engine's own, peft-aware
    adapters = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert len(adapters) == 8  # q_proj and v_proj (peft's Llama targets) of 2 layers, A and B
    for name, value in adapters.items():
        if "lora_B" in name:
            assert not value.any(), name  # the model's _init_weights alone would draw B too
        else:  # kaiming_uniform_(a=sqrt(5)) over 32 inputs: U(-1/sqrt(32), 1/sqrt(32))
            assert 0.5 / math.sqrt(32) < value.abs().max() <= 1 / math.sqrt(32), name
