"""Models bigger than one rank: meta-device construction one unit at a time, eager models synchronized
one flat broadcast per unit, and a per-rank memory high-water mark during construction."""

from __future__ import annotations

import ctypes

import pytest
import torch
from launcher import run_ranks
from models import ADAM_EPS, STEPS, TOLERANCE, global_batch, loss_of, make_model, reference_state, rows

KINDS = ["gpt", "hf-gpt2", "hf-llama"]
SEED = 3


def _meta_model(kind: str) -> torch.nn.Module:
    with torch.device("meta"):
        return make_model(kind)


def _initial_reference(kind: str) -> dict[str, torch.Tensor]:
    from zeropp.zero.grouping import repeated_blocks
    from zeropp.zero.materialize import initialize_model

    model = _meta_model(kind)
    return initialize_model(model, repeated_blocks(model), seed=SEED).state_dict()


def train_meta_built(simulated_nodes: int, kinds: list[str], tp: int = 1) -> dict[str, float]:
    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.config.sections import TopologyConfig
    from zeropp.tensor_parallel.apply import parallelize
    from zeropp.topology import init_topology

    topology = init_topology(TopologyConfig(nodes=simulated_nodes, tensor_parallel_size=tp))
    world, rank = topology.data_parallel.size, topology.data_parallel.rank  # tensor-parallel ranks: the same rows
    optim_kwargs = dict(lr=1e-2, eps=ADAM_EPS, weight_decay=0.01)
    errors = {}
    for kind in kinds:
        initial = _initial_reference(kind)
        for stage in (1, 2, 3):
            model = parallelize(_meta_model(kind), topology)  # split weights: initialized whole, then cut
            engine = ZeroEngine(model, torch.optim.AdamW, optim_kwargs, ZeroConfig(stage=stage), topology, seed=SEED)
            start = engine.full_state_dict()
            errors[f"{kind}-stage{stage}-initial"] = max(
                (start[k] - initial[k].float()).abs().max().item() for k in initial
            )
            for step in range(STEPS):
                x, y = rows(global_batch(kind, step, 0, world), rank)
                engine.backward(loss_of(kind, engine, x, y))
                engine.step()
            reference = make_model(kind)
            reference.load_state_dict(initial)
            ref = reference_state(kind, STEPS, world, 1, None, optim_kwargs, model=reference)
            ours = engine.full_state_dict()
            assert ours.keys() == ref.keys(), kind
            errors[f"{kind}-stage{stage}"] = max((ours[k] - ref[k]).abs().max().item() for k in ref)
    return errors


@pytest.mark.parametrize(
    "world,nodes,tp,kinds",
    [(2, 1, 1, KINDS), (4, 2, 1, KINDS), (4, 2, 2, KINDS)],
    ids=["world2", "world4-2nodes", "dp2xtp2-2nodes"],
)
def test_meta_built_models_train_like_single_process_from_the_same_weights(world, nodes, tp, kinds):
    pytest.importorskip("transformers")
    for rank_errors in run_ranks(train_meta_built, world, nodes=nodes, simulated_nodes=nodes, kinds=kinds, tp=tp):
        assert len(rank_errors) == 2 * 3 * len(kinds)
        bad = {name: err for name, err in rank_errors.items() if not err <= TOLERANCE}
        assert not bad, f"max |w - w_ref| above {TOLERANCE}: {bad}"


def test_meta_initialization_sets_buffers_and_refuses_what_no_initializer_sets():
    pytest.importorskip("transformers")
    from zeropp.zero.grouping import repeated_blocks
    from zeropp.zero.materialize import MaterializeError, initialize_model

    llama = _meta_model("hf-llama")
    initialize_model(llama, repeated_blocks(llama))
    eager = dict(make_model("hf-llama").named_buffers())
    for name, buffer in llama.named_buffers():  # rotary inv_freq: non-persistent, computed in __init__
        assert torch.equal(buffer, eager[name]), name

    class Scaled(torch.nn.Module):  # a parameter no reset_parameters() and no _init_weights() sets
        def __init__(self) -> None:
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(3))

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(3, 3), Scaled())
    with pytest.raises(MaterializeError) as info:
        initialize_model(model, repeated_blocks(model))
    assert "1.scale" in str(info.value) and "init_fn" in str(info.value) and "\n" not in str(info.value)
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(3, 3), Scaled())

    def init_fn(module: torch.nn.Module) -> None:  # replaces the default initializer entirely
        if isinstance(module, Scaled):
            torch.nn.init.ones_(module.scale)
        elif isinstance(module, torch.nn.Linear):
            module.reset_parameters()

    initialize_model(model, [], init_fn=init_fn)
    assert torch.equal(model[1].scale, torch.ones(3)) and torch.isfinite(model[0].weight).all()


def construction_memory(meta: bool, blocks: int, width: int) -> dict:
    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.costs.memory import PeakMeter
    from zeropp.topology import init_topology

    topology = init_topology()
    # glibc raises its mmap threshold as large blocks are freed and then keeps freed blocks resident;
    # a fixed threshold (M_MMAP_THRESHOLD = -3) returns them, so the resident set follows live tensors
    ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)

    def build(width: int) -> ZeroEngine:
        with torch.device("meta" if meta else "cpu"):
            layers = torch.nn.ModuleList(torch.nn.Linear(width, width, bias=False) for _ in range(blocks))
        return ZeroEngine(torch.nn.Sequential(layers), torch.optim.AdamW, dict(lr=1e-3), ZeroConfig(stage=3), topology)

    build(8)  # what the first construction loads lazily (libraries, caches) is not the model's memory
    meter = PeakMeter(topology.device)
    engine = build(width)
    broadcasts = engine.comm.ledger.calls.get(("broadcast", "other"), 0)
    return dict(
        peak=meter.peak(), model_bytes=4 * blocks * width * width, broadcasts=broadcasts, units=len(engine.units)
    )


def test_no_rank_holds_the_whole_model_while_constructing():
    """8 blocks of 16 MiB on 4 ranks at stage 3: a rank ends with 32 MiB of fp32 master shards and
    holds one unit's 16 MiB fp32 flat buffer at a time while it initializes and shards it. The bound
    leaves a quarter of a unit for the process's own allocations: a second unit held at once (e.g.
    the previous unit's buffer kept alive by a view) crosses it, and so would the 128 MiB model."""
    for result in run_ranks(construction_memory, 4, nodes=2, meta=True, blocks=8, width=2048):
        shards, unit = result["model_bytes"] / 4, result["model_bytes"] / 8
        assert result["peak"] <= shards + 1.25 * unit < result["model_bytes"], result
        assert result["broadcasts"] == 0  # every rank initializes on its own: nothing to synchronize


def test_eager_models_are_synchronized_with_one_broadcast_per_unit():
    first, _ = run_ranks(construction_memory, 2, meta=False, blocks=4, width=64)
    assert first["broadcasts"] == first["units"] == 4  # rank 0 sends (rank 1 forwards nothing: the ledger's ring)


def test_a_hugging_face_model_nested_in_a_wrapper_initializes_as_it_would_whole():
    """A LightningModule, a value head or a PeftModel around a Hugging Face model: its modules get the
    model's own _init_weights (Llama: Linear and Embedding weights N(0, initializer_range), norms 1)."""
    pytest.importorskip("transformers")
    from zeropp.zero.grouping import repeated_blocks
    from zeropp.zero.materialize import initialize_model

    class ValueHead(torch.nn.Module):  # a wrapper with no _init_weights of its own
        def __init__(self) -> None:
            super().__init__()
            self.model = make_model("hf-llama")
            self.value = torch.nn.Linear(self.model.config.hidden_size, 1)

    with torch.device("meta"):
        wrapped = ValueHead()
    initialize_model(wrapped, repeated_blocks(wrapped))
    llama = wrapped.model
    norms = [m.weight for m in llama.modules() if type(m).__name__ == "LlamaRMSNorm"]
    assert norms and all(torch.equal(w, torch.ones_like(w)) for w in norms)
    matrices = torch.cat([m.weight.flatten() for m in llama.modules() if isinstance(m, torch.nn.Linear)])
    assert abs(matrices.std().item() - llama.config.initializer_range) < 0.1 * llama.config.initializer_range
    assert torch.isfinite(wrapped.value.weight).all()  # outside the model: its own reset_parameters
