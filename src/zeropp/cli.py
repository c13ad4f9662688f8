"""Command line: zeropp train, export, generate, import-deepspeed, estimate, cluster and bench.

zeropp train trains the embedded GPT on the embedded corpus, or a Hugging Face causal LM
(--hf-model DIR, --hf-config FILE) on your own text (--data PATH, --tokenizer DIR); local paths only.

zeropp train run by hand starts the ranks through torchrun's agent (so it takes torchrun's
multi-node flags), forked from a server that imported zeropp once, and each rank runs the same
command again, recognising itself by torchrun's environment; started by srun or mpirun once per rank
(no launcher flags), each task is a rank.
On one machine the ranks are split into 2 simulated nodes unless --nodes says
otherwise. Every config key is a flag of its own name (--stage 3 --precision bf16).
At stage 3 the ZeRO++ switches default to on (qwZ, hpZ over each node, qgZ); turn each off with
--no-quantized-weights, --hpz-partition-size 1, --no-quantized-gradients.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import os
import signal
import sys
import tempfile
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch

from zeropp.app import runlock
from zeropp.app.flags import add_config_flags
from zeropp.app.launch import (
    LAUNCH_FLAGS,
    LAUNCHER_PID,
    PEER_LOST_STATUS,
    add_launch_flags,
    adopt_task,
    describe_failure,
    follow_launcher,
    is_rank,
    on_stop,
    quiet_torchrun,
    rank_process,
    resolve,
    start_rank_server,
    usable_cpus,
    waiting_note,
)
from zeropp.app.metrics import require_matplotlib
from zeropp.app.models.source import model_source, training_text
from zeropp.app.trainer import TrainingStopped, preflight
from zeropp.checkpoint.dcp import CheckpointError
from zeropp.checkpoint.pretrained import PretrainedError
from zeropp.comm.communicator import CollectiveTimeout, PeerLost
from zeropp.config.deepspeed import Translation, translate
from zeropp.config.sections import ZEROPP_SWITCHES, load_config
from zeropp.context_parallel import check_context_parallel, check_length
from zeropp.errors import ConfigError
from zeropp.expert_parallel import check_expert_parallel
from zeropp.index.ranks import Layout
from zeropp.tensor_parallel.apply import check_sequence_length, plan_for
from zeropp.tools.bench import available
from zeropp.topology import resolve_backend
from zeropp.zero.fingerprint import ModelMismatch
from zeropp.zero.materialize import MaterializeError

# zeropp train's own defaults at stage 3 (the library's ZeroConfig keeps ZeRO++ off)
ZEROPP_TRAIN_DEFAULTS = {f"zero.{key}": value for key, value in ZEROPP_SWITCHES.items()}

# commands with argument parsers of their own: module zeropp.<name>, main(argv) -> exit code
SUBPROGRAMS = {
    "estimate": "predict memory and communication per rank and step (zeropp estimate --help)",
    "cluster": "run zeropp train on emulated nodes joined by shaped links, as root (zeropp cluster --help)",
    "simulate": "simulate a GPU cluster's training step: time, TFLOPs, memory (zeropp simulate --help)",
    "plan": "rank a run's configurations by simulated throughput within memory (zeropp plan --help)",
}


def _train_config_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("config keys (override --config)")
    add_config_flags(group, stage3_defaults=ZEROPP_TRAIN_DEFAULTS)


def installed_version() -> str:
    """zeropp's installed version; a checkout run from source (PYTHONPATH=src) has none."""
    try:
        return version("zeropp")
    except PackageNotFoundError:
        return "(not installed: run from source)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zeropp", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"zeropp {installed_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser(
        "train",
        help="train the embedded GPT, or a Hugging Face causal LM on your text",
        description="Train the embedded byte-level GPT on the embedded corpus, or a Hugging Face causal LM "
        "(--hf-model, --hf-config) on your text (--data, --tokenizer), on local ranks (or several machines), "
        "with a progress bar and a summary. Flags override --config, which overrides the defaults.",
    )
    train.add_argument("--config", type=Path, help="TOML or JSON file of config keys (default: none)")
    train.add_argument("--summary-json", type=Path, help="also write the run summary as JSON here (default: none)")
    train.add_argument(
        "--metrics-jsonl",
        type=Path,
        metavar="PATH",
        help="write every step's metrics here, one JSON object a line (default: none)",
    )
    train.add_argument(
        "--plot",
        type=Path,
        metavar="PNG",
        help="at the end, write a PNG of the training and validation loss here (default: none)",
    )
    train.add_argument(
        "--adapter-out", type=Path, metavar="DIR",
        help="with --lora-rank and --checkpoint-dir: at the end, write the last checkpoint's adapter here as a peft "
        "folder for PeftModel.from_pretrained (default: none; zeropp export --adapter-only writes one later)",
    )  # fmt: skip
    train.add_argument(
        "--deepspeed", type=Path, metavar="DS_CONFIG.json",
        help="a DeepSpeed JSON config, read as config keys: over --config, under the flags (default: none)",
    )  # fmt: skip
    add_launch_flags(train)
    _train_config_flags(train)
    export = commands.add_parser(
        "export",
        help="consolidate a sharded checkpoint: one safetensors file, or a Hugging Face folder",
        description="Write a checkpoint's weights as one .safetensors file (OUT ends in .safetensors), or, for a "
        "Hugging Face model, as a folder that from_pretrained loads (config, safetensors, the tokenizer if used).",
    )
    export.add_argument("checkpoint", type=Path, help="a checkpoint folder (checkpoint_dir/step-NNNNNNNN)")
    export.add_argument("out", type=Path, help="the .safetensors file, or the Hugging Face folder, to write")
    export.add_argument(
        "--adapter-only", action="store_true",
        help="a peft model's checkpoint: write only its adapter, as the folder peft.PeftModel.from_pretrained loads",
    )  # fmt: skip
    generate = commands.add_parser(
        "generate",
        help="continue a prompt with a checkpoint's model (greedy, one process)",
        description="Load a checkpoint's weights into its run's model in one process and print the prompt "
        "followed by its greedy continuation, tokenized as the run tokenized its data.",
    )
    generate.add_argument("checkpoint", type=Path, help="a checkpoint folder (checkpoint_dir/step-NNNNNNNN)")
    generate.add_argument("--prompt", required=True, help="the text to continue")
    generate.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default: 64)")
    imported = commands.add_parser(
        "import-deepspeed",
        help="write a DeepSpeed ZeRO checkpoint as a zeropp checkpoint (--resume, export)",
        description="Read a DeepSpeed ZeRO stage 1/2/3 checkpoint (the save_checkpoint folder, whose 'latest' names the "
        "tag, or a global_stepN folder; any data-parallel size; fp32, bf16 or fp16) and write its fp32 masters, "
        "optimizer states, step and loss scaler as OUT_DIR/step-N, which zeropp train --resume (any world size) "
        "and zeropp export read. Nothing is written when the checkpoint is refused.",
    )
    imported.add_argument(
        "source", type=Path, metavar="DS_CHECKPOINT_DIR", help="DeepSpeed's checkpoint folder or tag folder"
    )
    imported.add_argument(
        "out_dir", type=Path, metavar="OUT_DIR", help="the zeropp checkpoint folder to write step-N into"
    )
    for name, text in SUBPROGRAMS.items():  # listed here, parsed by their own modules (see main)
        commands.add_parser(name, help=text, add_help=False)
    benchmarks = available()
    listing = "\n".join(f"  {name:<12} {text}" for name, (_, text) in benchmarks.items())
    bench = commands.add_parser(
        "bench",
        help="run a benchmark (zeropp bench --help lists them)",
        description=f"Runs the benchmark NAME; its own options follow the name (zeropp bench NAME --help).\n\n"
        f"benchmarks:\n{listing}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument("what", choices=list(benchmarks), metavar="NAME", help=", ".join(benchmarks))
    bench.add_argument("options", nargs=argparse.REMAINDER, help="the benchmark's own options (see its --help)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    except KeyboardInterrupt:  # Ctrl-C: one word from the launcher, none from the ranks
        if not is_rank():
            print("zeropp: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str]) -> int:
    if argv and argv[0] in SUBPROGRAMS:
        return importlib.import_module(f"zeropp.tools.{argv[0]}").main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "export":
        return _export(args.checkpoint, args.out, args.adapter_only)
    if args.command == "generate":
        return _generate(args.checkpoint, args.prompt, args.max_new_tokens)
    if args.command == "import-deepspeed":
        return _import_deepspeed(args.source, args.out_dir)
    if args.command == "bench":
        module, _ = available()[args.what]
        return importlib.import_module(module).main(args.options)
    try:
        adopt_task(args)  # srun / mpirun, one task per rank
        if is_rank():
            follow_launcher()
        config, nodes = _train_config(args, argv)
    except (ConfigError, CheckpointError) as error:
        print(f"zeropp: error: {error}", file=sys.stderr)
        return 2
    if not is_rank():
        return _launch(args, argv, nodes)
    return _run_rank(config, args)


def _train_config(args: argparse.Namespace, argv: list[str]) -> tuple[Any, int]:
    """The run's config, checked against the launcher flags and the environment (ConfigError)."""
    nodes = resolve(args)
    overrides = {k: v for k, v in vars(args).items() if "." in k and v is not None}
    if not is_rank() and nodes == 1 and "topology.nodes" not in overrides:
        simulated = 2 if args.nproc_per_node % 2 == 0 else 1
        overrides["topology.nodes"] = simulated
        argv += ["--nodes", str(simulated)]
    deepspeed = None
    if args.deepspeed is not None:
        world = int(os.environ["WORLD_SIZE"]) if is_rank() else args.nproc_per_node * nodes
        deepspeed = _read_deepspeed(args.deepspeed, args.config, overrides, world)
        overrides = {**deepspeed.overrides, **overrides}  # the flags win
    with deepspeed.worded() if deepspeed is not None else contextlib.nullcontext():  # errors in the file's keys
        config = load_config(args.config, overrides)
        if config.zero.stage == 3:  # ZeRO++ on
            config = load_config(args.config, overrides, defaults=ZEROPP_TRAIN_DEFAULTS)
        if deepspeed is not None:
            deepspeed.check_batch(config)
        topology = config.topology
        mesh = (topology.tensor_parallel_size, topology.context_parallel_size, topology.expert_parallel_size)
        if is_rank():
            Layout(int(os.environ["WORLD_SIZE"]), config.topology.nodes or 1, *mesh)
        else:
            layout = Layout(args.nproc_per_node * nodes, config.topology.nodes or nodes, *mesh)
            layout.hpz_group_size(config.zero.hpz_partition_size)
            hpz_note = layout.hpz_note(config.zero.hpz_partition_size)  # hpZ asked for and off here
            if hpz_note:
                print(hpz_note, flush=True)
            resolve_backend(config.topology)
            source = model_source(config)
            training_text(config, source)  # model, tokenizer and data: refused here in one line
            cp, tp, ep = topology.context_parallel_size, topology.tensor_parallel_size, topology.expert_parallel_size
            if tp > 1 or cp > 1 or ep > 1 or config.model.lora_rank is not None:
                with torch.device("meta"):
                    model = source.build()  # LoRA: targets the model lacks
                if tp > 1:  # a class without a plan, shapes tp ranks cannot share
                    plan_for(model, tp, topology.sequence_parallel, experts_whole=ep > 1)
                if cp > 1:  # See [Note: Ulysses attention]
                    check_context_parallel(model, cp, tp)
                    check_length(source.block_size, cp)
                check_expert_parallel(model, ep)  # See [Note: expert dispatch]
            if topology.sequence_parallel:
                check_sequence_length(source.block_size, tp)
                if config.model.logit_tiles > 1:  # the tiled loss takes the head's weight, not its gathered input
                    raise ConfigError(
                        f"model.logit_tiles = {config.model.logit_tiles} is not allowed with topology.sequence_parallel; "
                        "expected 1"
                    )
            preflight(config)
            for flag in ("summary_json", "metrics_jsonl", "plot"):
                if getattr(args, flag) is not None:
                    _check_output(f"--{flag.replace('_', '-')}", getattr(args, flag))
            if args.plot is not None:
                require_matplotlib()
            if args.adapter_out is not None:
                _check_adapter_out(args.adapter_out, config)
            if config.checkpoint.checkpoint_dir is not None:  # one run per folder
                runlock.hold_for_ranks(config.checkpoint.checkpoint_dir, args.master_port, args.node_rank)
    return config, nodes


def _read_deepspeed(path: Path, config_file: Path | None, overrides: dict[str, Any], world: int) -> Translation:
    """The DeepSpeed config's keys; its "auto" values resolved from the run's other settings and
    model. The launcher (or rank 0 under a torchrun of the user's) prints its one-line note."""
    base = load_config(config_file, overrides)
    # DeepSpeed's batch sizes count the ranks reading rows of their own (a context-parallel run reads one)
    data_parallel = world // base.topology.tensor_parallel_size // base.topology.context_parallel_size
    translation = translate(path, world_size=data_parallel, hidden_size=model_source(base).d_model, base=base)
    note = translation.note()
    if note and (not is_rank() or (LAUNCHER_PID not in os.environ and os.environ.get("RANK") == "0")):
        print(note, flush=True)
    return translation


def _check_output(flag: str, path: Path) -> None:
    """Refuse an output file that could not be written, before training rather than after it."""
    try:
        if path.is_dir():
            raise IsADirectoryError(errno.EISDIR, "it is a directory")
        path.parent.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path.parent).close()
    except OSError as error:
        raise ConfigError(f"{flag} {str(path)!r} cannot be written ({error.strerror})") from None


def _check_adapter_out(out: Path, config: Any) -> None:
    """Refuse --adapter-out without an adapter or a checkpoint to export it from, or over a folder in use."""
    for key, value in (("--lora-rank", config.model.lora_rank), ("--checkpoint-dir", config.checkpoint.checkpoint_dir)):
        if value is None:
            raise ConfigError(
                f"--adapter-out {str(out)!r} needs {key} (the adapter is exported from the last checkpoint)"
            )
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise ConfigError(f"--adapter-out {str(out)!r} exists and is not an empty folder")


def _launch(args: argparse.Namespace, argv: list[str], nodes: int) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, get_args_parser

    launcher_argv = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in LAUNCH_FLAGS if k != "join_timeout_s"]
    # c10d rendezvous: each restart (--max-restarts) meets under a fresh key prefix; the static one
    # would hand restarted ranks the addresses of the ranks it just killed
    launcher_argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint={args.master_addr}:{args.master_port}"]
    # node 0 hosts the store even where its hostname does not resolve to master_addr
    host = ",is_host=true" if args.node_rank == 0 else ""
    launcher_argv.append(f"--rdzv-conf=join_timeout={args.join_timeout_s}{host}")
    launcher_argv.append("--start-method=forkserver")  # See [Note: forked ranks] (docs/design.md)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, usable_cpus() // args.nproc_per_node)))
    config, _, _ = config_from_args(get_args_parser().parse_args([*launcher_argv, "zeropp"]))
    os.environ[LAUNCHER_PID] = str(os.getpid())
    start_rank_server()  # the ranks' environment is the server's: complete by now
    note = waiting_note(args, nodes)
    if note:
        print(note, file=sys.stderr, flush=True)
    quiet_torchrun()
    try:
        elastic_launch(config, rank_process)(main, argv)
    except SignalException as error:  # the agent turns SIGINT / SIGTERM into this
        if error.sigval == signal.SIGINT:
            raise KeyboardInterrupt from None
        print(f"zeropp: error: stopped by {error.sigval.name}", file=sys.stderr)
        return 128 + error.sigval
    except Exception as error:  # torchrun's ChildFailedError: a rank's own error is printed above
        print(f"zeropp: error: {describe_failure(error, args)}", file=sys.stderr)
        return 1
    return 0


def _run_rank(config: Any, args: argparse.Namespace) -> int:
    from zeropp.app.metrics import MetricsLog, plot_losses
    from zeropp.app.report import print_summary, progress_bar
    from zeropp.app.trainer import Trainer, write_summary
    from zeropp.topology import shutdown

    status = 0
    try:
        if config.checkpoint.checkpoint_dir is not None and os.environ["RANK"] == "0":  # under torchrun itself
            runlock.hold(config.checkpoint.checkpoint_dir, os.environ.get("MASTER_PORT"))
        trainer = Trainer(config)
        _record_on_signal(trainer.engine.comm.trace)
        leader = trainer.topology.rank == 0
        log = MetricsLog(args.metrics_jsonl if leader else None)
        with progress_bar(config.train.steps, enabled=leader and trainer.start_step < config.train.steps) as update:
            summary = trainer.run(update, log)
        log.close()
        if leader and summary is not None:
            print_summary(summary)
            if args.summary_json is not None:
                write_summary(summary, args.summary_json)
            if args.plot is not None:
                plot_losses(log, args.plot, f"zeropp train: {summary.model.split(' (')[0]}, stage {summary.stage}")
            if args.adapter_out is not None:
                status = _export(Path(trainer.checkpoints[-1].path), args.adapter_out, adapter_only=True)
        trainer.engine.comm.barrier(trainer.topology.world)  # every rank is done before groups go
    except PeerLost as error:  # under zeropp train the launcher names the rank that died
        if LAUNCHER_PID not in os.environ:
            print(f"zeropp: error: {str(error).removeprefix('zeropp: ')}", file=sys.stderr)
        status = PEER_LOST_STATUS
    except (
        CheckpointError,
        CollectiveTimeout,
        ConfigError,
        TrainingStopped,
        MaterializeError,
        PretrainedError,
    ) as error:
        if not isinstance(error, (TrainingStopped, ModelMismatch)) or os.environ["RANK"] == "0":  # once if alike
            for line in str(error).removeprefix("zeropp: ").splitlines():  # one line a problem
                print(f"zeropp: error: {line}", file=sys.stderr)
        status = 1
    except KeyboardInterrupt:  # Ctrl-C reaches every rank; the launcher says "interrupted" once
        status = 130
    finally:
        shutdown(wait_for_others=False)  # the ranks met in the barrier above, or one failed
    # Leave without running C++ static destructors: on some exits gloo's worker threads are torn down
    # after the interpreter and abort the process ("terminate called without an active exception").
    # A rank the launcher forked returns its status to rank_process, whose process never runs them.
    sys.stdout.flush()
    sys.stderr.flush()
    if LAUNCHER_PID in os.environ:
        return status
    os._exit(status)


def _record_on_signal(trace: Any) -> None:
    """A rank stopped by SIGTERM or SIGINT (its launcher stopping the run) writes its flight record first."""
    if LAUNCHER_PID in os.environ:  # started by rank_process: its stopping thread runs the hooks
        on_stop(trace.write)
        return

    def record(signum: int, frame: Any) -> None:  # started by srun or mpirun: a Python handler
        trace.write(signal.Signals(signum).name)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, record)


def _export(checkpoint: Path, out: Path, adapter_only: bool) -> int:
    """A Hugging Face model's checkpoint to a folder (unless OUT ends in .safetensors), others to a
    file; with `adapter_only` a peft model's adapter to a folder."""
    from zeropp.app.hf import export_adapter_folder, export_folder
    from zeropp.checkpoint.dcp import export_checkpoint, read_meta

    try:
        folder = out.suffix != ".safetensors" and "hf_config" in read_meta(checkpoint)["extra"]
        if adapter_only:
            meta, what = export_adapter_folder(checkpoint, out), "a peft adapter folder for PeftModel.from_pretrained"
        elif folder:
            meta, what = export_folder(checkpoint, out), "a Hugging Face folder for from_pretrained"
        else:
            meta, what = export_checkpoint(checkpoint, out), "safetensors"
    except (CheckpointError, ConfigError) as error:
        print(f"zeropp: error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {out}: {len(meta['params'])} parameters of step {meta['step']} (fp32, {what})")
    return 0


def _generate(checkpoint: Path, prompt: str, new_tokens: int) -> int:
    from zeropp.app.generate import generate_text

    try:
        print(generate_text(checkpoint, prompt, new_tokens))
    except (CheckpointError, ConfigError) as error:
        print(f"zeropp: error: {error}", file=sys.stderr)
        return 2
    return 0


def _import_deepspeed(source: Path, out_dir: Path) -> int:
    from zeropp.checkpoint.deepspeed_files import DeepSpeedCheckpointError
    from zeropp.checkpoint.deepspeed_import import import_deepspeed

    try:
        done = import_deepspeed(source, out_dir)
    except (DeepSpeedCheckpointError, CheckpointError) as error:
        print(f"zeropp: error: {error}", file=sys.stderr)
        return 2
    for note in done.notes:
        print(f"zeropp: note: {note}")
    ds = done.source
    print(
        f"wrote {done.path}: {len(ds.masters)} parameters, {ds.optimizer} states of step {ds.step} "
        f"(DeepSpeed ZeRO stage {ds.stage}, {ds.world_size} data-parallel ranks, {ds.precision})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
