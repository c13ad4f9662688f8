"""Tensor parallelism composed with ZeRO on real gloo ranks: exactness against one process, the
tensor-parallel traffic in the ledger, refusals."""

from __future__ import annotations

import pytest
import torch
from launcher import run_ranks
from models import ADAM_EPS, GPT_TEST, STEPS, TOLERANCE, global_batch, loss_of, make_model, reference_state, rows

# (name, stage, accumulation, max_grad_norm)
SCENARIOS = [
    *[(f"stage{stage}", stage, 1, None) for stage in (0, 1, 2, 3)],
    *[(f"stage{stage}-accum2-clip", stage, 2, 0.05) for stage in (1, 3)],
]


def train_tensor_parallel(tp: int, kind: str = "gpt", sequence_parallel: bool = False) -> dict[str, float]:
    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.config.sections import TopologyConfig
    from zeropp.costs.tensor_parallel import local_numels
    from zeropp.tensor_parallel.apply import parallelize, plan_for
    from zeropp.topology import init_topology
    from zeropp.zero.weights.dtensor_params import is_split, local_tensor

    topology = init_topology(TopologyConfig(tensor_parallel_size=tp, sequence_parallel=sequence_parallel))
    dp = topology.data_parallel  # nodes: the launcher's
    errors = {}
    for name, stage, accumulation, max_norm in SCENARIOS:
        optim_kwargs = dict(lr=1e-2, eps=ADAM_EPS, weight_decay=0.01)
        config = ZeroConfig(stage=stage, gradient_accumulation_steps=accumulation, max_grad_norm=max_norm)
        model = parallelize(make_model(kind), topology)
        assert sum(p.to_local().numel() if is_split(p) else 0 for p in model.parameters()) > 0
        # the estimator's count of what this rank holds, without splitting the model
        whole = make_model(kind)
        assert local_numels(whole, plan_for(whole, tp), tp) == {
            n: local_tensor(p).numel() for n, p in model.named_parameters()
        }
        engine = ZeroEngine(model, torch.optim.AdamW, optim_kwargs, config, topology)
        clipped = False
        for step in range(STEPS):
            for micro in range(accumulation):
                x, y = rows(global_batch(kind, step, micro, dp.size), dp.rank)  # tp ranks read the same rows
                engine.backward(loss_of(kind, engine, x, y))
            assert engine.step()
            clipped |= max_norm is not None and engine.last_grad_norm > max_norm
        assert max_norm is None or clipped, f"{name}: clipping never engaged"
        ours = engine.full_state_dict()
        ref = reference_state(kind, STEPS, dp.size, accumulation, max_norm, optim_kwargs)
        assert ours.keys() == ref.keys(), name
        errors[name] = max((ours[k] - ref[k]).abs().max().item() for k in ref)
    return errors


SEQUENCE_PARALLEL = pytest.mark.parametrize("sequence_parallel", [False, True], ids=["megatron", "sequence-parallel"])


@pytest.mark.parametrize(
    "kind,world,nodes,sequence_parallel",
    [
        ("gpt", 4, 2, False),
        ("gpt", 2, 1, False),
        ("hf-llama", 4, 2, False),
        ("hf-llama", 2, 1, False),
        ("hf-gpt2", 4, 2, False),
        ("hf-gpt2", 2, 1, False),
        ("gpt", 4, 2, True),
        ("gpt", 2, 1, True),
        ("hf-llama", 4, 2, True),
        ("hf-gpt2", 4, 2, True),
    ],
    ids=lambda value: (
        {True: "sequence-parallel", False: "megatron"}.get(value, value) if isinstance(value, bool) else str(value)
    ),
)
def test_tensor_parallel_trains_to_the_weights_of_one_process(kind, world, nodes, sequence_parallel):
    if kind.startswith("hf-"):
        pytest.importorskip("transformers")
    results = run_ranks(
        train_tensor_parallel, world=world, nodes=nodes, tp=2, kind=kind, sequence_parallel=sequence_parallel
    )
    for rank_errors in results:
        for name, error in rank_errors.items():
            assert error <= TOLERANCE, (name, error)


def mixed_precision_worker(sequence_parallel: bool) -> dict:
    from models import BF16_OPTIM as OPTIM
    from models import BF16_STEPS

    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.config.sections import TopologyConfig
    from zeropp.tensor_parallel.apply import parallelize
    from zeropp.topology import init_topology
    from zeropp.zero.weights.dtensor_params import local_tensor

    topology = init_topology(TopologyConfig(tensor_parallel_size=2, sequence_parallel=sequence_parallel))
    dp = topology.data_parallel
    reference = reference_state("gpt", BF16_STEPS, dp.size, 1, None, OPTIM)
    out = {}
    for precision, stage in (("bf16", 3), ("fp16", 1)):
        config = ZeroConfig(stage=stage, precision=precision)
        engine = ZeroEngine(parallelize(make_model("gpt"), topology), torch.optim.AdamW, dict(OPTIM), config, topology)
        for step in range(BF16_STEPS):
            x, y = rows(global_batch("gpt", step, 0, dp.size), dp.rank)
            engine.backward(loss_of("gpt", engine, x, y))
            assert engine.step()
        ours = engine.full_state_dict()
        out[precision] = dict(
            error=max((ours[k] - reference[k]).abs().max().item() for k in reference),
            dtypes={str(p.dtype) for p in engine.module.parameters()}
            | {str(local_tensor(p).dtype) for p in engine.module.parameters()},
            masters={str(unit.master.dtype) for unit in engine.units},
        )
    return out


@SEQUENCE_PARALLEL
def test_bf16_and_fp16_with_tensor_parallelism_train_close_to_the_fp32_reference(sequence_parallel):
    from models import BF16_TOLERANCE

    per_rank = run_ranks(mixed_precision_worker, world=4, nodes=2, sequence_parallel=sequence_parallel)
    for rank, results in enumerate(per_rank):
        for precision, got in results.items():
            what = f"rank {rank} {precision}: {got}"
            # DTensor parameters and their local shards in the compute dtype, fp32 masters
            assert got["dtypes"] == {f"torch.{dict(bf16='bfloat16', fp16='float16')[precision]}"}, what
            assert got["masters"] == {"torch.float32"}, what
            assert 1e-4 < got["error"] <= BF16_TOLERANCE, what  # low precision really ran, and stayed close


def ledger_of_one_step(stage: int, kind: str = "gpt", sequence_parallel: bool = False) -> dict:
    from torch.distributed.tensor.debug import CommDebugMode

    from zeropp import ConfigError, ZeroConfig, ZeroEngine
    from zeropp.config.sections import TopologyConfig
    from zeropp.costs.volume import zero3_step_bytes, zero3_units
    from zeropp.tensor_parallel.apply import parallelize
    from zeropp.topology import init_topology

    topology = init_topology(TopologyConfig(tensor_parallel_size=2, sequence_parallel=sequence_parallel))
    dp = topology.data_parallel
    zero = ZeroConfig(stage=stage)
    with pytest.raises(ConfigError, match="call zeropp.parallelize"):  # before any collective of the engine
        ZeroEngine(make_model("gpt"), torch.optim.AdamW, dict(lr=1e-3), zero, topology)
    engine = ZeroEngine(parallelize(make_model(kind), topology), torch.optim.AdamW, dict(lr=1e-3), zero, topology)
    engine.comm.ledger.reset()
    x, y = rows(global_batch(kind, 0, 0, dp.size), dp.rank)
    if sequence_parallel:  # a sequence that does not split in 2: refused before the forward's first collective
        with CommDebugMode() as observer, pytest.raises(ConfigError, match="a sequence of 15 tokens is not allowed"):
            engine(x[:, :15], y[:, :15])
        assert observer.get_total_counts() == 0 and not engine.comm.ledger.calls
    with CommDebugMode() as observer:  # torch's own count of every collective, functional or not
        engine.backward(loss_of(kind, engine, x, y))
        engine.step()
    ledger = engine.comm.ledger
    dp_layout = topology.layout.data_parallel_layout()
    zero3 = zero3_step_bytes(zero3_units((u.layout for u in engine.units), dp_layout, zero), dp_layout, zero)
    return dict(
        ledger_calls=sum(ledger.calls.values()),
        torch_calls=observer.get_total_counts(),
        calls={f"{op}/{phase}": n for (op, phase), n in ledger.calls.items()},
        tp_bytes={phase: ledger.total(op="tp.all_reduce", phase=phase) for phase in ("forward", "backward", "step")},
        tp_ops={
            f"{op}/{phase}": ledger.total(op=op, phase=phase) for (op, phase) in ledger.calls if op.startswith("tp.")
        },
        tp_total=sum(b for (op, _, _), b in ledger.bytes.items() if op.startswith("tp.")),
        tp_inter=sum(b for (op, _, link), b in ledger.bytes.items() if op.startswith("tp.") and link == "inter"),
        dp_bytes={
            p: sum(b for (op, ph, _), b in ledger.bytes.items() if ph == p and not op.startswith("tp."))
            for p in ("forward", "backward")
        },
        zero3_bytes={p: zero3[p]["intra"] + zero3[p]["inter"] for p in ("forward", "backward")},
    )


@pytest.mark.parametrize("kind", ["gpt", "hf-gpt2"])
def test_ledger_counts_every_tensor_parallel_collective_by_the_megatron_formula(kind):
    from zeropp.costs.tensor_parallel import megatron_bytes_per_block

    if kind == "hf-gpt2":  # c_attn and c_fc column-wise, the two c_proj row-wise: Megatron's layout too
        pytest.importorskip("transformers")
        config = make_model(kind).config
        layers, hidden = config.n_layer, config.n_embd
    else:
        layers, hidden = GPT_TEST.n_layer, GPT_TEST.d_model
    batch, seq = 2, GPT_TEST.block_size
    per_block = megatron_bytes_per_block(batch, seq, hidden, tp=2, element_bytes=4)
    for result in run_ranks(ledger_of_one_step, world=4, nodes=2, stage=3, kind=kind):
        assert result["ledger_calls"] == result["torch_calls"]  # nothing issued outside the ledger's view
        # Megatron's layout: 2 all-reduces per block in forward, 2 in backward
        assert result["calls"]["tp.all_reduce/forward"] == 2 * layers
        assert result["calls"]["tp.all_reduce/backward"] == 2 * layers
        assert result["tp_bytes"] == {
            "forward": layers * per_block // 2,
            "backward": layers * per_block // 2,
            "step": 0,
        }
        assert result["tp_total"] == layers * per_block and result["tp_inter"] == 0  # inside a node
        # ZeRO-3 over the data-parallel ranks on the tensor-parallel-local units: the traffic model's bytes
        assert result["dp_bytes"] == pytest.approx(result["zero3_bytes"])


@pytest.mark.parametrize("kind", ["gpt", "hf-gpt2"])
def test_sequence_parallel_ledger_is_the_documented_formula(kind):
    """dp 2 x tp 2, stage 3, with sequence parallelism: per block 2 all-gathers and 2 reduce-scatters
    of b x s x h in forward and in backward (Megatron's bytes), one all-gather more at each end of
    the sequence-parallel region, and the partial gradients of the layer-norm weights and biases in it
    all-reduced, one message per unit (without that all-reduce the norms would train on half their
    gradient: the exactness test fails). GPT-2's final norm is outside the region (its gradient is whole)."""
    from zeropp.comm.ledger import ring_bytes
    from zeropp.costs.tensor_parallel import megatron_bytes_per_block
    from zeropp.tools.estimate.gpt import gpt_norm_parameters

    if kind == "hf-gpt2":
        pytest.importorskip("transformers")
    layers, batch, seq = GPT_TEST.n_layer, 2, GPT_TEST.block_size
    hidden = GPT_TEST.d_model if kind == "gpt" else make_model(kind).config.n_embd
    sent = ring_bytes(batch * seq * hidden * 4, 2)  # one all-gather or reduce-scatter of b x s x h, fp32
    # 2 layer norms per block (a weight and a bias each) and, for the GPT, the final one (in the root unit)
    norms = gpt_norm_parameters(layers) if kind == "gpt" else 4 * layers
    assert norms == {"gpt": 10, "hf-gpt2": 8}[kind]
    units_with_norms = layers + 1 if kind == "gpt" else layers
    for result in run_ranks(ledger_of_one_step, world=4, nodes=2, stage=3, kind=kind, sequence_parallel=True):
        assert result["ledger_calls"] == result["torch_calls"]  # nothing issued outside the ledger's view
        calls = {name: n for name, n in result["calls"].items() if name.startswith("tp.")}
        assert calls == {
            "tp.all_gather/forward": 2 * layers + 1,  # attention's and the MLP's inputs, the head's
            "tp.reduce_scatter/forward": 2 * layers,  # the row-wise linears' outputs
            "tp.all_gather/backward": 2 * layers + 1,  # their output gradients, the first block's input gradient
            "tp.reduce_scatter/backward": 2 * layers,  # the column-wise linears' input gradients
            "tp.all_reduce/backward": units_with_norms,  # the layer norms' partial gradients, one per unit
        }
        assert result["tp_ops"]["tp.all_gather/forward"] == (2 * layers + 1) * sent
        assert result["tp_ops"]["tp.all_reduce/backward"] == norms * hidden * 4  # 2 (t-1)/t of h fp32 each
        # tensor_parallel's formula: L x 8 r bsh e + 2 r bsh e + P x 2 r h e, r = 1/2, e = 4
        block = megatron_bytes_per_block(batch, seq, hidden, 2, 4, sequence_parallel=True)
        assert block == megatron_bytes_per_block(batch, seq, hidden, 2, 4) == 8 * sent  # Megatron's bytes
        assert result["tp_total"] == layers * block + 2 * sent + norms * hidden * 4 and result["tp_inter"] == 0
        assert result["dp_bytes"] == pytest.approx(result["zero3_bytes"])


def norm_gradient_ledger(stage: int, accumulation: int) -> dict:
    """tp 2 with sequence parallelism (dp 1): the ledger's norm-gradient all-reduces in one step."""
    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.config.sections import TopologyConfig
    from zeropp.tensor_parallel.apply import parallelize
    from zeropp.topology import init_topology

    topology = init_topology(TopologyConfig(tensor_parallel_size=2, sequence_parallel=True))
    zero = ZeroConfig(stage=stage, gradient_accumulation_steps=accumulation)
    engine = ZeroEngine(parallelize(make_model("gpt"), topology), torch.optim.AdamW, dict(lr=1e-3), zero, topology)
    engine.comm.ledger.reset()
    for micro in range(accumulation):
        engine.backward(loss_of("gpt", engine, *rows(global_batch("gpt", 0, micro, 1), 0)))
    engine.step()
    ledger = engine.comm.ledger
    return dict(
        calls=ledger.calls[("tp.all_reduce", "backward")], bytes=ledger.total(op="tp.all_reduce", phase="backward")
    )


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_norm_gradients_are_summed_once_per_unit_and_gradient_reduction(stage):
    """Each unit all-reduces its norms' partial gradients as one message when it reduces its gradients:
    every micro-batch at stages 2-3, once a step at 0-1 (the partial sums of the micro-batches
    accumulate first); the estimator's :func:`~zeropp.costs.volume.norm_gradient_transfers` agrees."""
    from zeropp.comm.ledger import ring_bytes
    from zeropp.costs.memory import Activations
    from zeropp.costs.volume import norm_gradient_transfers
    from zeropp.tools.estimate.gpt import gpt_norm_parameters

    layers, hidden, accumulation = GPT_TEST.n_layer, GPT_TEST.d_model, 2
    reductions = accumulation if stage >= 2 else 1
    norms = gpt_norm_parameters(layers)
    acts = Activations(layers, hidden, GPT_TEST.block_size, 2, sequence_parallel=True, norm_parameters=norms)
    priced = sum(t.sent for t in norm_gradient_transfers(acts, 2, 4, reductions))
    for result in run_ranks(norm_gradient_ledger, world=2, stage=stage, accumulation=accumulation):
        assert result["calls"] == (layers + 1) * reductions  # the blocks' units and the root's (ln_f)
        assert result["bytes"] == reductions * norms * ring_bytes(hidden * 4, 2, 2) == priced


def test_a_collective_without_a_byte_model_stops_the_run():
    from zeropp.comm.observed import ObservedCollectives, UncountedCollective

    with pytest.raises(UncountedCollective, match="no byte model for the collective made_up"):
        ObservedCollectives(comm=None)._record("made_up", (), None)


def test_zeropp_train_with_tensor_parallel_sees_the_batches_of_the_same_data_parallel_run(tmp_path):
    import json

    from cli_runner import run_cli
    from launcher import free_port

    common = ("train", "--preset", "tiny", "--steps", "3", "--eval-batches", "1", "--stage", "2")  # built on meta
    tensor_parallel = ("--nproc-per-node", "4", "--tensor-parallel", "2", "--checkpoint-dir", str(tmp_path / "ckpt"))
    summaries = {}
    for name, extra in (
        ("tp", (*tensor_parallel, "--save-interval", "2")),
        ("dp", ("--nproc-per-node", "2")),
        ("sp", ("--nproc-per-node", "4", "--tensor-parallel", "2", "--sequence-parallel")),
        ("cp", ("--nproc-per-node", "4", "--context-parallel", "2")),  # Ulysses: each rank half of every sequence
        ("resumed", (*tensor_parallel, "--resume", str(tmp_path / "ckpt" / "step-00000002"))),
    ):
        out = tmp_path / f"{name}.json"
        result = run_cli(*common, *extra, "--master-port", str(free_port()), "--summary-json", str(out))
        assert result.returncode == 0, result.stderr[-3000:]
        summaries[name] = json.loads(out.read_text())
    tp, dp, resumed, sp = summaries["tp"], summaries["dp"], summaries["resumed"], summaries["sp"]
    assert (tp["world_size"], tp["tensor_parallel_size"], dp["tensor_parallel_size"]) == (4, 2, 1)
    assert (sp["sequence_parallel"], tp["sequence_parallel"]) == (True, False)
    # 2 data-parallel ranks every time, same micro-batch and initial weights: the same losses, step by step
    assert tp["train_losses"] == pytest.approx(dp["train_losses"], abs=1e-5)
    assert sp["train_losses"] == pytest.approx(dp["train_losses"], abs=1e-5)
    assert summaries["cp"]["train_losses"] == pytest.approx(dp["train_losses"], abs=1e-4)
    assert tp["tokens_per_s"] > 0 and dp["tensor_parallel_bytes_per_step"] == 0
    # Megatron's layout: 4 all-reduces per block and micro-batch, of micro_batch x block_size x d_model fp32
    from safetensors.torch import load_file

    from zeropp.app.models.gpt import GPT, PRESETS
    from zeropp.comm.ledger import ring_bytes
    from zeropp.config.sections import load_config
    from zeropp.costs.tensor_parallel import megatron_bytes_per_block
    from zeropp.tools.estimate.gpt import gpt_norm_parameters

    gpt, micro = PRESETS["tiny"], load_config().train.micro_batch_size
    per_block = megatron_bytes_per_block(micro, gpt.block_size, gpt.d_model, tp=2, element_bytes=4)
    assert tp["tensor_parallel_bytes_per_step"] == gpt.n_layer * per_block
    # sequence parallelism: the same bytes per block, an all-gather at each end, the layer norms' gradients
    sent, norms = ring_bytes(micro * gpt.block_size * gpt.d_model * 4, 2), gpt_norm_parameters(gpt.n_layer)
    assert sp["tensor_parallel_bytes_per_step"] == gpt.n_layer * per_block + 2 * sent + norms * ring_bytes(
        gpt.d_model * 4, 2, 2
    )
    assert tp["ledger"]["tp.all_reduce"]["forward"]["inter"] == 0
    # Ulysses: per block, forward and backward, q, k, v and the output of each rank's half sequence
    from zeropp.costs.context_parallel import ulysses_bytes

    attention = ulysses_bytes(micro, gpt.block_size, gpt.n_head, gpt.n_head, gpt.d_model // gpt.n_head, 2, 4)
    assert summaries["cp"]["context_parallel_bytes_per_step"] == 2 * gpt.n_layer * attention
    assert summaries["cp"]["context_parallel_size"] == 2 and dp["context_parallel_bytes_per_step"] == 0
    priced = tmp_path / "estimate.json"
    estimate = ("estimate", "--world", "4", "--preset", "tiny", "--stage", "2", "--context-parallel-size", "2")
    assert run_cli(*estimate, "--json", str(priced)).returncode == 0
    assert json.loads(priced.read_text())["context_parallel_bytes_per_step"] == 2 * gpt.n_layer * attention
    # model states: this rank's tensor-parallel share of the parameters, sharded over 2 data-parallel ranks
    assert tp["param_count"] < dp["param_count"]
    # the tensor-parallel checkpoint of step 2 resumed: step 3 as in the uninterrupted run
    assert (resumed["start_step"], resumed["train_losses"]) == (2, tp["train_losses"][2:])
    exported = tmp_path / "model.safetensors"
    assert run_cli("export", str(tmp_path / "ckpt" / "step-00000003"), str(exported)).returncode == 0
    GPT(PRESETS["tiny"]).load_state_dict(load_file(str(exported)))  # whole tensors under every name
