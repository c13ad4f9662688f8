"""Bad input to the command line ends in one line (``zeropp: error: ...``), before any rank starts."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from cli_runner import run_cli
from launcher import free_port

TINY = ("train", "--preset", "tiny", "--steps", "1", "--nproc-per-node", "2")


def one_line(result: subprocess.CompletedProcess, *fragments: str) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode != 0 and len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith("zeropp: error: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize(
    "flags,fragments",
    [
        (("--nproc-per-node", "0"), ("--nproc-per-node 0", "an integer >= 1")),
        (("--nproc-per-node", "-2"), ("--nproc-per-node -2", "an integer >= 1")),
        (("--nnodes", "0"), ("--nnodes 0", "MIN:MAX")),
        (("--nnodes", "abc"), ("--nnodes abc", "an integer >= 1")),
        (("--timeout-s", "inf"), ("topology.timeout_s = inf", "<= 1e+07")),
        (("--timeout-s", "1e20"), ("topology.timeout_s = 1e+20",)),
        (("--shard-alignment", "1000000000000"), ("zero.shard_alignment = 1000000000000", "from 1 to 65536")),
        (("--n-head", "3"), ("model.n_head = 3", "model.d_model = 64", "a divisor of d_model")),
        (("--backend", "nccl"), ("topology.backend = 'nccl'", "no CUDA device")),
        (("--sequence-parallel",), ("topology.sequence_parallel = True", "topology.tensor_parallel_size > 1")),
        (
            ("--tensor-parallel", "2", "--nodes", "1", "--sequence-parallel", "--block-size", "63"),
            ("a sequence of 63 tokens", "a multiple of topology.tensor_parallel_size = 2"),
        ),
        (  # the plan's shapes are checked on the meta device before the ranks start
            ("--tensor-parallel", "2", "--nodes", "1", "--n-head", "1"),
            ("tensor_parallel_size = 2", "model.n_head = 1", "a divisor of it"),
        ),
    ],
)
def test_bad_flags(flags, fragments):
    if "nccl" in flags:
        pytest.importorskip("torch").cuda.is_available() and pytest.skip("CUDA is available here")
    one_line(run_cli(*TINY, "--master-port", str(free_port()), *flags), *fragments)


def test_bad_config_files(tmp_path):
    latin = tmp_path / "latin.toml"
    latin.write_bytes("[train]\n# caf\xe9\n".encode("latin-1"))
    yaml = tmp_path / "run.yaml"
    yaml.write_text("train:\n  steps: 3\n")
    folder = tmp_path / "folder.toml"
    folder.mkdir()
    cases = [
        (latin, ("is not UTF-8 text",)),
        (yaml, ("run.yaml", "expected a .toml or .json file")),
        (folder, ("is a directory",)),
    ]
    for path, fragments in cases:
        one_line(run_cli(*TINY, "--config", str(path)), str(path), *fragments)


def test_summary_json_that_cannot_be_written_is_refused_before_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    one_line(run_cli(*TINY, "--summary-json", str(blocker / "summary.json")), "--summary-json", "cannot be written")
    one_line(run_cli(*TINY, "--summary-json", str(tmp_path)), "--summary-json", "cannot be written")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ckpt")
    result = run_cli(
        *TINY, "--eval-batches", "1", "--checkpoint-dir", str(root), "--save-interval", "1",
        "--master-port", str(free_port()),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return root / "step-00000001"


def test_export_to_a_directory_or_a_full_disk(checkpoint, tmp_path, monkeypatch, capsys):
    import safetensors.torch
    from safetensors import SafetensorError

    from zeropp.cli import main

    one_line(run_cli("export", str(checkpoint), str(tmp_path)), "it is a directory")

    def disk_full(*args, **kwargs):  # what safetensors raises on ENOSPC: not an OSError
        raise SafetensorError(
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
        )

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    out = tmp_path / "model.safetensors"
    assert main(["export", str(checkpoint), str(out)]) == 2
    assert capsys.readouterr().err == f"zeropp: error: could not write {str(out)!r} (No space left on device)\n"


def test_bench_cluster_without_root_refuses_before_creating_its_folder(tmp_path, monkeypatch, capsys):
    from zeropp.tools.bench.cluster import compare as cluster

    monkeypatch.setattr(cluster.os if hasattr(cluster, "os") else __import__("os"), "geteuid", lambda: 1000)
    out = tmp_path / "results"
    assert cluster.main(["--out", str(out)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("zeropp bench cluster: error: needs root")
    assert not out.exists()


def test_config_file_without_read_permission(tmp_path, monkeypatch):
    from zeropp.config.sections import load_config
    from zeropp.errors import ConfigError

    path = tmp_path / "run.toml"
    path.write_text("[train]\nsteps = 3\n")

    def denied(self, *args, **kwargs):  # as root, chmod 000 would not stop the read
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "read_text", denied)
    with pytest.raises(ConfigError, match=r"config file '.*run.toml' cannot be read \(Permission denied\)"):
        load_config(path)


def test_generate_continues_a_prompt_of_the_embedded_gpt_and_refuses_an_empty_one(checkpoint, capsys):
    from zeropp.cli import main

    assert main(["generate", str(checkpoint), "--prompt", "In the beginning", "--max-new-tokens", "8"]) == 0
    printed = capsys.readouterr()
    assert printed.err == "" and printed.out.startswith("In the beginning") and len(printed.out.encode()) > 17
    one_line(run_cli("generate", str(checkpoint), "--prompt", ""), "--prompt is empty")
