"""Hugging Face causal LMs on your own text from the command line: ``zeropp train --hf-config`` with tiny
GPT-2 and Llama configs written here (no downloads) on a text file and on JSONL (the Llama with a
tokenizer built here), 4 ranks as 2 simulated nodes; checkpoints, a bit-identical resume, ``zeropp export``
to a folder that ``from_pretrained`` loads with the engine's logits; the per-step metrics; the docs'
Python script; and every bad input refused in one line before any rank starts."""

from __future__ import annotations

import importlib.util
import json
import math
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_runner import run_cli
from launcher import free_port, run_ranks

from examples import docs_include

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
STEPS = ("--steps", "6", "--eval-interval", "3", "--eval-batches", "1", "--micro-batch-size", "2")
SHAPE = ("--block-size", "32")
CASES = {  # name: (config, data, tokenizer)
    "gpt2-text": ("gpt2.json", "corpus.txt", None),
    "llama-jsonl-tokenizer": ("llama.json", "corpus.jsonl", "tokenizer"),
}
PROBE = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5]])
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def _write_inputs(folder: Path) -> None:
    """Tiny configs (vocab 256 fits the bytes), 40 documents of 60 words as text and JSONL, a WordLevel
    tokenizer trained on them (17 tokens, EOS included) saved as a Hugging Face tokenizer folder."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    small = dict(vocab_size=256, bos_token_id=0, eos_token_id=0)
    transformers.GPT2Config(n_positions=64, n_embd=32, n_layer=2, n_head=2, **small).to_json_file(folder / "gpt2.json")
    transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, **small,
    ).to_json_file(folder / "llama.json")  # fmt: skip
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hum".split()
    docs = [" ".join(rng.choice(words) for _ in range(60)) + "." for _ in range(40)]
    (folder / "corpus.txt").write_text("\n".join(docs))
    (folder / "corpus.jsonl").write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train([str(folder / "corpus.txt")], trainers.WordLevelTrainer(special_tokens=["<unk>", "<eos>"]))
    wrapped = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<eos>")
    wrapped.save_pretrained(folder / "tokenizer")


def _inputs(folder: Path, case: str) -> list[str]:
    config, data, tokenizer = CASES[case]
    args = ["--hf-config", str(folder / config), "--data", str(folder / data), *SHAPE]
    return args + (["--tokenizer", str(folder / tokenizer)] if tokenizer else [])


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hf-inputs")
    _write_inputs(folder)
    return folder


@pytest.fixture(scope="module")
def runs(inputs, tmp_path_factory) -> dict[str, dict]:
    """Per case: 6 steps saving at 3 and 6 (metrics, plot), then a second run resumed from step 3."""
    out = {}
    for case in CASES:
        folder = tmp_path_factory.mktemp(case)
        first, resumed = folder / "first", folder / "resumed"
        plot = ["--plot", str(folder / "loss.png")] if HAS_MATPLOTLIB else []
        straight = run_cli(
            "train", *_inputs(inputs, case), *STEPS, "--checkpoint-dir", str(first), "--save-interval", "3",
            "--summary-json", str(folder / "first.json"), "--metrics-jsonl", str(folder / "metrics.jsonl"), *plot,
            "--master-port", str(free_port()),
        )  # fmt: skip
        assert straight.returncode == 0, straight.stderr[-3000:]
        again = run_cli(
            "train", *_inputs(inputs, case), *STEPS, "--checkpoint-dir", str(resumed),
            "--resume", str(first / "step-00000003"), "--summary-json", str(folder / "resumed.json"),
            "--master-port", str(free_port()),
        )  # fmt: skip
        assert again.returncode == 0, again.stderr[-3000:]
        out[case] = dict(folder=folder, first=first, resumed=resumed, stdout=straight.stdout, inputs=inputs)
    return out


def test_trains_as_two_nodes_and_resumes_bit_identically(runs):
    from zeropp.checkpoint.dcp import consolidated_state

    for case, run in runs.items():
        first = json.loads((run["folder"] / "first.json").read_text())
        resumed = json.loads((run["folder"] / "resumed.json").read_text())
        assert (first["world_size"], first["nodes"], first["stage"]) == (4, 2, 3), case
        assert first["zeropp"]["quantized_weights"] and first["zeropp"]["quantized_gradients"], case
        config = CASES[case][0]
        assert first["model"] == f"{config.removesuffix('.json')} (--hf-config {run['inputs'] / config})", case
        assert first["train_losses"][-1] < first["train_losses"][0], case  # it learns
        assert resumed["start_step"] == 3 and resumed["train_losses"] == first["train_losses"][3:], case
        assert resumed["final_val_loss"] == first["final_val_loss"], case
        _, straight = consolidated_state(run["first"] / "step-00000006")
        _, again = consolidated_state(run["resumed"] / "step-00000006")
        assert straight.keys() == again.keys() and all(torch.equal(straight[k], again[k]) for k in straight), case


def test_metrics_jsonl_has_one_line_per_step_and_the_progress_says_what_it_shows(runs):
    run = runs["gpt2-text"]
    lines = [json.loads(line) for line in (run["folder"] / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run["folder"] / "first.json").read_text())
    assert [m["step"] for m in lines] == [1, 2, 3, 4, 5, 6]
    assert [m["loss"] for m in lines] == summary["train_losses"]
    assert [m["step"] for m in lines if m["val_loss"] is not None] == [3, 6]  # --eval-interval 3
    assert lines[-1]["val_loss"] == summary["final_val_loss"]
    assert summary["val_losses"] == [[m["step"], m["val_loss"]] for m in lines if m["val_loss"] is not None]
    tokens_per_step = 2 * 32 * 4  # micro batch x block x ranks
    for m in lines:
        assert m["grad_norm"] > 0 and m["lr"] > 0 and m["peak_memory_bytes"] > 0
        assert m["tokens_per_s"] == pytest.approx(tokens_per_step / m["step_time_s"])
        assert m["tokens_per_s_per_rank"] == pytest.approx(m["tokens_per_s"] / 4)
        assert m["mfu"] is None  # CPU: no known peak
    assert lines[0]["lr"] < lines[1]["lr"]  # warm-up
    assert summary["mfu"] is None and summary["flops_per_token"] == 6 * summary["param_count"] + 12 * 2 * 32 * 32
    progress = [line for line in run["stdout"].splitlines() if line.startswith("step ")]
    assert "val" not in progress[0] and "val" in progress[-1]  # validation shown once measured
    assert "tok/s all ranks" in progress[0] and "per rank" in progress[0]
    assert "MFU" in run["stdout"] and "unknown" in run["stdout"]  # the summary says why there is none
    if HAS_MATPLOTLIB:
        assert (run["folder"] / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def engine_logits(runs: dict[str, dict], inputs: Path, exported: Path) -> dict[str, torch.Tensor]:
    """Each case's logits in the engine (stage 3, no quantized weights) from its step-6 checkpoint, and from
    its exported folder as --hf-model (weights read straight into the shards; its tokenizer for the Llama)."""
    from zeropp.app.trainer import Trainer
    from zeropp.config.sections import load_config

    def logits(model: dict, train: dict, checkpoint: dict) -> torch.Tensor:
        config = {"model": {**model, "block_size": 32}, "train": {**train, "steps": 6}, "topology": {"nodes": 1}}
        trainer = Trainer(load_config({**config, "checkpoint": checkpoint}))
        with torch.no_grad():
            return trainer.engine.eval()(input_ids=PROBE).logits.float()

    out = {}
    for case, run in runs.items():
        config, data, tokenizer = CASES[case]
        resume = {"resume": str(run["first"] / "step-00000006")}
        text = {"data": str(inputs / data), "tokenizer": tokenizer and str(inputs / tokenizer)}
        out[case, "checkpoint"] = logits({"hf_config": str(inputs / config)}, text, resume)
        folder = str(exported / case)
        out[case, "--hf-model"] = logits({"hf_model": folder}, {**text, "tokenizer": tokenizer and folder}, {})
    return out


def test_export_writes_a_folder_from_pretrained_loads_with_the_engines_logits(runs, inputs, tmp_path, capsys):
    import transformers

    from zeropp.cli import main

    for case, run in runs.items():
        assert main(["export", str(run["first"] / "step-00000006"), str(tmp_path / case)]) == 0
        printed = capsys.readouterr()
        assert printed.err == "" and "Hugging Face folder" in printed.out
    engine = run_ranks(engine_logits, 2, runs=runs, inputs=inputs, exported=tmp_path)[0]
    for case in runs:
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / case).eval()
        with torch.no_grad():
            logits = model(input_ids=PROBE).logits
        for source in ("checkpoint", "--hf-model"):
            ours = engine[case, source]
            assert torch.allclose(logits, ours, atol=1e-5, rtol=0), (case, source, (logits - ours).abs().max())
        if CASES[case][2]:  # the run's tokenizer travels with the model
            tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / case)
            assert len(tokenizer) == 17 and tokenizer.eos_token == "<eos>"


def test_generate_continues_a_prompt_as_the_exported_models_generate_does(runs, tmp_path, capsys):
    import transformers

    from zeropp.cli import main

    for case, run in runs.items():
        checkpoint = run["first"] / "step-00000006"
        assert main(["generate", str(checkpoint), "--prompt", "the quick brown", "--max-new-tokens", "5"]) == 0
        printed = capsys.readouterr().out.rstrip("\n")
        assert main(["export", str(checkpoint), str(tmp_path / case)]) == 0
        capsys.readouterr()
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / case).eval()
        model.generation_config.eos_token_id = None  # zeropp generate does not stop at EOS
        if CASES[case][2]:
            tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / case)
            ids = tokenizer("the quick brown", add_special_tokens=False, return_tensors="pt")["input_ids"]
            decode = tokenizer.decode
        else:
            ids, decode = torch.tensor([list(b"the quick brown")]), lambda t: bytes(t).decode("utf-8", errors="replace")
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=5, do_sample=False)
        assert printed == decode(out[0].tolist()), case


def test_docs_script_trains_and_saves_a_folder_from_pretrained_loads(inputs, tmp_path):
    import transformers

    assert docs_include("hugging-face.md", "hf_text.py")  # the page shows the script as it runs
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
         str(ROOT / "examples" / "hf_text.py"), str(inputs / "gpt2.json"), str(inputs / "corpus.txt"), str(tmp_path / "out")],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0 and "terminate called" not in result.stderr, result.stderr[-3000:]
    loss = float(re.search(r"last loss ([\d.]+)", result.stdout).group(1))
    assert loss < math.log(256)  # below a uniform guess over the bytes: it trained
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(model).__name__ == "GPT2LMHeadModel" and model.config.n_embd == 32


# -- bad inputs: one line each, before any rank starts --------------------------------------------


def _one_line(result: subprocess.CompletedProcess, *fragments: str) -> None:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith("zeropp: error: ") and all(f in lines[0] for f in fragments), lines[0]


def test_bad_inputs_are_refused_in_one_line(inputs, tmp_path, capsys):
    from zeropp.cli import main

    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    (tmp_path / "notext.jsonl").write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    (tmp_path / "t5.json").write_text(json.dumps({"model_type": "t5", "d_model": 8}))
    (tmp_path / "unknown.json").write_text(json.dumps({"model_type": "no-such-model"}))
    (tmp_path / "short.txt").write_text("too short")
    small_vocab = json.loads((inputs / "gpt2.json").read_text()) | {"vocab_size": 8}
    (tmp_path / "small_vocab.json").write_text(json.dumps(small_vocab))
    gpt2, text = str(inputs / "gpt2.json"), str(inputs / "corpus.txt")
    cases = [
        (["--hf-config", gpt2, "--data", str(tmp_path / "missing.txt")], "--data", "does not exist"),
        (["--hf-config", gpt2, "--data", str(tmp_path / "empty.txt")], "holds no text"),
        (["--hf-config", gpt2, "--data", str(tmp_path / "empty")], "holds no text"),
        (["--hf-config", gpt2, "--data", str(tmp_path / "notext.jsonl")], "notext.jsonl:2", "no string field 'text'"),
        (["--hf-config", gpt2, "--data", str(tmp_path / "short.txt")], "9 tokens", "too few"),
        (["--hf-model", "gpt2", "--data", text], "'gpt2' is not a local path", "no downloads"),
        (["--hf-config", "openai-community/gpt2", "--data", text], "is not a local path"),
        (["--hf-config", str(tmp_path / "t5.json"), "--data", text], "model_type 't5'", "not a causal language model"),
        (["--hf-config", str(tmp_path / "unknown.json"), "--data", text], "'no-such-model'", "does not know"),
        (["--hf-model", str(tmp_path), "--data", text], "holds no config.json"),
        (["--hf-config", gpt2, "--hf-model", str(tmp_path), "--data", text], "model.hf_config", "one model"),
        (["--hf-config", gpt2, "--data", text, "--n-layer", "3"], "model.n_layer", "config.json"),
        (["--hf-config", gpt2, "--data", text, "--block-size", "65"], "block_size = 65", "64 positions"),
        (["--hf-config", str(tmp_path / "small_vocab.json"), "--data", text], "256 token ids", "vocab_size 8"),
        (["--hf-config", gpt2, "--data", text, "--tokenizer", "gpt2"], "--tokenizer 'gpt2' is not a local path"),
        (["--tokenizer", str(inputs / "tokenizer")], "train.tokenizer", "without train.data"),
    ]
    for args, *fragments in cases:
        assert main(["train", *args]) == 2, args
        err = capsys.readouterr().err
        _one_line(subprocess.CompletedProcess(args, 2, "", err), *fragments)


def test_without_transformers_or_matplotlib_one_line_says_what_to_install(inputs):
    """Both packages blocked in one process (importing them raises ImportError), two commands run in it."""
    text = str(inputs / "corpus.txt")
    commands = [["train", "--hf-config", str(inputs / "gpt2.json"), "--data", text],
                ["train", "--data", text, "--plot", str(inputs / "loss.png")]]  # fmt: skip
    code = (
        "import sys; sys.modules['transformers'] = None; sys.modules['matplotlib'] = None\n"
        "from zeropp.cli import main\n"
        f"for command in {commands!r}:\n"
        "    print(main(command), file=sys.stderr, flush=True)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[1::2] == ["2", "2"] and len(lines) == 4, result.stderr
    hf, plot = lines[0::2]
    assert hf.startswith("zeropp: error: ") and "transformers, which is not installed" in hf and ".[hf]" in hf, hf
    assert plot.startswith("zeropp: error: ") and "matplotlib, which is not installed" in plot and ".[plot]" in plot


# -- pieces, in one process -----------------------------------------------------------------------


def test_text_folders_are_read_in_sorted_order_and_split_at_the_last_five_percent(tmp_path):
    from zeropp.app.data.text import ByteTokenizer, DataError, documents, split, tokenize

    (tmp_path / "b.txt").write_text("second")
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.jsonl").write_text('{"text": "third"}\n\n{"text": "fourth"}\n')
    (tmp_path / ".hidden.txt").write_text("never")
    assert [text for _, text in documents(tmp_path)] == ["first", "second", "third", "fourth"]
    assert bytes(tokenize(tmp_path, ByteTokenizer()).tolist()) == b"first\nsecond\nthird\nfourth"
    tokens = torch.arange(1000)
    train, val = split(tokens, 8, "x")
    assert torch.equal(train, tokens[:950]) and torch.equal(val, tokens[950:])
    with pytest.raises(DataError, match="at least 201 tokens"):
        split(torch.arange(100), 8, "x")


def test_mfu_uses_6n_plus_attention_over_the_devices_bf16_peak(monkeypatch):
    from zeropp.app.metrics import flops_per_token, peak_flops

    assert flops_per_token(1000, 2, 32, 64) == 6 * 1000 + 12 * 2 * 32 * 64
    assert peak_flops(torch.device("cpu")) is None
    for name, peak in (
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
    ):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        assert peak_flops(torch.device("cuda", 0)) == peak
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    assert peak_flops(torch.device("cuda", 0)) is None


def test_plot_draws_the_training_and_validation_curves(tmp_path):
    pytest.importorskip("matplotlib")
    from zeropp.app.metrics import MetricsLog, StepMetrics, plot_losses

    log = MetricsLog(tmp_path / "metrics.jsonl")
    for step in range(1, 5):
        log.add(StepMetrics(step, 5.0 - step / 4, 4.5 if step % 2 == 0 else None, 1.0, 1e-3, 0.1, 100.0, 25.0, None, 1))
    log.close()
    assert (log.train, log.val) == ([(1, 4.75), (2, 4.5), (3, 4.25), (4, 4.0)], [(2, 4.5), (4, 4.5)])
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 4
    plot_losses(log, tmp_path / "loss.png", "title")
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
