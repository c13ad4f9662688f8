"""ZeRO-R on real gloo ranks (2 nodes x 2, tensor parallel 2): activation checkpointing, Pa, Pa+cpu
and MD train to the weights of the run without them; the checkpoint bytes each rank holds, Pa's
all-gather in the ledger and the allocations per step follow the formulas; bad settings are refused."""

from __future__ import annotations

import pytest
import torch
from launcher import run_ranks
from machine import compiler_missing
from models import ADAM_EPS, GPT_TEST, global_batch, loss_of, make_model, rows

from zeropp import ConfigError, ZeroConfig

TP, STEPS, ACCUMULATION, PER_RANK = 2, 3, 2, 2
AC = dict(activation_checkpointing=True)
PA = dict(AC, partition_activations=True)
VARIANTS = {
    "AC": AC,
    "AC+Pa": PA,
    "AC+Pa+cpu": dict(PA, cpu_checkpointing=True),
    "AC+Pa+MD": dict(PA, contiguous_memory_optimization=True),
    "AC+Pa+cpu+MD": dict(PA, cpu_checkpointing=True, contiguous_memory_optimization=True),
}


def _engine(topology, stage: int, accumulation: int, extra: dict):
    from zeropp import ZeroEngine
    from zeropp.tensor_parallel.apply import parallelize

    config = ZeroConfig(stage=stage, gradient_accumulation_steps=accumulation, **extra)
    model = parallelize(make_model("gpt"), topology)
    return ZeroEngine(model, torch.optim.AdamW, dict(lr=1e-2, eps=ADAM_EPS, weight_decay=0.01), config, topology)


def _train(topology, stage: int, extra: dict) -> tuple[dict[str, torch.Tensor], list]:
    """STEPS optimizer steps of ACCUMULATION micro-batches; the weights and every step's checkpoint
    record and gradient-buffer allocations."""
    engine, dp = _engine(topology, stage, ACCUMULATION, extra), topology.data_parallel
    records = []
    for step in range(STEPS):
        for micro in range(ACCUMULATION):
            x, y = rows(global_batch("gpt", step, micro, dp.size), dp.rank)  # tp ranks read the same rows
            engine.backward(loss_of("gpt", engine, x, y))
        assert engine.step()
        records.append((engine.last_activation_checkpoints, engine.last_gradient_allocations))
    return engine.full_state_dict(), records


def _one_step(topology, extra: dict) -> dict:
    """Stage 3, one micro-batch: the checkpoint bytes held between forward and backward, the ledger."""
    engine, dp = _engine(topology, 3, 1, extra), topology.data_parallel
    engine.comm.ledger.reset()
    x, y = rows(global_batch("gpt", 0, 0, dp.size), dp.rank)
    loss = loss_of("gpt", engine, x, y)
    memory = engine.activation_checkpointing.memory
    held = (memory.device, memory.host)
    engine.backward(loss)
    engine.step()
    ledger = engine.comm.ledger
    return dict(
        held=held,
        after_backward=(memory.device, memory.host),
        pa=ledger.total(op="pa.all_gather", phase="backward"),
        pa_elsewhere=ledger.total(op="pa.all_gather") - ledger.total(op="pa.all_gather", phase="backward"),
        tp=sum(b for (op, _, _), b in ledger.bytes.items() if op.startswith("tp.")),
        tp_backward=ledger.total(op="tp.all_reduce", phase="backward"),
    )


class OddInputs(torch.nn.Module):
    """A block of three inputs none of which splits evenly in two: float64 (3, 5, 7), bool, int32."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(7, 7, dtype=torch.float64)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x) * scale).masked_fill(mask, 0.0)


def _odd_inputs(topology) -> dict:
    """Pa on inputs of any shape and dtype: gradients as without checkpointing, bytes as padded."""
    from types import SimpleNamespace

    from zeropp.comm.communicator import Communicator
    from zeropp.runtime.activation_checkpointing import ActivationCheckpointing, ActivationCheckpointOptions

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 7, dtype=torch.float64, generator=g)
    mask, scale = torch.rand(3, 5, 1, generator=g) > 0.5, torch.randint(1, 4, (7,), dtype=torch.int32, generator=g)
    grads, comm = [], Communicator(topology)
    for checkpointed in (False, True):
        torch.manual_seed(0)
        block, leaf = OddInputs(), x.clone().requires_grad_()
        if checkpointed:
            options = ActivationCheckpointOptions(partition=True, offload=True, contiguous=False, bucket_numel=16)
            store = ActivationCheckpointing(
                [SimpleNamespace(module=block)], comm, topology.tensor_parallel, topology.device, options
            )
        with comm.in_phase("backward"):
            out = block(leaf * 2, mask, scale)  # the input has a history, as a block's has
            held = store.memory.host if checkpointed else 0
            out.square().sum().backward()
        grads.append([leaf.grad, block.lin.weight.grad])
    error = max((a - b).abs().max().item() for a, b in zip(*grads, strict=True))
    left = (store.memory.device, store.memory.host)  # after backward: no staged copy outlives its use
    return dict(error=error, held=held, left=left, pa=comm.ledger.total(op="pa.all_gather", phase="backward"))


def zero_r_scenarios() -> dict:
    from zeropp.config.sections import TopologyConfig
    from zeropp.topology import init_topology

    topology = init_topology(TopologyConfig(tensor_parallel_size=TP))
    errors, records = {}, {}
    for stage in (1, 2, 3):
        plain, _ = _train(topology, stage, {})
        for name, extra in VARIANTS.items():
            ours, records[(stage, name)] = _train(topology, stage, extra)
            errors[(stage, name)] = max((ours[k] - plain[k]).abs().max().item() for k in plain)
    one_step = {name: _one_step(topology, extra) for name, extra in VARIANTS.items()}
    return dict(errors=errors, records=records, one_step=one_step, odd=_odd_inputs(topology))


def test_zero_r_trains_to_the_same_weights_holds_and_moves_what_the_formulas_say():
    from zeropp.costs.memory import PAPER_RECOMPUTED_ALL_REDUCES, RUNTIME_RECOMPUTED_ALL_REDUCES
    from zeropp.costs.tensor_parallel import megatron_bytes_per_block

    units, b, s, h, fp32 = GPT_TEST.n_layer, PER_RANK, GPT_TEST.block_size, GPT_TEST.d_model, 4
    whole = b * s * h * fp32  # one block's checkpointed input
    piece = whole // TP
    for result in run_ranks(zero_r_scenarios, world=4, nodes=2):
        for (stage, name), error in result["errors"].items():
            assert error <= 1e-6, (stage, name, error)
        # any shape, any dtype: each rank keeps ceil(n / 2) elements of each input and sends them
        odd = result["odd"]
        padded = 53 * 8 + 8 * 1 + 4 * 4  # float64 (105 elements), bool (15), int32 (7)
        assert odd["error"] == 0 and odd["held"] == padded and odd["pa"] == padded, odd
        assert odd["left"] == (0, 0), odd
        one = result["one_step"]
        # held between forward and backward, exactly: units x b x s x h x 4, divided by tp with Pa;
        # with Pa+cpu nothing on the device, the pieces on the host
        assert one["AC"]["held"] == (units * whole, 0)
        for name in ("AC+Pa", "AC+Pa+MD"):
            assert one[name]["held"] == (units * piece, 0), name
        for name in ("AC+Pa+cpu", "AC+Pa+cpu+MD"):
            assert one[name]["held"] == (0, units * piece), name
        for name in VARIANTS:
            assert one[name]["after_backward"] == (0, 0), name  # autograd freed every stored input
        # Pa's all-gather: b x s x h x units x (tp-1)/tp x 4 bytes per rank, in backward only
        plain = units * megatron_bytes_per_block(b, s, h, TP, fp32)  # 4 all-reduces of b x s x h per block
        for name in VARIANTS:
            pa = one[name]["pa"]
            assert pa == (0 if name == "AC" else units * whole * (TP - 1) // TP), name
            assert one[name]["pa_elsewhere"] == 0
            # recomputation repeats the attention's all-reduce in backward, not the MLP's: torch's
            # non-reentrant checkpoint stops once the last tensor backward needs is recomputed, and the
            # block's last all-reduce feeds none. 5 all-reduces per block, not ZeRO §8's 6.
            runtime = units * megatron_bytes_per_block(b, s, h, TP, fp32, RUNTIME_RECOMPUTED_ALL_REDUCES)
            assert one[name]["tp"] == plain * 5 // 4 == runtime, name
        ratio = one["AC+Pa"]["pa"] / one["AC+Pa"]["tp"]
        paper = (units * whole * (TP - 1) // TP) / (
            units * megatron_bytes_per_block(b, s, h, TP, fp32, PAPER_RECOMPUTED_ALL_REDUCES)
        )
        print(
            f"Pa's all-gather / tensor-parallel traffic with checkpointing: {ratio:.4f} (the paper's layout: {paper:.4f})"
        )
        assert ratio == pytest.approx(1 / 10) and paper == pytest.approx(1 / 12)
        # peaks over a step; allocations per step: one piece per block and micro-batch (and a staging
        # copy with Pa+cpu) without MD, none after the first step with it
        per_step = units * ACCUMULATION
        for stage in (1, 2, 3):
            records = {key: [r for r, _ in value] for key, value in result["records"].items()}
            grads = {key: [g for _, g in value] for key, value in result["records"].items()}
            print(f"stage {stage}: gradient-buffer allocations per step", {k: grads[(stage, k)] for k in VARIANTS})
            # gradient buffers (reduce-scatter outputs; stages 2-3 also each unit's flat gradient): the
            # same count every step without MD, none after the first step with it
            units_total = units + 1  # the blocks and the root
            first = units_total * (1 if stage == 1 else 2 * ACCUMULATION)
            for name in VARIANTS:
                md = "MD" in name
                assert grads[(stage, name)] == [first] + [0 if md else first] * (STEPS - 1), (stage, name)
            assert [r.device_peak_bytes for r in records[(stage, "AC")]] == [units * whole] * STEPS
            assert [r.allocations for r in records[(stage, "AC")]] == [0] * STEPS  # kept as they are: no copy
            assert [r.allocations for r in records[(stage, "AC+Pa")]] == [per_step] * STEPS
            assert [r.allocations for r in records[(stage, "AC+Pa+cpu")]] == [2 * per_step] * STEPS
            assert [r.allocations for r in records[(stage, "AC+Pa+MD")]] == [per_step] + [0] * (STEPS - 1)
            assert [r.allocations for r in records[(stage, "AC+Pa+cpu+MD")]] == [2 * per_step] + [0] * (STEPS - 1)
            for name in ("AC+Pa+cpu", "AC+Pa+cpu+MD"):  # at most two pieces back on the device, in backward
                assert {(r.device_peak_bytes, r.host_peak_bytes) for r in records[(stage, name)]} == {
                    (2 * piece, units * piece)
                }


SEQUENCE_PARALLEL_VARIANTS = ("AC", "AC+Pa", "AC+Pa+cpu", "AC+Pa+cpu+MD")


def sequence_parallel_scenarios() -> dict:
    from zeropp.config.sections import TopologyConfig
    from zeropp.topology import init_topology

    topology = init_topology(TopologyConfig(tensor_parallel_size=TP, sequence_parallel=True))
    errors, records = {}, {}
    for stage in (1, 3):
        plain, _ = _train(topology, stage, {})
        for name in SEQUENCE_PARALLEL_VARIANTS:
            ours, records[(stage, name)] = _train(topology, stage, VARIANTS[name])
            errors[(stage, name)] = max((ours[k] - plain[k]).abs().max().item() for k in plain)
    one_step = {name: _one_step(topology, VARIANTS[name]) for name in SEQUENCE_PARALLEL_VARIANTS}
    return dict(errors=errors, records=records, one_step=one_step)


def test_zero_r_with_sequence_parallelism_keeps_each_ranks_slice_and_trains_to_the_same_weights():
    """tp 2 with sequence parallelism: a block's input is already this rank's half of the sequence, so Pa
    keeps it as it is (no all-gather: splitting it again over the tensor-parallel ranks would mix the
    ranks' different slices); checkpointing, Pa, Pa+cpu and MD train to the weights of the run without
    them and hold units x b x s/2 x h, on the host with Pa+cpu; recomputation repeats attention's
    all-gather and reduce-scatter and the MLP's all-gather."""
    from zeropp.comm.ledger import ring_bytes
    from zeropp.tools.estimate.gpt import gpt_norm_parameters

    units, b, s, h, fp32 = GPT_TEST.n_layer, PER_RANK, GPT_TEST.block_size, GPT_TEST.d_model, 4
    piece = b * s * h * fp32 // TP  # one block's input on this rank
    for result in run_ranks(sequence_parallel_scenarios, world=4, nodes=2):
        for (stage, name), error in result["errors"].items():
            assert error <= 1e-6, (stage, name, error)
        one = result["one_step"]
        assert one["AC"]["held"] == one["AC+Pa"]["held"] == (units * piece, 0)
        assert one["AC+Pa+cpu"]["held"] == one["AC+Pa+cpu+MD"]["held"] == (0, units * piece)
        sent = ring_bytes(b * s * h * fp32, TP)  # one all-gather or reduce-scatter of b x s x h
        # tensor_parallel's formula with checkpointing: per block 8 + 3 recomputed, the ends, the norms
        tp = units * (8 + 3) * sent + 2 * sent + gpt_norm_parameters(units) * ring_bytes(h * fp32, TP, 2)
        for name in SEQUENCE_PARALLEL_VARIANTS:
            assert one[name]["after_backward"] == (0, 0), name
            assert one[name]["pa"] == one[name]["pa_elsewhere"] == 0, name
            assert one[name]["tp"] == tp, name
        for stage in (1, 3):
            records = {name: [r for r, _ in result["records"][(stage, name)]] for name in SEQUENCE_PARALLEL_VARIANTS}
            assert [r.device_peak_bytes for r in records["AC"]] == [units * piece] * STEPS
            assert [r.allocations for r in records["AC+Pa"]] == [units * ACCUMULATION] * STEPS  # a copy per input
            assert [r.allocations for r in records["AC+Pa+cpu+MD"]] == [2 * units * ACCUMULATION] + [0] * (STEPS - 1)
            assert {(r.device_peak_bytes, r.host_peak_bytes) for r in records["AC+Pa+cpu"]} == {
                (2 * piece, units * piece)
            }


# without tensor parallelism: (name, ZeroConfig keys of the run, of the run it must equal, tolerance)
PAIRS = [
    ("stage0-AC", dict(stage=0, **AC), dict(stage=0), 1e-6),
    ("zeropp-AC", dict(stage=3, quantized_weights=True, quantized_gradients=True, **AC),
     dict(stage=3, quantized_weights=True, quantized_gradients=True), 1e-6),
    ("stage2-Pa+cpu+MD-tp1", dict(stage=2, **PA, cpu_checkpointing=True, contiguous_memory_optimization=True),
     dict(stage=2), 1e-6),
    # torch.compile's CPU code is C++ compiled on the spot: the pair runs where a compiler does
    *([("stage3-AC-compiled", dict(stage=3, compile=True, **AC), dict(stage=3, **AC), 1e-5)] if not compiler_missing() else []),
]  # fmt: skip


def data_parallel_pairs() -> dict:
    from torch._dynamo.utils import counters

    from zeropp import ZeroEngine
    from zeropp.topology import init_topology

    topology = init_topology()
    world, rank = topology.world_size, topology.rank
    out = {}
    for name, keys, reference, _ in PAIRS:
        weights, pa = [], 0
        for config in (
            ZeroConfig(**keys, gradient_accumulation_steps=2),
            ZeroConfig(**reference, gradient_accumulation_steps=2),
        ):
            engine = ZeroEngine(make_model("gpt"), torch.optim.AdamW, dict(lr=1e-2, eps=ADAM_EPS), config, topology)
            for step in range(STEPS):
                for micro in range(2):
                    x, y = rows(global_batch("gpt", step, micro, world), rank)
                    engine.backward(loss_of("gpt", engine, x, y))
                engine.step()
            weights.append(engine.full_state_dict())
            pa += engine.comm.ledger.total(op="pa.all_gather")
        out[name] = (max((weights[0][k] - weights[1][k]).abs().max().item() for k in weights[0]), pa)
    out["compiled graphs"] = counters["stats"]["unique_graphs"]
    return out


def test_stage0_zeropp_compile_and_pa_without_tensor_parallelism_train_like_their_reference():
    for result in run_ranks(data_parallel_pairs, world=2, nodes=2):
        for name, _, _, tolerance in PAIRS:
            error, pa = result[name]
            assert error <= tolerance and pa == 0, (name, error, pa)  # tp 1: Pa's piece is the whole input
        assert compiler_missing() or result["compiled graphs"] > 0  # the blocks compiled inside the checkpoint


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (dict(partition_activations=True), "zero.partition_activations = True is not allowed; expected false unless "
         "zero.activation_checkpointing is true too"),
        (dict(AC, cpu_checkpointing=True), "zero.cpu_checkpointing = True is not allowed; expected false unless "
         "zero.partition_activations is true too"),
    ],
)  # fmt: skip
def test_switches_without_what_they_build_on_are_refused_in_one_line(keys, message):
    with pytest.raises(ConfigError) as error:
        ZeroConfig(**keys).validate()  # the engine's first act, before any collective
    assert str(error.value) == message


def test_zeropp_train_reports_the_checkpoint_bytes_and_pa_traffic(tmp_path):
    import json

    from cli_runner import run_cli
    from launcher import free_port

    from zeropp.app.models.gpt import PRESETS
    from zeropp.config.sections import load_config

    out = tmp_path / "summary.json"
    result = run_cli(
        "train", "--preset", "tiny", "--steps", "2", "--eval-batches", "1", "--stage", "3", "--init", "eager",
        "--nproc-per-node", "4", "--tensor-parallel", "2", "--master-port", str(free_port()),
        "--activation-checkpointing", "--partition-activations", "--summary-json", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(out.read_text())
    gpt, micro = PRESETS["tiny"], load_config().train.micro_batch_size
    whole = micro * gpt.block_size * gpt.d_model * 4  # a block's checkpointed input, fp32
    assert summary["activation_checkpoint_bytes_per_rank"] == gpt.n_layer * whole // 2
    assert summary["activation_checkpoint_host_bytes_per_rank"] == 0
    assert summary["ledger"]["pa.all_gather"] == {"backward": {"intra": gpt.n_layer * whole / 2, "inter": 0.0}}
    assert summary["tensor_parallel_bytes_per_step"] == 10 * summary["ledger"]["pa.all_gather"]["backward"]["intra"]


class Wrapped(torch.nn.Module):
    """A user's wrapper around a Hugging Face model: its forward takes no ``use_cache``."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor):
        return self.model(input_ids=input_ids, labels=labels)


def hugging_face_worker(wrapped: bool) -> dict:
    from zeropp import ZeroEngine
    from zeropp.config.sections import TopologyConfig
    from zeropp.topology import init_topology

    topology, states = init_topology(TopologyConfig()), []
    for extra in ({}, AC):
        model = make_model("hf-gpt2-dropout")
        assert model.config.use_cache  # Hugging Face's default: forward fills a KV cache
        hf = model
        model = Wrapped(model) if wrapped else model
        engine = ZeroEngine(model, torch.optim.AdamW, dict(lr=1e-2), ZeroConfig(stage=3, **extra), topology)
        torch.manual_seed(1)
        for step in range(3):
            engine.train(step < 2)  # the last step in eval mode: no dropout, the blocks still recomputed
            engine.backward(loss_of("hf-gpt2", engine, *rows(global_batch("hf-gpt2", step, 0, 1), 0)))
            assert engine.step()
        states.append(engine.full_state_dict())
    seen = []
    hf.register_forward_pre_hook(lambda *_: seen.append(hf.config.use_cache))
    x, y = rows(global_batch("hf-gpt2", 0, 0, 1), 0)
    loss_of("hf-gpt2", engine, x, y)
    with torch.no_grad():
        loss_of("hf-gpt2", engine, x, y)
    try:
        engine(input_ids=x.float(), labels=y)  # fails inside the forward
    except (RuntimeError, TypeError):
        seen.append(hf.config.use_cache)
    return dict(error=max((states[0][k] - states[1][k]).abs().max().item() for k in states[0]), seen=seen)


@pytest.mark.parametrize("wrapped", [False, True], ids=["model", "wrapped"])
def test_hugging_face_models_train_checkpointed_without_their_kv_cache(wrapped):
    """GPT-2 with eager attention, its KV cache on by default and dropout: recomputation would append
    its keys to the cache a second time (a shape error in eager attention) and must redraw forward's
    masks; checkpointed training (in train and eval mode) equals the plain run, also under a wrapper
    of the user's."""
    pytest.importorskip("transformers")
    (result,) = run_ranks(hugging_face_worker, world=1, wrapped=wrapped)
    assert result["error"] == 0.0
    # off in a forward that builds a graph, on without one (generation), back after a forward that raised
    assert result["seen"] == [False, True, False, True]
