"""Dropout under tensor parallelism (zeropp.tensor_parallel.rng), on Hugging Face GPT-2 with every
dropout at 0.5: what the ranks compute whole draws one mask on every rank, what they hold in parts
(a rank's heads; with sequence parallelism a rank's slice of the sequence) draws a mask of each
rank's own, new in every layer and every forward, and activation checkpointing recomputes the masks
forward drew."""

from __future__ import annotations

import pytest
import torch
from launcher import run_ranks
from models import global_batch, loss_of, make_model, rows
from torch.overrides import TorchFunctionMode

pytest.importorskip("transformers")

P = 0.5
KIND = "hf-gpt2-dropout"
SEQUENCE_PARALLEL = pytest.mark.parametrize("sequence_parallel", [False, True], ids=["megatron", "sequence-parallel"])


class DropoutMasks(TorchFunctionMode):
    """Every ``F.dropout`` call's mask, in call order: 1 kept, 0 dropped, -1 where the input was 0
    (attention's causal mask: no draw shows there)."""

    def __init__(self) -> None:
        super().__init__()
        self.masks: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.nn.functional.dropout:
            self.masks.append(torch.where(args[0] == 0, -1, (out != 0).to(torch.int8)))
        return out


def _forward_masks(model: torch.nn.Module, x: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    with DropoutMasks() as recorded, torch.no_grad():
        logits = model(input_ids=x).logits
    return recorded.masks, logits


def _stop(*_) -> None:
    raise RuntimeError("stop")


def masks_worker(sequence_parallel: bool) -> dict:
    """Two training-mode forwards, after two calls of attention that raised inside its region: one
    through its module hooks, one of its ``forward`` alone, as a recomputation that torch's
    checkpoint stopped (and restored the generators after)."""
    from zeropp.config.sections import TopologyConfig
    from zeropp.tensor_parallel.apply import parallelize
    from zeropp.topology import init_topology

    topology = init_topology(TopologyConfig(tensor_parallel_size=2, sequence_parallel=sequence_parallel))
    model = parallelize(make_model(KIND), topology).train()
    x, _ = global_batch(KIND, 0, 0, 1)
    torch.manual_seed(1)
    attn = model.transformer.h[0].attn
    stop = attn.c_proj.register_forward_pre_hook(_stop, prepend=True)  # before the hook that ends the region
    hidden = torch.randn(2, x.shape[1] // (2 if sequence_parallel else 1), 64)
    with pytest.raises(RuntimeError, match="stop"), torch.no_grad():
        attn(hidden)  # its end closes the region
    state = torch.get_rng_state()
    with pytest.raises(RuntimeError, match="stop"), torch.no_grad():
        attn.forward(hidden)  # no module hooks around it: the region stays open
    stop.remove()
    torch.set_rng_state(state)
    first, logits = _forward_masks(model, x)
    second, _ = _forward_masks(model, x)
    after = torch.rand(4)
    torch.manual_seed(2)
    with torch.no_grad():
        model.eval()(input_ids=x)
    drawn_after_eval = torch.rand(4)
    torch.manual_seed(2)
    eval_draws_nothing = torch.equal(drawn_after_eval, torch.rand(4))
    return dict(first=first, second=second, logits=logits, after=after, eval_draws_nothing=eval_draws_nothing)


# GPT-2's dropouts in call order: the embeddings', then per block attention's (on the heads),
# attention's residual and the MLP's residual
ORDER = ["embeddings"] + ["attention", "residual", "residual"] * 2


def _agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    live = (a >= 0) & (b >= 0)
    return (a == b)[live].float().mean().item()


@SEQUENCE_PARALLEL
def test_parts_draw_their_own_masks_and_whole_activations_one(sequence_parallel):
    ranks = run_ranks(masks_worker, world=2, sequence_parallel=sequence_parallel)
    first, second = (r["first"] for r in ranks)
    assert len(first) == len(second) == len(ORDER)
    for where, a, b in zip(ORDER, first, second, strict=True):
        parts = where == "attention" or sequence_parallel  # heads, or the sequence's slices
        assert a.shape == b.shape
        for mask in (a, b):
            assert abs(mask[mask >= 0].float().mean().item() - (1 - P)) < 0.1, where  # a dropout at P
        same = _agreement(a, b)
        if parts:  # independent masks agree on about half the elements at P = 0.5
            assert 0.35 < same < 0.65, f"{where}: ranks drew masks agreeing on {same:.0%}"
        else:
            assert same == 1.0, f"{where}: a whole activation got different masks on the ranks"
    for rank in ranks:  # each rank's parts: new masks in every layer and every forward
        attention = [m for where, m in zip(ORDER, rank["first"], strict=True) if where == "attention"]
        assert 0.35 < _agreement(*attention) < 0.65
        assert all(0.35 < _agreement(a, b) < 0.65 for a, b in zip(rank["first"], rank["second"], strict=True))
    assert torch.equal(ranks[0]["logits"], ranks[1]["logits"])  # the LM head's output is whole
    assert torch.equal(ranks[0]["after"], ranks[1]["after"])  # the default stream moved on alike
    assert all(r["eval_draws_nothing"] for r in ranks)  # evaluation leaves training's stream alone


def replicated_output_worker() -> dict:
    """A plan of the user's: a column-wise linear gathering its output whole, then dropout."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel

    from zeropp.config.sections import TopologyConfig
    from zeropp.tensor_parallel.apply import parallelize
    from zeropp.topology import init_topology

    topology = init_topology(TopologyConfig(tensor_parallel_size=2))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Dropout(P), torch.nn.Linear(64, 8))
    model = parallelize(model, topology, plan={"0": ColwiseParallel(output_layouts=Replicate())}).train()
    with torch.no_grad():
        return dict(out=model(torch.ones(4, 8)))


def test_a_column_wise_output_gathered_whole_draws_one_mask():
    out = [r["out"] for r in run_ranks(replicated_output_worker, world=2)]
    assert torch.equal(out[0], out[1])


def sequence_region_worker() -> dict:
    """A sequence-parallel plan of the user's: dropout on each rank's slice, then on the gathered whole."""
    from zeropp.config.sections import TopologyConfig
    from zeropp.tensor_parallel.apply import parallelize
    from zeropp.tensor_parallel.plans import SequenceGathered, SequenceSliced
    from zeropp.topology import init_topology

    topology = init_topology(TopologyConfig(tensor_parallel_size=2, sequence_parallel=True))
    torch.manual_seed(0)
    identity, dropout = torch.nn.Identity, torch.nn.Dropout
    model = torch.nn.Sequential(identity(), dropout(P), identity(), dropout(P))
    model = parallelize(model, topology, plan={"0": SequenceSliced(), "2": SequenceGathered()}).train()
    with DropoutMasks() as recorded, torch.no_grad():
        out = model(torch.ones(2, 8, 16))
    return dict(masks=recorded.masks, out=out)


def test_the_sequence_region_ends_where_the_sequence_is_gathered():
    (sliced, gathered), (sliced_1, gathered_1) = (r["masks"] for r in run_ranks(sequence_region_worker, world=2))
    assert sliced.shape == (2, 4, 16) and 0.35 < _agreement(sliced, sliced_1) < 0.65  # each rank its slice's
    assert gathered.shape == (2, 8, 16) and torch.equal(gathered, gathered_1)  # the whole: one mask


def training_worker(sequence_parallel: bool) -> dict:
    """ZeRO-3 on dp 1 x tp 2 with every dropout at P, with and without activation checkpointing."""
    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.config.sections import TopologyConfig
    from zeropp.tensor_parallel.apply import parallelize
    from zeropp.topology import init_topology

    topology = init_topology(TopologyConfig(tensor_parallel_size=2, sequence_parallel=sequence_parallel))
    states = {}
    for checkpointing in (False, True):
        config = ZeroConfig(stage=3, activation_checkpointing=checkpointing)
        engine = ZeroEngine(parallelize(make_model(KIND), topology), torch.optim.AdamW, dict(lr=1e-2), config, topology)
        torch.manual_seed(1)
        for step in range(3):
            engine.backward(loss_of(KIND, engine, *rows(global_batch(KIND, step, 0, 1), 0)))
            assert engine.step()
        states[checkpointing] = engine.full_state_dict()
    return states


@SEQUENCE_PARALLEL
def test_checkpointing_recomputes_the_masks_forward_drew(sequence_parallel):
    """Same weights with and without recomputation (a recomputed mask unlike forward's would give
    gradients of another function), and the same on both tp ranks (whole weights got one mask)."""
    ranks = run_ranks(training_worker, world=2, sequence_parallel=sequence_parallel)
    for states in ranks:
        plain, recomputed = states[False], states[True]
        assert plain.keys() == recomputed.keys()
        assert max((plain[k] - recomputed[k]).abs().max().item() for k in plain) <= 1e-6
    assert all(torch.equal(ranks[0][True][k], ranks[1][True][k]) for k in ranks[0][True])


@pytest.mark.gpu
def test_a_rank_stream_on_cuda_recomputes_forwards_masks_under_checkpoint():
    """One process: a region on CUDA inside torch's checkpoint gives the gradient of the plain run."""
    from torch.utils.checkpoint import checkpoint

    from zeropp.tensor_parallel.rng import RankStream

    device = torch.device("cuda")
    layer = torch.nn.Linear(64, 64, device=device)
    region = RankStream(1, device, layer)

    def forward(x: torch.Tensor) -> torch.Tensor:
        region.enter()
        try:
            return torch.nn.functional.dropout(layer(x), P)
        finally:
            region.exit()

    grads = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        x = torch.randn(8, 64, device=device, requires_grad=True)
        (checkpoint(forward, x, use_reentrant=False) if checkpointed else forward(x)).sum().backward()
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])
