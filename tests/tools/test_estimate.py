"""zeropp estimate: its byte and memory models (with tensor parallelism and ZeRO-R), the engine's
ledger, the command line. The papers' published numbers: tests/tools/test_estimate_papers.py.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from launcher import run_ranks
from test_estimate_papers import SCALES_INT8

from zeropp.app.models.gpt import PRESETS
from zeropp.comm.ledger import ring_bytes
from zeropp.config.model import ModelConfig
from zeropp.config.sections import LossScaleConfig, ZeroConfig
from zeropp.costs import tensor_parallel
from zeropp.costs.memory import PAPER_RECOMPUTED_ALL_REDUCES, Activations
from zeropp.costs.volume import zero3_step_bytes
from zeropp.errors import ConfigError
from zeropp.index.ranks import Layout
from zeropp.tools.estimate import (
    ZEROPP_SWITCHES,
    estimate,
    gpt_activations,
    gpt_unit_numels,
    main,
    pa_example,
    parse_bandwidth,
    trillion_example,
)

# -- tensor parallelism and ZeRO-R ---------------------------------------------------------------------


def test_gpt_units_on_one_tensor_parallel_rank():
    """Megatron's layout: per block, qkv and the MLP's first linear split with their biases, the output
    projections' weights split and biases whole, layer norms whole; the root (embeddings, ln_f) whole."""
    model = ModelConfig(preset="small")
    d, layers = PRESETS["small"].d_model, PRESETS["small"].n_layer
    whole = [sum(unit) for unit in gpt_unit_numels(model)]
    for tp in (2, 4):
        local = [sum(unit) for unit in gpt_unit_numels(model, tp)]
        assert local[:-1] == [(12 * d * d + 7 * d) // tp + 6 * d] * layers
        assert local[-1] == whole[-1]


@pytest.mark.parametrize("tp", [2, 4])
def test_estimate_activation_checkpoints_and_tensor_parallel_traffic(tp):
    model = ModelConfig(preset="small")
    gpt, micro = PRESETS["small"], 3
    bsh = micro * gpt.block_size * gpt.d_model
    zero = ZeroConfig(stage=3, gradient_accumulation_steps=2)

    def run(**switches):
        acts = gpt_activations(model, micro, **switches)
        return estimate(gpt_unit_numels(model, tp), 8, 2, zero, tensor_parallel=tp, activations=acts)

    plain, checkpointed = run(), run(activation_checkpointing=True)
    pa = run(activation_checkpointing=True, partition_activations=True)
    cpu = run(activation_checkpointing=True, partition_activations=True, cpu_checkpointing=True)
    per_block = tensor_parallel.megatron_bytes_per_block(micro, gpt.block_size, gpt.d_model, tp, 4)
    assert plain.bytes_of("tp") == 2 * gpt.n_layer * per_block  # 2 micro-batches
    # zeropp's recomputation repeats one of the block's 2 forward all-reduces (the paper's layout: both)
    assert checkpointed.bytes_of("tp") == plain.bytes_of("tp") * 5 / 4
    assert plain.bytes_of("pa") == checkpointed.bytes_of("pa") == 0
    assert pa.bytes_of("pa") == 2 * gpt.n_layer * ring_bytes(4 * bsh, tp) == pa.bytes_of("tp") / 10
    paper = run(
        activation_checkpointing=True, partition_activations=True, recomputed_all_reduces=PAPER_RECOMPUTED_ALL_REDUCES
    )
    assert paper.bytes_of("tp") == plain.bytes_of("tp") * 6 / 4 and paper.bytes_of("pa") == paper.bytes_of("tp") / 12
    assert plain.activation_checkpoint_bytes() == 0
    assert checkpointed.activation_checkpoint_bytes() == gpt.n_layer * bsh * 4
    assert pa.activation_checkpoint_bytes() == gpt.n_layer * bsh * 4 // tp
    assert (
        cpu.activation_checkpoint_bytes() == 0
        and cpu.activation_checkpoint_bytes("host") == gpt.n_layer * bsh * 4 // tp
    )
    for est in (plain, checkpointed, pa, cpu):  # all inside a node; ZeRO's bytes as without tensor-parallel traffic
        assert (
            est.ledger().total(op="tp.all_reduce", link="inter")
            == est.ledger().total(op="pa.all_gather", link="inter")
            == 0
        )
        assert est.model_state_bytes == plain.model_state_bytes
    with pytest.raises(
        ConfigError, match="zero.partition_activations = True is not allowed; expected false unless zero.activation_ch"
    ):
        Activations(1, 1, 1, 1, partition_activations=True)


@pytest.mark.parametrize("tp", [2, 4])
def test_estimate_sequence_parallel_traffic_and_checkpoints(tp):
    """tensor_parallel's formula: per block and micro-batch 4 all-gathers and 4 reduce-scatters of
    b x s x h (Megatron's bytes), 2 all-gathers at the model's ends, the 2 (2L + 1) layer-norm vectors'
    gradients all-reduced; checkpointing recomputes 3 of the block's collectives (the paper's layout 4);
    every checkpoint is 1/tp of the block's input, Pa moves nothing."""
    model = ModelConfig(preset="small")
    gpt, micro, layers = PRESETS["small"], 3, PRESETS["small"].n_layer
    bsh = micro * gpt.block_size * gpt.d_model
    zero = ZeroConfig(stage=3, gradient_accumulation_steps=2)

    def run(sequence_parallel=True, **switches):
        acts = gpt_activations(model, micro, sequence_parallel=sequence_parallel, **switches)
        return estimate(gpt_unit_numels(model, tp), 8, 2, zero, tensor_parallel=tp, activations=acts)

    ac = dict(activation_checkpointing=True)
    plain, megatron, checkpointed = run(), run(False), run(**ac)
    pa, cpu = run(**ac, partition_activations=True), run(**ac, partition_activations=True, cpu_checkpointing=True)
    paper = run(**ac, recomputed_all_reduces=PAPER_RECOMPUTED_ALL_REDUCES)
    sent, norms = ring_bytes(4 * bsh, tp), 2 * (2 * layers + 1)
    ends = 2 * sent + norms * ring_bytes(4 * gpt.d_model, tp, 2)
    assert (
        plain.bytes_of("tp") == 2 * (layers * 8 * sent + ends) == megatron.bytes_of("tp") + 2 * ends
    )  # 2 micro-batches
    assert checkpointed.bytes_of("tp") == plain.bytes_of("tp") + 2 * layers * 3 * sent
    assert paper.bytes_of("tp") == plain.bytes_of("tp") + 2 * layers * 4 * sent
    assert pa.bytes_of("pa") == cpu.bytes_of("pa") == 0 and pa.bytes_of("tp") == checkpointed.bytes_of("tp")
    ledger = plain.ledger().as_dict()
    assert set(ledger["tp.all_reduce"]) == {"backward"} and "tp.reduce_scatter" in ledger
    piece = layers * bsh * 4 // tp
    assert checkpointed.activation_checkpoint_bytes() == pa.activation_checkpoint_bytes() == piece
    assert cpu.activation_checkpoint_bytes() == 0 and cpu.activation_checkpoint_bytes("host") == piece
    assert plain.model_state_bytes == megatron.model_state_bytes
    # stages 0-1 reduce gradients once a step: the 2 micro-batches' partial norm gradients summed once
    once = estimate(
        gpt_unit_numels(model, tp), 8, 2, ZeroConfig(stage=1, gradient_accumulation_steps=2), tensor_parallel=tp,
        activations=gpt_activations(model, micro, sequence_parallel=True),
    )  # fmt: skip
    assert once.bytes_of("tp") == plain.bytes_of("tp") - norms * ring_bytes(4 * gpt.d_model, tp, 2)


# -- zeropp's own byte models ---------------------------------------------------------------------------


def test_gpt_units_are_the_engines():
    for preset, config in PRESETS.items():
        numels = [sum(unit) for unit in gpt_unit_numels(ModelConfig(preset=preset))]
        d = config.d_model
        assert numels[:-1] == [12 * d * d + 13 * d] * config.n_layer  # one unit per block, the root last
        assert sum(numels) == config.param_count


@pytest.mark.parametrize("precision,accumulation,threshold", [("fp32", 1, 0), ("bf16", 2, 0), ("bf16", 1, 10**6)])
def test_zero3_estimate_equals_zero3_step_bytes(precision, accumulation, threshold):
    numels = gpt_unit_numels(ModelConfig(preset="small"))
    zero = ZeroConfig(
        stage=3, precision=precision, gradient_accumulation_steps=accumulation, persistence_threshold=threshold
    )
    est = estimate(numels, 4, 2, zero)
    mean = est.ledger()
    baseline = zero3_step_bytes([(u.padded, u.resident) for u in est.units], Layout(4, 2), zero)
    assert est.zero3_bytes() == baseline
    for phase, links in baseline.items():
        for link, expected in links.items():  # the estimate also has the step's all-reduces
            got = mean.total(phase=phase, link=link) - mean.total(op="all_reduce", phase=phase, link=link)
            assert got == expected, (phase, link, got, expected)
    # one fp32 number (the norm) and a byte per parameter (which got a gradient), all-reduced
    assert mean.total(op="all_reduce") == ring_bytes(4, 4, 2) + ring_bytes(sum(map(len, numels)), 4, 2)


def test_zero_section_7_volumes_and_the_ledger_bounds_of_test_zeropp():
    """Stages 0-2 send 2Ψ per rank and stage 3 3Ψ (x (N-1)/N); ZeRO++ on test_zeropp's GPT stays
    within the bounds that test_ledger_shows_zeropp_table_1_and_hpz_memory asserts on the ledger."""
    psi = 2**20
    sent = {s: estimate(psi, 4, 2, ZeroConfig(stage=s)).ledger() for s in range(4)}
    for stage, ledger in sent.items():
        big = ledger.total() - ledger.total(op="all_reduce", phase="step")
        assert big == (3 if stage == 3 else 2) * 4 * psi * 3 / 4
    model = ModelConfig(preset="tiny", block_size=32)
    numels = gpt_unit_numels(model)
    plain = estimate(numels, 4, 2, ZeroConfig(stage=3, precision="bf16"))
    quantized = estimate(numels, 4, 2, ZeroConfig(stage=3, precision="bf16", **ZEROPP_SWITCHES))
    # qwZ starts each parameter on a block: this toy's norms and biases pad to 4% more elements
    padding = sum(u.padded for u in quantized.units) / sum(u.padded for u in plain.units)
    assert 1 < padding < 1.05
    z3, zpp = plain.ledger(), quantized.ledger()
    overhead = 4 / (2 * 256) + padding - 1
    forward = zpp.total(phase="forward", link="inter") / z3.total(phase="forward", link="inter")
    assert 0.5 <= forward <= 0.5 + overhead + 1e-3
    assert zpp.total(op="all_gather", phase="backward", link="inter") == 0
    gradients = zpp.total(op="all_to_all", link="inter") / z3.total(op="reduce_scatter", link="inter")
    assert 0 < gradients <= 0.25 + overhead / 2


def test_qgz_and_qwz_bytes_by_hand():
    """One unit of 2^16 elements on 2 nodes x 2, bf16, blocks of 256, one bucket, 2 pipeline chunks (of any size)."""
    zero = ZeroConfig(stage=3, precision="bf16", **ZEROPP_SWITCHES, qgz_pipeline_chunks=2, qgz_pipeline_min_chunk=1)
    ledger = estimate(2**16, 4, 2, zero).ledger(rank=0)
    shard, chunk = 2**14, 2**13
    # qwZ: int8 shard + 64 scales, ring over 4 ranks; rank 0's successor is on its node
    assert ledger.total(op="all_gather", phase="forward", link="intra") == 3 * (shard + 4 * shard // 256)
    # hpZ: the bf16 weights gathered inside the node (2 ranks)
    assert ledger.total(op="all_gather", phase="backward", link="intra") == 2 * 2**16 // 2
    # qgZ per chunk: hop 1 sends 1 of 2 node-peers 2 rows (4 rows / 2), hop 2 one row to the other node
    row = chunk // 2 + 4 * chunk // 256
    assert ledger.total(op="all_to_all", link="intra") == 2 * (1 * 2 * row)
    assert ledger.total(op="all_to_all", link="inter") == 2 * (1 * row)


def test_lora_memory_and_bytes_by_hand():
    """Ψ = 2^20, three quarters frozen, on 4 ranks in fp32 with Adam, frozen weights stored int4 in blocks
    of 256: 16 bytes per trainable parameter over 4 ranks, 1/2 + 4/256 bytes per frozen one over 4
    (plus hpZ's copy over 2), and every rank's int4 message gathered beside the fp32 weights."""
    trainable, frozen, shard = 2**18, 3 * 2**18, 3 * 2**16
    lora = dict(quantized_nontrainable_weights=True, nontrainable_weight_bits=4)
    est = estimate(2**20, 4, 1, ZeroConfig(stage=3, **lora), frozen_fraction=0.75)
    assert (est.psi, est.frozen_psi) == (trainable, frozen)
    int4 = 1 / 2 + 4 / 256
    assert est.model_state_bytes == 16 * trainable / 4 + int4 * frozen / 4
    message = shard // 2 + 4 * shard // 256  # one rank's stored row: int4 data, then fp32 scales
    for phase in ("forward", "backward"):
        assert est.ledger().total(op="all_gather", phase=phase) == 3 / 4 * (4 * trainable + 4 * message)
    plain = estimate(2**20, 4, 1, ZeroConfig(stage=3), frozen_fraction=0.75)
    assert plain.model_state_bytes == 16 * trainable / 4 + 4 * frozen / 4
    assert plain.ledger().total(op="all_gather", phase="forward") == 3 / 4 * 4 * 2**20
    assert est.zero3_bytes()["forward"]["intra"] == plain.ledger().total(op="all_gather", phase="forward")
    # hpZ over each node of 2: the copy of both, int4 messages for the frozen part; backward stays inside the node
    hpz = estimate(2**20, 4, 2, ZeroConfig(stage=3, hpz_partition_size=2, **lora), frozen_fraction=0.75)
    assert hpz.model_state_bytes == est.model_state_bytes + (4 * trainable + int4 * frozen) / 2
    assert hpz.ledger().total(op="all_gather", phase="backward", link="inter") == 0
    assert hpz.ledger().total(op="all_gather", phase="backward") == 1 / 2 * (4 * trainable + 4 * message)
    # below stage 3 the frozen base is whole on every rank and never sent
    stage2 = estimate(2**20, 4, 1, ZeroConfig(stage=2), frozen_fraction=0.75)
    assert stage2.model_state_bytes == (4 + 4 / 4 + 12 / 4) * trainable + 4 * frozen
    assert stage2.ledger().total(op="all_gather") == 4 * trainable * 3 / 4  # the updated trainable weights


def test_qwd_on_one_node_is_refused_as_the_engine_refuses_it():
    zero = ZeroConfig(stage=3, **ZEROPP_SWITCHES, weight_quantization="delta")
    with pytest.raises(
        ConfigError, match=r"^zero.weight_quantization = 'delta' needs hpZ, which is off .* 1 node\(s\)"
    ):
        estimate(2**16, 4, 1, zero)
    assert estimate(2**16, 4, 2, zero).hpz_group_size == 2


def test_qwd_bytes_by_hand():
    """The same unit with int4 qWD: the forward gather is the reference inside the node (bf16, hpZ's group
    of 2) and the int4 changes over the 4 ranks; the first step after construction or a load gathers the
    bf16 weights over the 4 ranks instead. Rank 1's ring successor is on the other node."""
    from zeropp.costs.volume import step_transfers

    zero = ZeroConfig(stage=3, precision="bf16", **ZEROPP_SWITCHES, weight_bits=4, weight_quantization="delta")
    units, layout, shard = [(2**16, False)], Layout(4, 2), 2**14
    later = [t for t in step_transfers(units, layout, zero, 2) if t.op == "all_gather" and t.phase == "forward"]
    first = [
        t for t in step_transfers(units, layout, zero, 2, first=True) if t.op == "all_gather" and t.phase == "forward"
    ]
    reference, changes = 2 * 2**16 // 2, 3 * (shard // 2 + 4 * shard // 256)
    assert [(t.sent, t.crosses(1, layout)) for t in later] == [
        (reference, False),
        (3 * shard // 2, True),
        (3 * 4 * shard // 256, True),
    ]
    assert sum(t.sent for t in later) == reference + changes
    assert [(t.sent, t.crosses(1, layout)) for t in first] == [(3 * 2 * shard, True)]
    assert estimate(2**16, 4, 2, zero).ledger(rank=1).total(op="all_gather", phase="forward", link="inter") == changes


def test_time_model_is_the_busiest_link_of_each_kind_without_overlap():
    est = estimate(2**20, 8, 2, ZeroConfig(stage=3))
    ring = ring_bytes(4 * 2**20, 8)
    edge, inner = est.ledger(rank=3), est.ledger(rank=0)  # local rank 3 of 4 sends every ring off the node
    assert edge.total(link="intra") == 0 and inner.total(link="inter") == 0
    scalars = ring_bytes(4, 8, 2) + ring_bytes(1, 8, 2)  # the norm, and the one parameter's gradient flag
    assert est.node_inter_bytes() == edge.total(link="inter") == 3 * ring + scalars
    assert est.busiest_intra_bytes() == inner.total(link="intra")
    seconds = est.seconds(intra_bits_per_s=8e9, inter_bits_per_s=8e6)
    assert seconds["intra"] == pytest.approx(est.busiest_intra_bytes() / 1e9)
    assert seconds["inter"] == pytest.approx(est.node_inter_bytes() / 1e6)
    assert seconds["total"] == seconds["intra"] + seconds["inter"]


def test_parse_bandwidth():
    assert parse_bandwidth("200mbit") == 200e6
    assert parse_bandwidth("100Gbit") == 100e9
    assert parse_bandwidth("1.5kbit/s") == 1500
    assert parse_bandwidth("25GB") == 200e9  # bytes per second
    assert parse_bandwidth("3MB") == 24e6
    for bad in ("200", "fast", "0mbit", "200mbps", "-1gbit"):
        with pytest.raises(Exception, match="is not allowed"):
            parse_bandwidth(bad)


# -- against the engine's ledger on 4 real ranks -------------------------------------------------------

MEASURED_SCENARIOS = {
    "stage0-fp16": dict(stage=0, precision="fp16", loss_scale=LossScaleConfig(initial_scale=256.0)),
    "stage1-bf16-accumulate": dict(stage=1, precision="bf16", gradient_accumulation_steps=2),
    "stage2-fp16": dict(stage=2, precision="fp16", loss_scale=LossScaleConfig(initial_scale=256.0)),
    "zero3-bf16": dict(stage=3, precision="bf16"),
    "zeropp-bf16": dict(stage=3, precision="bf16", **ZEROPP_SWITCHES),
    "zeropp-bf16-two-level-hadamard-loco": dict(
        stage=3, precision="bf16", **ZEROPP_SWITCHES, gradient_intra_node_bits=8, gradient_hadamard=True,
        gradient_error_feedback="loco",
    ),
    "zeropp-bf16-unquantized-intra-node-loco": dict(
        stage=3, precision="bf16", **ZEROPP_SWITCHES, gradient_intra_node_bits=0, gradient_error_feedback="loco",
    ),
    "zeropp-fp32-accumulate-resident-root": dict(
        stage=3, gradient_accumulation_steps=2, persistence_threshold=10_000, quantized_weights=True, weight_bits=4,
        weight_quantization="tensor", hpz_partition_size=2, quantized_gradients=True, gradient_bits=8,
        qgz_pipeline_chunks=3, qgz_pipeline_min_chunk=1, reduce_bucket_numel=1000,
    ),
}  # fmt: skip
MEASURED_NODES = (2, 1, 4)
STEPS = 2


def ledger_worker() -> dict:
    from zeropp import ZeroEngine
    from zeropp.app.models.gpt import GPT, GPTConfig
    from zeropp.topology import build_topology, init_topology

    first = init_topology()
    out = {}
    for nodes in MEASURED_NODES:  # one process group, three node layouts
        topo = build_topology(Layout(4, nodes), first.rank, first.device)
        for name, zero in MEASURED_SCENARIOS.items():
            torch.manual_seed(0)
            model = GPT(GPTConfig(block_size=16, n_layer=2, n_head=2, d_model=32))
            # the steps' traffic alone: the sequence check's all-gather is tests/comm/test_sequence.py's
            config = ZeroConfig(**zero, sequence_check_interval=0)
            engine = ZeroEngine(model, torch.optim.AdamW, dict(lr=1e-3), config, topo)
            engine.comm.ledger.reset()
            for step in range(STEPS):
                for micro in range(engine.config.gradient_accumulation_steps):
                    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(10 * step + micro))
                    engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
                assert engine.step(), "a skipped step sends no updated weights"
            out[nodes, name] = dict(
                ledger=engine.comm.ledger.as_dict(),
                steps=engine.comm.ledger.steps,
                memory=engine.measured_model_state_bytes,
                units=[(u.layout.numel, u.layout.padded_numel, u.resident) for u in engine.units],
                params=[list(u.layout.numels) for u in engine.units],
            )
    return out


def test_estimate_equals_the_measured_ledger_and_memory_of_every_rank():
    per_rank = run_ranks(ledger_worker, 4, nodes=2)
    for (nodes, name), first in per_rank[0].items():
        est = estimate(first["params"], 4, nodes, ZeroConfig(**MEASURED_SCENARIOS[name]))
        assert [(u.numel, u.padded, u.resident) for u in est.units] == first["units"], name
        measured = []
        for rank, results in enumerate(per_rank):
            got = results[nodes, name]
            assert got["steps"] == STEPS
            per_step = {
                op: {phase: {link: b / STEPS for link, b in links.items()} for phase, links in phases.items()}
                for op, phases in got["ledger"].items()
            }
            assert per_step == est.ledger(rank).as_dict(), f"{nodes} node(s), {name}, rank {rank}"
            assert got["memory"] == est.model_state_bytes, f"{nodes} node(s), {name}, rank {rank}"
            measured.append(per_step)
        mean = est.ledger()
        for phase in ("forward", "backward", "step"):
            for link in ("intra", "inter"):
                got = sum(sum(p.get(phase, {}).get(link, 0) for p in m.values()) for m in measured) / 4
                assert got == mean.total(phase=phase, link=link), (nodes, name, phase, link)


# -- command line ----------------------------------------------------------------------------------------


def test_cli_examples(capsys, tmp_path):
    assert main(["--params", "7.5e9", "--world", "64", "--stage", "3"]) == 0
    assert "model states per rank" in capsys.readouterr().out
    out = tmp_path / "estimate.json"
    argv = [
        "--preset", "small", "--world", "4", "--nodes", "2", "--stage", "3", "--quantized-weights",
        "--hpz-partition-size", "0", "--quantized-gradients", "--precision", "bf16",
        "--inter-node-bandwidth", "200mbit", "--json", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "qwZ int8, hpZ (groups of 2), qgZ int4" in text and "vs ZeRO-3" in text
    result = json.loads(out.read_text())
    est = estimate(
        gpt_unit_numels(ModelConfig(preset="small")), 4, 2, ZeroConfig(stage=3, precision="bf16", **ZEROPP_SWITCHES)
    )
    assert result["model_state_bytes_per_rank"] == est.model_state_bytes
    assert result["inter_node_bytes_per_step"] == est.ledger().total(link="inter")
    assert result["ledger"]["all_gather"]["backward"]["inter"] == 0
    seconds = result["predicted_comm_seconds_per_step"]
    assert seconds["inter"] == pytest.approx(8 * est.node_inter_bytes() / 200e6)
    assert result["bandwidth_bits_per_s"] == {"intra": 100e9, "inter": 200e6}


def test_cli_tensor_parallel_and_zero_r(capsys, tmp_path):
    out = tmp_path / "trillion.json"
    mesh = ["--world", "1024", "--nodes", "64", "--tensor-parallel", "16", "--stage", "3", "--precision", "fp16"]
    assert main(["--params", "1e12", *mesh, "--json", str(out)]) == 0
    assert "64 data-parallel x 16 tensor-parallel" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["model_state_bytes_per_rank"] == trillion_example()["bytes_per_gpu"]["Pos+g+p"]
    assert (result["tensor_parallel_size"], result["data_parallel_size"]) == (16, 64)
    assert result["tensor_parallel_bytes_per_step"] is None and result["activations"] is None  # no shape given
    # SC20 §6.1's 100B model (Table 4), batch 32, sequence 1024, MP 16: Pa's checkpoints and all-gathers
    shape = ["--n-layer", "125", "--d-model", "8192", "--block-size", "1024", "--micro-batch-size", "32"]
    zero_r = ["--activation-checkpointing", "--partition-activations"]
    assert main(["--params", str(12 * 8192**2 * 125), *mesh, *shape, *zero_r, "--json", str(out)]) == 0
    assert "Pa's all-gathers" in capsys.readouterr().out
    result, example = json.loads(out.read_text()), pa_example()
    assert result["activation_checkpoint_bytes_per_rank"] == example["checkpoint_bytes"]["Pa"]
    # the command prices zeropp's runtime (5 all-reduces per block), the example the paper's layout (6)
    assert result["tensor_parallel_bytes_per_step"] * 6 == example["tensor_parallel_bytes_per_step"] * 5
    assert result["partitioned_activation_bytes_per_step"] == example["pa_bytes_per_step"]
    assert result["partitioned_activation_bytes_per_step"] * 10 == result["tensor_parallel_bytes_per_step"]
    assert (
        main(["--preset", "small", "--world", "8", "--nodes", "2", "--tensor-parallel", "2", "--json", str(out)]) == 0
    )
    result = json.loads(out.read_text())
    assert result["unit_numels"] == [sum(unit) for unit in gpt_unit_numels(ModelConfig(preset="small"), 2)]
    assert result["ledger"]["tp.all_reduce"]["forward"]["inter"] == 0 and result["tensor_parallel_bytes_per_step"] > 0
    small = [
        "--preset",
        "small",
        "--world",
        "8",
        "--nodes",
        "2",
        "--tensor-parallel",
        "2",
        "--activation-checkpointing",
    ]
    assert main([*small, "--sequence-parallel", "--json", str(out)]) == 0
    result, gpt = json.loads(out.read_text()), PRESETS["small"]
    assert result["activations"]["sequence_parallel"] and "tp.reduce_scatter" in result["ledger"]
    assert result["activation_checkpoint_bytes_per_rank"] == gpt.n_layer * 4 * gpt.block_size * gpt.d_model * 4 // 2


def test_cli_tables(capsys, tmp_path):
    out = tmp_path / "tables.json"
    assert main(["--zero-table", "--zeropp-table", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "ZeRO Table 1" in text and "4187" in text and "0.12" in text
    assert "ZeRO++ Table 1" in text and "113.8x" in text
    result = json.loads(out.read_text())
    assert result["hpz_example"]["hpz_over_zero3"] == 9.0
    assert math.isclose(result["zeropp_table_1"]["ratios"][0], 0.5 * (1 + SCALES_INT8), rel_tol=1e-6)
    assert main(["--zeropp-table", "--world", "16", "--ranks-per-node", "4"]) == 0
    assert "4 nodes x 4 ranks" in capsys.readouterr().out
    assert main(["--zero-table", "--tensor-parallel", "16", "--zero-r-example", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "model parallelism 16" in text and "ZeRO Table 2" in text and "fits 32 GB" in text and "0.0833" in text
    result = json.loads(out.read_text())
    assert (
        result["zero_table_1_mp"] == 16 and result["zero_table_1_gb"]["1T"]["Pos+g+p"]["64"] == 1e12 * 16 / 1024 / 1e9
    )
    assert result["zero_r_pa_example"] == pa_example()


@pytest.mark.parametrize(
    "argv,names",
    [
        (["--world", "4", "--stage", "5"], "--stage = 5"),
        (["--world", "4", "--precision", "fp8"], "--precision"),
        (["--world", "4", "--nodes", "3"], "--nodes = 3"),
        (["--world", "0"], "--world"),
        (["--params", "abc", "--world", "4"], "--params"),
        (["--params", "1.5", "--world", "4"], "--params"),
        (["--world", "4", "--inter-node-bandwidth", "200mbps"], "--inter-node-bandwidth"),
        (["--world", "4", "--stage", "2", "--quantized-weights"], "--quantized-weights = True"),
        (["--world", "8", "--nodes", "2", "--hpz-partition-size", "3"], "--hpz-partition-size = 3"),
        (["--world", "8", "--ranks-per-node", "3"], "--ranks-per-node"),
        (["--stage", "3"], "--world"),
        (["--zeropp-table", "--world", "8"], "--nodes"),
        (["--world", "4", "--config", "missing.toml"], "--config"),
        (["--world", "4", "--optimizer-state-bytes", "-1"], "--optimizer-state-bytes"),
        (["--world", "8", "--nodes", "2", "--tensor-parallel", "3"], "--tensor-parallel-size = 3"),
        (["--world", "8", "--tensor-parallel", "8"], "--tensor-parallel-size = 8 is not allowed with --n-head = 4"),
        (
            ["--world", "4", "--sequence-parallel"],
            "--sequence-parallel = True is not allowed; expected false unless --tensor-parallel-size > 1",
        ),
        (
            ["--world", "4", "--partition-activations"],
            "--partition-activations = True is not allowed; expected false unless --activation-checkpointing",
        ),
        (["--world", "4", "--activation-checkpointing", "--cpu-checkpointing"], "--cpu-checkpointing = True"),
        (["--params", "1e9", "--world", "4", "--activation-checkpointing"], "--n-layer, --d-model, --block-size"),
        (["--params", "1e9", "--world", "4", "--n-layer", "2"], "--d-model, --block-size"),
        (["--world", "4", "--frozen-fraction", "1"], "--frozen-fraction: '1' is not allowed"),
        (["--world", "4", "--nontrainable-weight-bits", "4"], "--nontrainable-weight-bits = 4 is not allowed"),
    ],
)
def test_cli_bad_input_is_one_line_naming_the_flag(capsys, argv, names):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("zeropp estimate: error: ") and names in err, err
    assert "allowed" in err or "expected" in err or "required" in err or "choose from" in err, err


def test_the_estimate_of_the_disk_tiers_and_bf16_states(tmp_path):
    """One flat unit of Ψ = 8 x 10^6 on 4 ranks, bf16, Adam with bf16 moments: 12Ψ/N in all; with both disk
    tiers all 12Ψ/N go to disk (the gradients with the optimizer's states), the host holds the three rings."""
    psi, n = 8_000_000, 4
    bf16 = dict(stage=3, precision="bf16", optimizer_state_dtype="bf16", persistence_threshold=0)
    plain = estimate(psi, n, zero=ZeroConfig(**bf16))
    assert plain.model_state_bytes == 12 * psi / n and plain.disk_tiers() is None
    disk = dict(offload_optimizer="nvme", offload_params="nvme", offload_path=str(tmp_path), offload_buffer_count=3)
    est = estimate(psi, n, zero=ZeroConfig(**bf16, **disk, gradient_accumulation_steps=2))
    tiers = {w: est.model_state_bytes_on(w) for w in ("device", "host", "disk")}
    assert tiers == {"device": 0, "host": 0, "disk": 12 * psi / n}
    shard = psi // n
    assert est.disk_tiers() == {
        # (3 + 1) units of master + moments; of gradients; (max(3, 1) + 1) compute shards
        "host_ring_bytes": 4 * 8 * shard + 4 * 2 * shard + 4 * 2 * shard,
        # the optimizer's states; the gradient read back at micro-batch 2 and at the step; 2 gathers x 2 micro-batches
        "read_bytes_per_step": 8 * shard + 2 * 2 * shard + 2 * 2 * 2 * shard,
        "written_bytes_per_step": 8 * shard + 2 * 2 * shard + 2 * shard,  # states; a gradient per micro-batch; weights
    }


def test_the_whole_parameter_path_prices_its_exchanges_and_whole_masters():
    """Two fp32 exchanges of a rank's pieces of the other ranks' parameters (2 x 4Ψ/N x (N-1)/N), the
    share to other nodes crossing; the owned parameters' whole masters and gradients (8Ψ/N) beside the model states."""
    psi, n = 8_000_000, 4
    zero = ZeroConfig(stage=3, persistence_threshold=0)
    flat, whole = estimate(psi, n, 2, zero), estimate(psi, n, 2, zero, whole_parameters=True)
    exchange = 2 * 4 * psi / n * (n - 1) / n
    added = {link: whole.ledger().total(link=link) - flat.ledger().total(link=link) for link in ("intra", "inter")}
    assert added["intra"] + added["inter"] == pytest.approx(exchange, abs=4)
    assert added["inter"] == pytest.approx(exchange * 2 / 3, abs=4)  # 2 ranks a node: 2 of the 3 others elsewhere
    assert (
        whole.ledger().bytes[("to_owners", "step", "inter")] == whole.ledger().bytes[("from_owners", "step", "inter")]
    )
    assert whole.model_state_bytes - flat.model_state_bytes == 8 * psi / n
    with pytest.raises(ConfigError, match=r"^optimizer --optimizer-path whole .*tensor_parallel_size = 2"):
        estimate(psi, n, 1, zero, tensor_parallel=2, whole_parameters=True)
