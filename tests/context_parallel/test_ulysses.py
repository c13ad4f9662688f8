"""Ulysses context parallelism trains exactly as one process on whole sequences (fp32): the embedded
GPT and a Hugging Face Llama with grouped-query attention, at world 2 (C 2), world 4 (C 2 x data
parallel 2) and world 4 (C 4, where the Llama's 2 key-value heads are repeated); its all-to-all bytes
are the formula; what it cannot do is refused in one line."""

from __future__ import annotations

import pytest
import torch
from launcher import run_ranks
from models import ADAM_EPS, TOLERANCE, global_batch, loss_of, make_model, rows

STEPS = 3
OPTIM = dict(lr=1e-2, eps=ADAM_EPS, weight_decay=0.01)


def reference(kind: str, readers: int) -> tuple[dict, list[float]]:
    """One process on the whole global batch: its weights after STEPS AdamW steps and its losses."""
    model = make_model(kind)
    optimizer = torch.optim.AdamW(model.parameters(), **OPTIM)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = loss_of(kind, model, *global_batch(kind, step, 0, readers))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def _model(kind: str, tiles: int):
    """make_model's, the GPT's loss in `tiles` tiles (the same initial weights: tiling adds none)."""
    if tiles == 1:
        return make_model(kind)
    import dataclasses

    from models import GPT_TEST

    from zeropp.app.models.gpt import GPT

    torch.manual_seed(0)
    return GPT(dataclasses.replace(GPT_TEST, logit_tiles=tiles))


# ZeRO-R: every block recomputed in backward, its input checkpoint kept on the host (Pa+cpu)
CHECKPOINTED = dict(activation_checkpointing=True, partition_activations=True, cpu_checkpointing=True)


def context_parallel_worker(kind: str, cp: int, stage: int, tiles: int, tp: int, checkpointed: bool) -> dict:
    from zeropp import ZeroConfig, ZeroEngine, parallelize
    from zeropp.config.sections import TopologyConfig
    from zeropp.context_parallel import causal_lm_inputs, sequence_positions, split_sequence
    from zeropp.topology import init_topology

    topology = init_topology(TopologyConfig(context_parallel_size=cp, tensor_parallel_size=tp))
    reader, readers = topology.layout.reader(topology.rank)
    model = parallelize(_model(kind, tiles), topology)
    extra = CHECKPOINTED if checkpointed else {}
    engine = ZeroEngine(model, torch.optim.AdamW, OPTIM, ZeroConfig(stage=stage, prefetch=2, **extra), topology)
    losses, all_to_all = [], []
    for step in range(STEPS):
        engine.comm.ledger.reset()
        x, y = rows(global_batch(kind, step, 0, readers), reader)
        if kind == "gpt":
            loss = engine(*split_sequence(topology, x, y), positions=sequence_positions(topology, x.shape[1]))
        else:
            loss = engine(**causal_lm_inputs(topology, x)).loss
        engine.backward(loss)
        assert engine.step()
        losses.append(loss.item())
        all_to_all.append(engine.comm.ledger.as_dict().get("cp.all_to_all", {}))
    return dict(state=engine.full_state_dict(), losses=losses, all_to_all=all_to_all, readers=readers)


@pytest.mark.parametrize(
    "kind,world,cp,stage,tiles,tp,checkpointed",
    [
        ("gpt", 2, 2, 3, 1, 1, False), ("hf-llama", 2, 2, 3, 1, 1, False), ("gpt", 4, 2, 3, 1, 1, False),
        ("hf-llama", 4, 2, 2, 1, 1, False), ("hf-llama", 4, 4, 3, 1, 1, False), ("gpt", 2, 2, 3, 4, 1, False),
        ("hf-llama", 4, 2, 3, 1, 2, False), ("gpt", 4, 2, 3, 1, 1, True),
    ],
    ids=[
        "gpt-c2", "llama-c2", "gpt-c2xdp2", "llama-c2xdp2-stage2", "llama-c4-kv-repeated", "gpt-c2-tiled-logits",
        "llama-c2xtp2", "gpt-c2xdp2-checkpoints-on-host",
    ],
)  # fmt: skip
def test_trains_the_weights_and_losses_of_one_process(kind, world, cp, stage, tiles, tp, checkpointed):
    from models import GPT_TEST

    per_rank = run_ranks(
        context_parallel_worker, world, kind=kind, cp=cp, stage=stage, tiles=tiles, tp=tp, checkpointed=checkpointed
    )
    readers = world // cp // tp
    assert per_rank[0]["readers"] == readers
    ref, ref_losses = reference(kind, readers)
    for result in per_rank:
        state = result["state"]  # whole tensors also under tensor parallelism
        assert state.keys() == ref.keys()
        error = max((state[k].float() - ref[k]).abs().max().item() for k in ref)
        assert error <= TOLERANCE, error
    # the rank losses averaged over the world: the mean over every token of the global batch
    for step, expected in enumerate(ref_losses):
        got = sum(r["losses"][step] for r in per_rank) / world
        assert got == pytest.approx(expected, rel=1e-5, abs=0), step
    # per layer and micro-batch, forward and backward: q, k, v and the output, each rank sending (C-1)/C of
    # its (2 rows x T/C x heads x head size) fp32 elements, keys and values at their own head count (the
    # Llama's 2 of 4) where C divides it, else repeated to one per query head
    from zeropp.costs.context_parallel import ulysses_bytes

    if kind == "gpt":
        layers, heads, kv_heads, head_size = GPT_TEST.n_layer, GPT_TEST.n_head, GPT_TEST.n_head, 16
    else:
        layers, heads, kv_heads, head_size = 2, 4 // tp, 2 // tp, 8  # a tensor-parallel rank's heads
    per_head = 2 * (GPT_TEST.block_size // cp) * head_size * 4 * (cp - 1) // cp
    per_layer = per_head * (2 * heads + 2 * (kv_heads if kv_heads % cp == 0 else heads))
    assert per_layer == ulysses_bytes(2, GPT_TEST.block_size, heads, kv_heads, head_size, cp, 4)
    for result in per_rank:
        for step in result["all_to_all"]:
            assert step == {
                "forward": {"intra": layers * per_layer, "inter": 0},
                # activation checkpointing recomputes each block's forward, its four all-to-alls included
                "backward": {"intra": (2 if checkpointed else 1) * layers * per_layer, "inter": 0},
            }, step


def refusals_worker() -> dict:
    from zeropp import ConfigError, ZeroConfig, ZeroEngine
    from zeropp.config.sections import TopologyConfig
    from zeropp.topology import init_topology

    topology = init_topology(TopologyConfig(context_parallel_size=4))
    messages = {}
    for name, build in (("gpt", lambda: make_model("gpt")), ("mlp", lambda: make_model("mlp"))):
        try:
            ZeroEngine(build(), torch.optim.AdamW, OPTIM, ZeroConfig(stage=3), topology)
        except ConfigError as error:
            messages[name] = str(error)
    engine = ZeroEngine(make_model("hf-llama"), torch.optim.AdamW, OPTIM, ZeroConfig(stage=3), topology)
    x, _ = rows(global_batch("hf-llama", 0, 0, 1), 0)
    try:
        engine.generate(x[:, :4], max_new_tokens=2)
    except ConfigError as error:
        messages["generate"] = str(error)
    try:
        ZeroEngine(engine.module, torch.optim.AdamW, OPTIM, ZeroConfig(stage=3), topology)
    except ConfigError as error:
        messages["twice"] = str(error)
    return messages


def test_what_ulysses_cannot_do_is_refused_in_one_line_before_any_collective():
    for messages in run_ranks(refusals_worker, 4):
        assert messages["gpt"].startswith(
            "topology.context_parallel_size = 4 does not divide the model's 2 attention heads (model.n_head)"
        ), messages
        assert messages["mlp"] == (
            "topology.context_parallel_size = 4 is not allowed with Sequential: zeropp reaches the attention of the "
            "embedded GPT and of Hugging Face models that use transformers' attention interface only; expected 1"
        )
        assert messages["generate"].startswith("engine.generate is not allowed with topology.context_parallel_size = 4")
        assert messages["twice"].startswith("topology.context_parallel_size = 4: this model's attention is routed")


def test_the_example_trains_the_losses_of_one_process_and_the_docs_include_it():
    import transformers

    from examples import docs_include, run_example

    done = run_example("long_sequences.py")
    assert done.returncode == 0, done.stderr[-3000:]
    printed = [float(x) for x in done.stdout.strip().splitlines()[-1].split("losses ")[1].split(", ")]
    torch.manual_seed(0)  # the example's model, data and optimizer in one process on whole sequences
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator, expected = torch.Generator().manual_seed(0), []
    for _ in range(3):
        rows = torch.randint(0, 256, (1, 2, 512), generator=generator)[0]
        optimizer.zero_grad()
        loss = model(input_ids=rows, labels=rows).loss
        loss.backward()
        optimizer.step()
        expected.append(loss.item())
    assert printed == pytest.approx(expected, rel=1e-4)  # printed to 4 decimals
    assert docs_include("long-sequences.md", "long_sequences.py")


def dropout_worker() -> dict:
    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.config.sections import TopologyConfig
    from zeropp.context_parallel import sequence_positions, split_sequence
    from zeropp.topology import init_topology

    topology = init_topology(TopologyConfig(context_parallel_size=2))
    model = make_model("gpt")
    drawn = []
    model.blocks[0].register_forward_hook(lambda *_: drawn.append(torch.rand(4)))  # as a dropout mask would
    engine = ZeroEngine(model, torch.optim.AdamW, OPTIM, ZeroConfig(stage=3), topology)
    x, y = rows(global_batch("gpt", 0, 0, 1), 0)
    engine.backward(engine(*split_sequence(topology, x, y), positions=sequence_positions(topology, x.shape[1])))
    engine.step()
    return dict(drawn=drawn[0], after=torch.get_rng_state())


def test_each_rank_of_a_sequence_draws_its_own_random_numbers_and_the_default_stream_moves_alike():
    first, second = run_ranks(dropout_worker, 2)
    assert not torch.equal(first["drawn"], second["drawn"])  # two slices of one sequence: two masks
    assert torch.equal(first["after"], second["after"])  # what runs outside the forward draws alike


def zeropp_worker() -> dict:
    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.config.sections import TopologyConfig
    from zeropp.context_parallel import split_sequence
    from zeropp.topology import init_topology

    topology = init_topology(TopologyConfig(context_parallel_size=2, nodes=2))
    reader, readers = topology.layout.reader(topology.rank)
    zeropp = ZeroConfig(stage=3, quantized_weights=True, hpz_partition_size=0, quantized_gradients=True)
    engine = ZeroEngine(make_model("gpt"), torch.optim.SGD, dict(lr=0.5), zeropp, topology)
    for step in range(STEPS):
        x, y = rows(global_batch("gpt", step, 0, readers), reader)
        engine.backward(engine(*split_sequence(topology, x, y)))
        engine.step()
    ledger = engine.comm.ledger.as_dict()
    return dict(state=engine.full_state_dict(), readers=readers, hpz=engine.hpz_group_size, ops=sorted(ledger))


def test_zeropp_over_a_context_parallel_run_trains_close_to_one_process():
    """qwZ, hpZ (each node's 2 ranks: the context-parallel run) and qgZ at world 4 on 2 nodes with C 2:
    the weights after SGD steps within the bound tests/zero/test_zeropp.py holds ZeRO++ to without
    context parallelism (int4 gradients: 0.35 of the update; a slice's gradient lost or counted twice
    moves them by about the whole update)."""
    from models import reference_state

    per_rank = run_ranks(zeropp_worker, 4, nodes=2)
    assert per_rank[0]["readers"] == 2 and per_rank[0]["hpz"] == 2
    assert "cp.all_to_all" in per_rank[0]["ops"]
    start = make_model("gpt").state_dict()
    ref = reference_state("gpt", STEPS, 2, 1, None, dict(lr=0.5), torch.optim.SGD)
    moved = max((ref[k] - start[k]).abs().max().item() for k in ref)
    for result in per_rank:
        error = max((result["state"][k].float() - ref[k]).abs().max().item() for k in ref) / moved
        assert 0 < error <= 0.35, error
