"""qWD (``weight_quantization = "delta"``) on real gloo ranks, 2 nodes x 2: the ledger is the traffic
model step by step (the first step and the one after a load send the full weights), cross-node bytes
against ZeRO-3, the error of what is gathered stays within half a step of the change's block over
1,000 steps (no drift), every rank gathers the same bits, and the weights track the exact run."""

from __future__ import annotations

import pytest
import torch
from launcher import run_ranks
from models import global_batch, loss_of, make_model, reference_state, rows

QWD = dict(quantized_weights=True, weight_quantization="delta", hpz_partition_size=0)
BEST_QGZ = dict(
    quantized_gradients=True, gradient_error_feedback="loco", gradient_intra_node_bits=8, gradient_hadamard=True
)


def _priced(transfers, rank: int, layout) -> dict:
    """`transfers` as the ledger of global `rank` records them."""
    from zeropp.comm.ledger import Ledger

    ledger = Ledger(steps=1)
    for t in transfers:
        with ledger.in_phase(t.phase):
            ledger.record(t.op, *((0, t.sent) if t.crosses(rank, layout) else (t.sent, 0)))
    return ledger.as_dict()


# -- the ledger is the traffic model; cross-node bytes against ZeRO-3 ----------------------------------


def ledger_worker() -> dict:
    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.app.models.gpt import GPT, GPTConfig
    from zeropp.config.sections import TopologyConfig
    from zeropp.costs.volume import step_transfers
    from zeropp.topology import init_topology

    topo = init_topology(TopologyConfig(nodes=2))
    out = {}
    for name, extra in (("zero3", {}), ("qwd4", dict(QWD, weight_bits=4, **BEST_QGZ))):
        torch.manual_seed(0)
        model = GPT(GPTConfig(block_size=32, n_layer=2, n_head=2, d_model=64))
        config = ZeroConfig(stage=3, precision="bf16", sequence_check_interval=0, **extra)
        engine = ZeroEngine(model, torch.optim.AdamW, dict(lr=1e-3), config, topo)
        units = [(u.layout.padded_numel, u.resident) for u in engine.units]
        priced = {
            first: _priced(step_transfers(units, topo.layout, config, engine.hpz_group_size, first=first, parameters=sum(len(u.params) for u in engine.units)), topo.rank, topo.layout)
            for first in (True, False)
        }  # fmt: skip
        steps = []
        for step in range(4):
            if step == 3:  # weights set outside the step: the next gathers send them in full
                engine.load_sharded_state_dict(engine.sharded_state_dict())
            engine.comm.ledger.reset()
            x, y = rows(global_batch("gpt", step, 0, topo.world_size), topo.rank)
            engine.backward(engine(x % 256, y % 256))
            assert engine.step()
            steps.append(engine.comm.ledger.as_dict())
        out[name] = dict(steps=steps, priced=priced, inter=[_inter(s) for s in steps])
    return out


def _inter(ledger: dict) -> float:
    return sum(links.get("inter", 0) for phases in ledger.values() for links in phases.values())


def test_qwd_ledger_is_the_traffic_model_and_sends_at_most_0_17_of_zero3s_cross_node_bytes():
    per_rank = run_ranks(ledger_worker, 4, nodes=2)
    for rank, results in enumerate(per_rank):
        for name, got in results.items():
            full, deltas = got["priced"][True], got["priced"][False]
            # step 0 (after construction) and step 3 (after a load) gather the full weights; 1 and 2 the changes
            for step, expected in enumerate((full, deltas, deltas, full)):
                assert got["steps"][step] == expected, (rank, name, step)
        assert results["qwd4"]["priced"][True] != results["qwd4"]["priced"][False]
    zero3 = sum(r["zero3"]["inter"][1] for r in per_rank)
    qwd = sum(r["qwd4"]["inter"][1] for r in per_rank)
    print(f"cross-node bytes per step, int4 qWD + hpZ + qgZ / ZeRO-3 (bf16, 2 nodes x 2): {qwd / zero3:.4f}")
    assert 0 < qwd / zero3 <= 0.17


# -- no drift over 1,000 steps; identical gathers -------------------------------------------------------

DRIFT_STEPS, SAMPLE_EVERY = 1000, 100


def drift_worker(bits: int) -> dict:
    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.app.models.gpt import GPT, GPTConfig
    from zeropp.config.sections import TopologyConfig
    from zeropp.quant.spec import QuantSpec
    from zeropp.topology import init_topology

    topo = init_topology(TopologyConfig(nodes=2))
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, n_layer=2, n_head=2, d_model=16))
    config = ZeroConfig(stage=3, weight_bits=bits, weight_block_size=64, sequence_check_interval=0, **QWD)
    engine = ZeroEngine(model, torch.optim.AdamW, dict(lr=3e-3, weight_decay=0.0), config, topo)
    spec, kernels = QuantSpec(bits, 64), engine.units[0].options.kernels
    sharded = [u for u in engine.units if u.reference is not None]
    samples = []
    for step in range(DRIFT_STEPS + 1):
        if step and step % SAMPLE_EVERY == 0:  # gather as the next forward would, against the masters
            ratio, error, gathered = 0.0, 0.0, []
            for unit in sharded:
                master = unit.master.data  # fp32: the compute shard itself
                assert unit.reference.usable and unit.reference.version == unit.version - 1
                scales = kernels.quantize((master - unit.reference.shard).view(1, -1), spec).scales.view(-1)
                unit.unshard()
                miss = (unit.shard_of(unit.compute_flat) - master).abs()
                gathered.append(unit.compute_flat.clone())
                unit.reshard()
                blocks = torch.nn.functional.pad(miss, (0, -miss.numel() % 64)).view(-1, 64).amax(1)
                assert bool((blocks[scales == 0] == 0).all())
                bound = 0.5 * scales + 2 * torch.finfo(torch.float32).eps * master.abs().max()
                assert bool((blocks <= bound).all()), (step, (blocks - bound).max().item())
                ratio = max(ratio, (blocks[scales > 0] / scales[scales > 0]).max().item())
                error = max(error, miss.max().item())
            samples.append(dict(step=step, ratio=ratio, error=error, gathered=gathered))
        if step == DRIFT_STEPS:
            break
        x, y = rows(global_batch("gpt", step, 0, topo.world_size), topo.rank)
        engine.backward(engine(x % 256, y % 256))
        assert engine.step()
    return dict(samples=samples)


def test_qwd_gathers_within_half_a_step_of_the_change_for_1000_steps_and_identically_on_every_rank():
    per_rank = run_ranks(drift_worker, 4, nodes=2, bits=4)
    for rank, result in enumerate(per_rank):
        series = [(s["step"], round(s["ratio"], 4), f"{s['error']:.2e}") for s in result["samples"]]
        print(f"rank {rank} int4 qWD, (step, max |gathered - master| / block scale, max |gathered - master|): {series}")
        assert [s["step"] for s in result["samples"]] == list(range(SAMPLE_EVERY, DRIFT_STEPS + 1, SAMPLE_EVERY))
        # half a step of the change's block, plus the fp32 rounding of reference + change (asserted per block
        # in the worker: <= 0.5 scale + 2 eps max|w|); an error carried from step to step would grow instead
        assert all(0.4 < s["ratio"] <= 0.51 for s in result["samples"]), series
        errors = [s["error"] for s in result["samples"]]
        assert max(errors[5:]) <= 2 * max(errors[:5]), series
        for mine, first in zip(result["samples"], per_rank[0]["samples"], strict=True):
            assert all(torch.equal(a, b) for a, b in zip(mine["gathered"], first["gathered"], strict=True)), mine[
                "step"
            ]


# -- close to the exact run; accumulation, prefetch, evaluation -------------------------------------------

STEPS, SGD = 4, dict(lr=0.5)
SCENARIOS = {
    "qwd-int8": dict(QWD),
    "qwd-int4": dict(QWD, weight_bits=4),
    "qwd-int8-accum2-prefetch2-eval": dict(QWD, gradient_accumulation_steps=2, prefetch=2),
    "qwd-int8-offloaded-params": dict(QWD, offload_optimizer="cpu", offload_params="cpu"),
}
# largest |w - w_ref| as a fraction of the largest |w_ref - w_start| after 4 SGD steps, test_zeropp's measure
# (measured: int8 0.0009 (offloaded too), int4 0.013, accumulation 0.0004; qwZ int8 on the raw weights: 0.007-0.014)
TOLERANCE = {
    "qwd-int8": 0.003,
    "qwd-int4": 0.04,
    "qwd-int8-accum2-prefetch2-eval": 0.003,
    "qwd-int8-offloaded-params": 0.003,
}


def training_worker() -> dict:
    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.config.sections import TopologyConfig
    from zeropp.costs.volume import unit_transfers
    from zeropp.topology import init_topology

    topo = init_topology(TopologyConfig(nodes=2))
    world, rank = topo.world_size, topo.rank
    start = {k: v.float().clone() for k, v in make_model("gpt").state_dict().items()}
    out = {}
    for name, extra in SCENARIOS.items():
        micro = extra.get("gradient_accumulation_steps", 1)
        ref = reference_state("gpt", STEPS, world, micro, None, SGD, torch.optim.SGD)
        moved = max((ref[k] - start[k]).abs().max().item() for k in ref)
        config = ZeroConfig(stage=3, sequence_check_interval=0, **extra)
        engine = ZeroEngine(make_model("gpt"), torch.optim.SGD, SGD, config, topo)
        units = [(u.layout.padded_numel, u.resident) for u in engine.units]
        gathers = []
        for step in range(STEPS):
            engine.comm.ledger.reset()
            for m in range(micro):
                engine.backward(loss_of("gpt", engine, *rows(global_batch("gpt", step, m, world), rank)))
            gathers.append(engine.comm.ledger.total(op="all_gather", phase="forward"))
            engine.step()
            if "eval" in name:
                with torch.no_grad():
                    loss_of("gpt", engine, *rows(global_batch("gpt", 99, 0, world), rank))
        priced = [
            sum(
                t.sent
                for t in unit_transfers(units, topo.layout, config, engine.hpz_group_size, first=first)
                if t.phase == "forward"
            )
            for first in (True, False)
        ]
        ours = engine.full_state_dict()
        out[name] = dict(
            error=max((ours[k] - ref[k]).abs().max().item() for k in ref) / moved, gathers=gathers, priced=priced
        )
    return out


def test_qwd_trains_close_to_the_exact_weights_with_accumulation_prefetch_and_evaluation():
    for rank, results in enumerate(run_ranks(training_worker, 4, nodes=2)):
        for name, got in results.items():
            assert 0 < got["error"] <= TOLERANCE[name], f"rank {rank} {name}: {got['error']:.3g} of the update"
            # later micro-batches and evaluation gather from hpZ's copy: one delta gather per unit and step
            if "eval" not in name:
                assert got["gathers"] == [got["priced"][0]] + [got["priced"][1]] * (STEPS - 1), (rank, name, got)


# -- a checkpoint holds no reference: the first step after a resume gathers the full weights ----------------


def resume_worker(root: str) -> dict:
    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.checkpoint import load_checkpoint, save_checkpoint
    from zeropp.config.sections import TopologyConfig
    from zeropp.costs.volume import step_transfers
    from zeropp.topology import init_topology

    topo = init_topology(TopologyConfig(nodes=2))
    world, rank = topo.world_size, topo.rank
    config = ZeroConfig(stage=3, weight_bits=4, sequence_check_interval=0, **QWD)

    def train(engine, steps) -> list[dict]:
        ledgers = []
        for step in steps:
            engine.comm.ledger.reset()
            engine.backward(loss_of("gpt", engine, *rows(global_batch("gpt", step, 0, world), rank)))
            assert engine.step()
            ledgers.append(engine.comm.ledger.as_dict())
        return ledgers

    straight = ZeroEngine(make_model("gpt"), torch.optim.SGD, SGD, config, topo)
    train(straight, range(2))
    path = save_checkpoint(straight, root, 2)
    saved = straight.full_state_dict()
    train(straight, range(2, 4))
    resumed = ZeroEngine(make_model("gpt"), torch.optim.SGD, SGD, config, topo)
    load_checkpoint(resumed, path)
    ledgers = train(resumed, range(2, 4))
    units = [(u.layout.padded_numel, u.resident) for u in resumed.units]
    priced = [
        _priced(
            step_transfers(
                units,
                topo.layout,
                config,
                resumed.hpz_group_size,
                first=first,
                parameters=sum(len(u.params) for u in resumed.units),
            ),
            rank,
            topo.layout,
        )
        for first in (True, False)
    ]
    ours, ref = resumed.full_state_dict(), straight.full_state_dict()
    moved = max((ref[k] - saved[k]).abs().max().item() for k in ref)
    return dict(ledgers=ledgers, priced=priced, error=max((ours[k] - ref[k]).abs().max().item() for k in ref) / moved)


def test_a_resumed_qwd_run_gathers_the_full_weights_first_and_stays_close(tmp_path):
    for rank, got in enumerate(run_ranks(resume_worker, 4, nodes=2, root=str(tmp_path))):
        assert got["ledgers"] == got["priced"], rank  # full weights, then the changes
        # one step computed with the exact weights instead of the reconstruction: close, not bit-identical
        assert got["error"] <= 0.05, (rank, got["error"])


def refusal_worker() -> str:
    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.errors import ConfigError
    from zeropp.topology import init_topology

    with pytest.raises(ConfigError) as info:
        ZeroEngine(make_model("gpt"), torch.optim.SGD, SGD, ZeroConfig(stage=3, **QWD), init_topology())
    return str(info.value)


def test_qwd_without_hpz_on_the_topology_is_refused_in_one_line():
    for message in run_ranks(refusal_worker, 2):  # one node: hpZ is off
        assert message.startswith("zero.weight_quantization = 'delta' needs hpZ") and "\n" not in message, message
