"""ZeRO++ on real gloo ranks: qgZ equals a reduce-scatter-mean within its error bound, qwZ gathers
what was quantized, hpZ trains exactly like ZeRO-3, and the ledger shows the paper's Table 1.

Error bound of one qgZ output element of slice z (derivation; qmax = 127 or 7, W = X*Y ranks):
hop 1 quantizes each rank's input, an error of at most a_i / (2 qmax) per element, where a_i is
the absmax of rank i's block, at most A_i = max |g_i[z, :]|; the node's fp32 sum of X dequantized
inputs is at most sum_i A_i (1 + 1/(2 qmax)) in magnitude and is quantized once more (hop 2) with
half a step of error. Dividing by W:

    |qgZ - mean| <= sum_i A_i * (2 + 1/(2 qmax)) / (2 qmax W)     (+ rounding to the output dtype)
"""

from __future__ import annotations

import pytest
import torch
from launcher import run_ranks
from models import global_batch, loss_of, make_model, reference_state, rows

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _rank_input(rank: int, world: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank `rank`'s flat gradient: W slices of `width`, magnitudes varying by slice and rank."""
    g = torch.Generator().manual_seed(7 * rank + width)
    slice_scale = torch.logspace(-2, 1, world)[torch.randperm(world, generator=g)]
    values = torch.randn(world, width, generator=g) * slice_scale[:, None]
    return values.reshape(-1).to(dtype)


def qgz_and_qwz_worker(simulated_nodes: int) -> dict:
    from zeropp.comm.communicator import Communicator
    from zeropp.comm.quantized import all_gather_quantized, reduce_scatter_quantized
    from zeropp.config.sections import TopologyConfig
    from zeropp.quant.backends import kernels_for
    from zeropp.quant.spec import QuantSpec
    from zeropp.topology import init_topology

    topo = init_topology(TopologyConfig(nodes=simulated_nodes))
    comm, kernels = Communicator(topo), kernels_for(topo.device, "torch")
    world, rank, groups = topo.world_size, topo.rank, topo.shard_groups()
    failures, worst, ledger_checks = [], {}, 0
    # widths: not multiples of 2 * world, shorter than a block, longer than a bucket
    for width in (1, 37, 301):
        for name, dtype in DTYPES.items():
            inputs = [_rank_input(r, world, width, dtype) for r in range(world)]
            exact = torch.stack([t.float() for t in inputs]).mean(0).view(world, width)[rank]
            slice_absmax = torch.stack([t.float().view(world, width)[rank].abs().max() for t in inputs]).sum()
            for bits in (4, 8):
                spec = QuantSpec(bits, 16)
                for stages in (1, 3):
                    comm.ledger.reset()
                    out = torch.full((width,), float("nan"), dtype=dtype)
                    reduce_scatter_quantized(
                        comm, out, inputs[rank].clone(), spec, kernels, groups,
                        chunks=stages, bucket_numel=128, intra_spec=spec,
                    ).wait()  # fmt: skip
                    bound = slice_absmax * (2 + 1 / (2 * spec.qmax)) / (2 * spec.qmax * world)
                    bound = bound + exact.abs() * torch.finfo(dtype).eps + torch.finfo(dtype).tiny
                    error = (out.float() - exact).abs()
                    key = f"w{width}-{name}-int{bits}-stages{stages}"
                    if not (error <= bound).all():
                        failures.append(f"{key}: error {error.max():.3g} above bound {bound.min():.3g}")
                    worst[key] = float((error / bound).max())
                    ledger_checks += _check_qgz_ledger(comm, topo, spec, width, stages, 128, failures, key)
    # a non-finite gradient survives quantization (fp16 overflow must reach the loss scaler)
    poisoned = _rank_input(rank, world, 37, torch.float16)
    if rank == 0:
        poisoned[37 * (world - 1) + 5] = float("inf")  # slice owned by the last rank
    out = torch.zeros(37, dtype=torch.float16)
    spec = QuantSpec(4, 16)
    reduce_scatter_quantized(
        comm, out, poisoned, spec, kernels, groups, chunks=2, bucket_numel=128, intra_spec=spec
    ).wait()
    overflow_seen = not bool(torch.isfinite(out).all())
    # qwZ: every rank receives exactly the dequantized quantization of every shard
    qwz_errors = {}
    for name, dtype in DTYPES.items():
        for spec in (QuantSpec(8, 32), QuantSpec(4, 32), QuantSpec(8, None)):
            shards = [_rank_input(r, 1, 45, dtype) for r in range(world)]
            full = torch.empty(world * 45, dtype=dtype)
            all_gather_quantized(comm, full, shards[rank], spec, topo.world, kernels, bucket_numel=1 << 20)
            expected = torch.cat([kernels.dequantize(kernels.quantize(s.view(1, -1), spec), dtype)[0] for s in shards])
            if not torch.equal(full, expected):
                failures.append(f"qwZ {name} {spec}: gathered weights differ from dequantize(quantize(shard))")
            qwz_errors[f"{name}-{spec.bits}-{spec.block_size}"] = float(
                (full.float() - torch.cat(shards).float()).abs().max()
            )
    return dict(
        failures=failures, worst=worst, overflow_seen=overflow_seen, ledger_checks=ledger_checks, qwz=qwz_errors
    )


def _check_qgz_ledger(comm, topo, spec, width, stages, bucket, failures, key, intra_spec=None, plain_itemsize=0) -> int:
    """Bytes this rank sent, by the all-to-all model: (X-1)/X of hop 1 inside the node (`intra_spec`,
    default `spec`; unquantized rows of `plain_itemsize` bytes per value where given), (Y-1)/Y of hop 2
    across (`spec`)."""
    from zeropp.index.flat import column_chunks

    x, y, world = topo.ranks_per_node, topo.nodes, topo.world_size
    intra_spec = intra_spec or spec
    intra = inter = 0
    for start, stop in column_chunks(width, -(-width // bucket) * stages):
        c = stop - start
        row = plain_itemsize * c or intra_spec.row_bytes(c) + 4 * intra_spec.blocks(c)
        intra += world * row * (x - 1) // x
        inter += y * (spec.row_bytes(c) + 4 * spec.blocks(c)) * (y - 1) // y
    got = (comm.ledger.total(op="all_to_all", link="intra"), comm.ledger.total(op="all_to_all", link="inter"))
    if got != (intra, inter):
        failures.append(f"{key}: ledger all_to_all (intra, inter) = {got}, expected {(intra, inter)}")
    return 1


@pytest.mark.parametrize("world,nodes", [(4, 2), (4, 1), (6, 3)], ids=["2nodes-x2", "1node-x4", "3nodes-x2"])
def test_qgz_matches_exact_reduce_scatter_mean_and_qwz_gathers_quantized_shards(world, nodes):
    per_rank = run_ranks(qgz_and_qwz_worker, world, nodes=nodes, simulated_nodes=nodes)
    for rank, result in enumerate(per_rank):
        assert not result["failures"], f"rank {rank}: {result['failures']}"
        assert result["ledger_checks"] == 3 * 3 * 2 * 2
        # int4 really quantized: errors are a visible fraction of the bound, not zero
        assert max(v for k, v in result["worst"].items() if "int4" in k and "w301" in k) > 0.01
        assert result["overflow_seen"] == (rank == world - 1)
        assert result["qwz"]["fp32-8-32"] > 0


# -- two-level qgZ, Hadamard rotation, error feedback ----------------------------------------------


def two_level_qgz_worker(simulated_nodes: int) -> dict:
    """int8 inside the node, int4 across: within the two-hop bound (below), cross-node bytes those of
    int4 qgZ; with the Hadamard rotation about as accurate; error feedback's first call equals the
    plain one and the mean of repeated calls converges on the exact mean.

    Bound (qmax_1 = 127 on hop 1, qmax_2 = 7 on hop 2; A_i = max |g_i[z, :]|):
        |qgZ - mean| <= sum_i A_i * (1 / qmax_1 + (1 + 1 / (2 qmax_1)) / qmax_2) / (2 W)
    """
    from zeropp.comm.communicator import Communicator
    from zeropp.comm.feedback import ErrorFeedback
    from zeropp.comm.quantized import reduce_scatter_quantized
    from zeropp.config.sections import TopologyConfig
    from zeropp.quant.backends import kernels_for
    from zeropp.quant.spec import QuantSpec
    from zeropp.topology import init_topology

    topo = init_topology(TopologyConfig(nodes=simulated_nodes))
    comm, kernels = Communicator(topo), kernels_for(topo.device, "torch")
    world, rank, groups = topo.world_size, topo.rank, topo.shard_groups()
    inter_spec, intra_spec = QuantSpec(4, 16), QuantSpec(8, 16)
    failures, ratios = [], {}

    def reduce(x, dtype, **options):
        out = torch.full((x.numel() // world,), float("nan"), dtype=dtype)
        reduce_scatter_quantized(
            comm, out, x.clone(), inter_spec, kernels, groups, chunks=2, bucket_numel=128, **options
        ).wait()
        return out.float()

    for width in (37, 301):  # neither a multiple of 2 * world
        for name, dtype in DTYPES.items():
            inputs = [_rank_input(r, world, width, dtype) for r in range(world)]
            exact = torch.stack([t.float() for t in inputs]).mean(0).view(world, width)[rank]
            absmax = torch.stack([t.float().view(world, width)[rank].abs().max() for t in inputs]).sum()
            q1, q2 = intra_spec.qmax, inter_spec.qmax
            bound = absmax * (1 / q1 + (1 + 1 / (2 * q1)) / q2) / (2 * world)
            bound = bound + exact.abs() * torch.finfo(dtype).eps + torch.finfo(dtype).tiny
            key = f"w{width}-{name}"
            comm.ledger.reset()
            two_level = reduce(inputs[rank], dtype, intra_spec=intra_spec)
            _check_qgz_ledger(comm, topo, inter_spec, width, 2, 128, failures, key, intra_spec=intra_spec)
            error = (two_level - exact).abs()
            if not (error <= bound).all():
                failures.append(f"{key}: two-level error {error.max():.3g} above bound {bound.min():.3g}")
            one_level = reduce(inputs[rank], dtype, intra_spec=inter_spec)
            comm.ledger.reset()
            plain = reduce(inputs[rank], dtype, intra_spec=None)  # only hop 2 quantizes, the node's exact sums
            _check_qgz_ledger(comm, topo, inter_spec, width, 2, 128, failures, f"{key}-plain", None, dtype.itemsize)
            plain_bound = absmax * (1 + 1 / (2 * q2)) / (2 * q2 * world) if topo.nodes > 1 else absmax * 1e-6
            plain_bound = plain_bound + exact.abs() * torch.finfo(dtype).eps + torch.finfo(dtype).tiny
            if not ((plain - exact).abs() <= plain_bound).all():
                failures.append(f"{key}: unquantized intra-node hop off by {(plain - exact).abs().max():.3g}")
            plain_fed = reduce(inputs[rank], dtype, intra_spec=None, feedback=ErrorFeedback(0.0))
            if not torch.equal(plain_fed, plain):
                failures.append(
                    f"{key}: error feedback's first reduction differs from the plain one (unquantized hop 1)"
                )
            rotated = reduce(inputs[rank], dtype, intra_spec=intra_spec, hadamard_rotation=True)
            rms = [float((t - exact).pow(2).mean().sqrt()) for t in (one_level, two_level, rotated)]
            ratios[key] = (rms[1] / max(rms[0], 1e-30), rms[2] / max(rms[1], 1e-30))
            feedback = ErrorFeedback(0.0)
            first = reduce(inputs[rank], dtype, intra_spec=intra_spec, feedback=feedback)
            if not torch.equal(first, two_level):
                failures.append(f"{key}: error feedback's first reduction differs from the plain one")
            repeated = [first] + [
                reduce(inputs[rank], dtype, intra_spec=intra_spec, feedback=feedback) for _ in range(7)
            ]
            mean_error = (torch.stack(repeated).mean(0) - exact).abs()
            if not (mean_error <= bound / 2).all() or mean_error.max() >= max(error.max(), 1e-30):
                failures.append(
                    f"{key}: mean of 8 fed-back reductions off by {mean_error.max():.3g} (one: {error.max():.3g})"
                )
    return dict(failures=failures, ratios=ratios)


@pytest.mark.parametrize("world,nodes", [(4, 1), (4, 2), (6, 3)], ids=["1node-x4", "2nodes-x2", "3nodes-x2"])
def test_two_level_qgz_with_rotation_and_error_feedback_lands_within_its_bound(world, nodes):
    for rank, result in enumerate(run_ranks(two_level_qgz_worker, world, nodes=nodes, simulated_nodes=nodes)):
        assert not result["failures"], f"rank {rank}: {result['failures']}"
        for key, (two_vs_one, rotated_vs_plain) in result["ratios"].items():
            if nodes == 1 and "fp32" in key:  # one node: int8 only (far below int4; bf16/fp16 rounding blurs it)
                assert two_vs_one < 0.2, (rank, key, two_vs_one)
            assert rotated_vs_plain < 2, (rank, key, rotated_vs_plain)  # a wrong inverse would be far off


# -- hpZ: exactly ZeRO-3 ---------------------------------------------------------------------------

STEPS, TOLERANCE, ADAM = 4, 1e-5, dict(lr=1e-2, eps=1e-4, weight_decay=0.01)  # eps: see test_exactness
# (name, model, accumulation, eval between steps, extra ZeroConfig fields)
HPZ_SCENARIOS = [
    ("node-accum2-eval", "gpt", 2, True, dict(hpz_partition_size=0, max_grad_norm=0.05)),
    (
        "node-prefetch2-small-buckets",
        "gpt",
        1,
        False,
        dict(hpz_partition_size=2, prefetch=2, allgather_bucket_numel=64, reduce_bucket_numel=64),
    ),
    ("node-activation-recompute-accum2", "gpt-checkpointed", 2, False, dict(hpz_partition_size=2)),
    ("node-edge-model", "edge", 1, True, dict(hpz_partition_size=0)),
]


def hpz_worker() -> dict:
    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.config.sections import TopologyConfig
    from zeropp.topology import init_topology

    topo = init_topology(TopologyConfig(nodes=2))
    world, rank = topo.world_size, topo.rank
    out = {}
    for name, kind, accumulation, evaluate, extra in HPZ_SCENARIOS:
        config = ZeroConfig(stage=3, gradient_accumulation_steps=accumulation, **extra)
        optim = dict(ADAM, weight_decay=0.0) if kind == "edge" else ADAM
        engine = ZeroEngine(make_model(kind), torch.optim.AdamW, optim, config, topo)
        ledger = engine.comm.ledger
        ledger.reset()
        for step in range(STEPS):
            for micro in range(accumulation):
                x, y = rows(global_batch(kind, step, micro, world), rank)
                engine.backward(loss_of(kind, engine, x, y))
            assert engine.step()
            if evaluate:
                with torch.no_grad():
                    engine.eval()
                    loss_of(kind, engine, *rows(global_batch(kind, 99, 0, world), rank))
                    engine.train()
        ours = engine.full_state_dict()
        ref = reference_state(kind, STEPS, world, accumulation, config.max_grad_norm, optim)
        out[name] = dict(
            error=max((ours[k] - ref[k]).abs().max().item() for k in ref),
            backward_inter=ledger.total(op="all_gather", phase="backward", link="inter"),
            backward_intra=ledger.total(op="all_gather", phase="backward", link="intra"),
        )
    return out


def test_hpz_trains_exactly_like_zero3():
    per_rank = run_ranks(hpz_worker, 4, nodes=2)
    for rank, results in enumerate(per_rank):
        for name, result in results.items():
            assert result["error"] <= TOLERANCE, f"rank {rank} {name}: max |w - w_ref| = {result['error']:.3g}"
            if "node" in name:  # the secondary group is one node: backward gathers never leave it
                assert result["backward_inter"] == 0 and result["backward_intra"] > 0, (rank, name, result)


# -- the ledger shows ZeRO++ Table 1; hpZ memory ------------------------------------------------------

BLOCK = 256
SCALE_OVERHEAD = 4 / (2 * BLOCK)  # one fp32 scale per block of bf16 values


def table1_worker() -> dict:
    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.app.models.gpt import GPT, GPTConfig
    from zeropp.config.sections import TopologyConfig
    from zeropp.costs.volume import zero3_step_bytes
    from zeropp.topology import init_topology

    topo = init_topology(TopologyConfig(nodes=2))
    out = {}
    zeropp = dict(quantized_weights=True, hpz_partition_size=0, quantized_gradients=True)
    for name, extra in (("zero3", {}), ("zeropp", zeropp)):
        torch.manual_seed(0)
        model = GPT(GPTConfig(block_size=32, n_layer=2, n_head=2, d_model=64))
        config = ZeroConfig(stage=3, precision="bf16", **extra)
        engine = ZeroEngine(model, torch.optim.AdamW, dict(lr=1e-3), config, topo)
        engine.comm.ledger.reset()
        for step in range(3):
            x, y = rows(global_batch("gpt", step, 0, topo.world_size), topo.rank)
            engine.backward(engine(x % 256, y % 256))
            engine.step()
        ledger = engine.comm.ledger
        out[name] = dict(
            forward=ledger.total(op="all_gather", phase="forward", link="inter"),
            backward_gather=ledger.total(op="all_gather", phase="backward", link="inter"),
            gradients=sum(ledger.total(op=o, phase="backward", link="inter") for o in ("reduce_scatter", "all_to_all")),
            measured_memory=engine.measured_model_state_bytes,
            padded_psi=sum(u.layout.padded_numel for u in engine.units),
            hpz_group=engine.hpz_group_size,
            zero3_predicted=zero3_step_bytes(
                [(u.layout.padded_numel, u.resident) for u in engine.units], topo.layout, config
            ),
        )
    return out


def test_ledger_shows_zeropp_table_1_and_hpz_memory():
    from zeropp.costs.memory import analytic_model_state_bytes

    per_rank = run_ranks(table1_worker, 4, nodes=2)
    mean = {
        name: {
            k: sum(r[name][k] for r in per_rank) / len(per_rank) for k in ("forward", "backward_gather", "gradients")
        }
        for name in ("zero3", "zeropp")
    }
    z3, zpp = mean["zero3"], mean["zeropp"]
    predicted = per_rank[0]["zero3"]["zero3_predicted"]  # what zeropp train prints as "ZeRO-3 would send"
    assert 3 * predicted["forward"]["inter"] == z3["forward"], (predicted, z3)
    assert 3 * predicted["backward"]["inter"] == z3["backward_gather"] + z3["gradients"], (predicted, z3)
    # qwZ starts each parameter on a block boundary: the ratios below are per element of its own buffer
    # (this 64-wide model's norms and biases pad to 4% more; a 768-wide one's to 0.1%, test_quant_blocks)
    padding = per_rank[0]["zeropp"]["padded_psi"] / per_rank[0]["zero3"]["padded_psi"]
    assert 1 < padding < 1.05, padding
    z3 = {k: v * padding for k, v in z3.items()}
    # forward all-gather: int8 instead of bf16 -> M/2, plus the scales
    assert 0.5 <= zpp["forward"] / z3["forward"] <= 0.5 + SCALE_OVERHEAD + 1e-3, mean
    # backward all-gather: inside the node only
    assert zpp["backward_gather"] == 0 < z3["backward_gather"], mean
    # gradients: int4 instead of bf16 over two hops -> at most M/4, plus the scales
    assert 0 < zpp["gradients"] / z3["gradients"] <= 0.25 + SCALE_OVERHEAD / 2, mean
    assert sum(zpp.values()) <= 0.25 * sum(z3.values()) + SCALE_OVERHEAD * z3["forward"], mean
    for rank in per_rank:
        plain, hpz = rank["zero3"], rank["zeropp"]
        assert hpz["hpz_group"] == 2
        assert plain["measured_memory"] == analytic_model_state_bytes(plain["padded_psi"], 4, 3, "bf16")
        assert hpz["measured_memory"] == analytic_model_state_bytes(hpz["padded_psi"], 4, 3, "bf16", hpz_group_size=2)


# -- qwZ and qgZ train close to the exact result ------------------------------------------------------

QUANTIZED_SCENARIOS = {
    "qwz-int8": dict(quantized_weights=True),
    "qgz-int8-3stages": dict(
        quantized_gradients=True, gradient_bits=8, qgz_pipeline_chunks=3, qgz_pipeline_min_chunk=1
    ),
    "qgz-int4": dict(quantized_gradients=True),
    "all-three-int4-grads": dict(quantized_weights=True, hpz_partition_size=0, quantized_gradients=True),
}


def quantized_training_worker(simulated_nodes: int) -> dict:
    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.config.sections import TopologyConfig
    from zeropp.topology import init_topology

    topo = init_topology(TopologyConfig(nodes=simulated_nodes))
    world, rank, sgd = topo.world_size, topo.rank, dict(lr=0.5)
    start = {k: v.float().clone() for k, v in make_model("gpt").state_dict().items()}
    ref = reference_state("gpt", STEPS, world, 1, None, sgd, torch.optim.SGD)
    moved = max((ref[k] - start[k]).abs().max().item() for k in ref)
    out = {}
    for name, extra in QUANTIZED_SCENARIOS.items():
        engine = ZeroEngine(make_model("gpt"), torch.optim.SGD, sgd, ZeroConfig(stage=3, **extra), topo)
        for step in range(STEPS):
            engine.backward(loss_of("gpt", engine, *rows(global_batch("gpt", step, 0, world), rank)))
            engine.step()
        ours = engine.full_state_dict()
        out[name] = max((ours[k] - ref[k]).abs().max().item() for k in ref) / moved
    return out


# largest |w - w_ref| as a fraction of the largest |w_ref - w_start| after 4 SGD steps; a gradient
# slice landing on the wrong rank or a wrong mean moves weights by the full update (fraction ~1)
# (measured: int8 0.007-0.014, int4 0.11-0.18)
QUANTIZED_TOLERANCE = {"qwz-int8": 0.03, "qgz-int8-3stages": 0.03, "qgz-int4": 0.35, "all-three-int4-grads": 0.35}


@pytest.mark.parametrize("world,nodes", [(4, 2), (4, 1)], ids=["2nodes-x2", "1node-x4"])
def test_qwz_and_qgz_train_close_to_the_exact_weights(world, nodes):
    for rank, errors in enumerate(run_ranks(quantized_training_worker, world, nodes=nodes, simulated_nodes=nodes)):
        for name, error in errors.items():
            assert 0 < error <= QUANTIZED_TOLERANCE[name], f"rank {rank} {name}: {error:.3g} of the update"
