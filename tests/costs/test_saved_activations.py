"""The embedded GPT's activations saved for backward (costs.memory.Activations.saved_bytes, which
`zeropp estimate` prints per rank) equal the bytes of the tensors autograd saves, counted by a
saved-tensors hook (each storage once, parameters left out): fp32 and bf16, whole and tiled logits,
one process, and each rank of a context-parallel run (C 2), where every rank holds half the tokens."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from launcher import run_ranks

from zeropp.app.models.gpt import GPT, GPTConfig
from zeropp.costs.memory import Activations

SHAPE = dict(block_size=32, n_layer=2, n_head=4, d_model=64, vocab_size=300)
BATCH = 3


@contextlib.contextmanager
def saved_storages(model: torch.nn.Module) -> Iterator[dict[int, int]]:
    """Bytes of every storage autograd saves inside the block, by address; a parameter's (or a ZeRO
    buffer holding gathered parameters) left out."""
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        if storage.data_ptr() not in params:
            seen.setdefault(storage.data_ptr(), storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield seen


def activations(tiles: int, context_parallel: int = 1) -> Activations:
    return Activations(
        SHAPE["n_layer"], SHAPE["d_model"], SHAPE["block_size"], BATCH, context_parallel=context_parallel,
        heads=SHAPE["n_head"], vocab=SHAPE["vocab_size"], logit_tiles=tiles,
    )  # fmt: skip


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tiles", [1, 4])
def test_one_process_saves_what_the_formula_says(dtype, tiles):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SHAPE, logit_tiles=tiles)).to(dtype)
    idx = torch.randint(0, SHAPE["vocab_size"], (BATCH, SHAPE["block_size"] + 1))
    with saved_storages(model) as seen:
        model(idx[:, :-1].contiguous(), idx[:, 1:].contiguous())
    element = torch.empty((), dtype=dtype).element_size()
    assert sum(seen.values()) == activations(tiles).saved_bytes(element)


def context_parallel_worker(tiles: int) -> int:
    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.config.sections import TopologyConfig
    from zeropp.context_parallel import split_sequence
    from zeropp.topology import init_topology

    topology = init_topology(TopologyConfig(context_parallel_size=2))
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SHAPE, logit_tiles=tiles))
    engine = ZeroEngine(model, torch.optim.AdamW, dict(lr=1e-3), ZeroConfig(stage=3), topology)
    idx = torch.randint(0, SHAPE["vocab_size"], (BATCH, SHAPE["block_size"] + 1))
    with saved_storages(engine.module) as seen:
        loss = engine(*split_sequence(topology, idx[:, :-1], idx[:, 1:]))
    engine.backward(loss)
    return sum(seen.values())


@pytest.mark.parametrize("tiles", [1, 4])
def test_each_context_parallel_rank_saves_what_the_formula_says(tiles):
    for measured in run_ranks(context_parallel_worker, 2, tiles=tiles):
        assert measured == activations(tiles, context_parallel=2).saved_bytes(4)
