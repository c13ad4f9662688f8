"""Under Ulysses a Hugging Face model attends by the mask transformers would build for one process on
the whole sequence (context_parallel.masks): eager attention, padding (left and right), and packed
documents (positions restarting inside a slice and at a slice's edge) train the weights and losses of
one process (fp32, world 2, C 2); the gathered masks and positions are on the ledger; flash attention
with padding is refused in one line."""

from __future__ import annotations

import pytest
import torch
from launcher import run_ranks
from models import ADAM_EPS, GPT_TEST, TOLERANCE, make_model

from zeropp.errors import ConfigError

transformers = pytest.importorskip("transformers")

STEPS, ROWS, LENGTH = 2, 2, GPT_TEST.block_size
OPTIM = dict(lr=1e-2, eps=ADAM_EPS, weight_decay=0.01)
CASES = ("eager", "sdpa-padded", "eager-padded", "sdpa-packed", "sdpa-cached-packed")


def _model(case: str):
    model = make_model("hf-llama")  # seeded: the same initial weights in every process
    model.config._attn_implementation = case.split("-")[0]
    return model


def _inputs(case: str, step: int) -> dict[str, torch.Tensor]:
    """Whole sequences: input ids and labels, with a padding mask (row 0 left-padded by 3, row 1
    right-padded by 5; padded labels ignored) or position ids restarting (row 0 at 5 and at the
    slice edge 8, row 1 at 11; transformers keeps the documents apart without a key-value cache only, so
    ``cached-packed`` runs with the model's default cache, where they are one sequence to attention)."""
    ids = torch.randint(0, 256, (ROWS, LENGTH), generator=torch.Generator().manual_seed(step))
    given = dict(input_ids=ids, labels=ids.clone())
    if case.endswith("padded"):
        mask = torch.ones_like(ids)
        mask[0, :3], mask[1, -5:] = 0, 0
        given["labels"][mask == 0] = -100
        given["attention_mask"] = mask
    if case.endswith("packed"):
        starts = ((0, 5, 8), (0, 11))
        given["position_ids"] = torch.stack(
            [torch.cat([torch.arange(b - a) for a, b in zip(s, (*s[1:], LENGTH), strict=True)]) for s in starts]
        )
        if "cached" not in case:
            given["use_cache"] = False
    return given


def reference(case: str) -> tuple[dict, list[float]]:
    model = _model(case)
    optimizer = torch.optim.AdamW(model.parameters(), **OPTIM)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = model(**_inputs(case, step)).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return model.state_dict(), losses


def masks_worker() -> dict:
    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.config.sections import TopologyConfig
    from zeropp.context_parallel import causal_lm_inputs, split_sequence
    from zeropp.topology import init_topology

    topology = init_topology(TopologyConfig(context_parallel_size=2))
    results = {}
    for case in CASES:
        engine = ZeroEngine(_model(case), torch.optim.AdamW, OPTIM, ZeroConfig(stage=3, prefetch=2), topology)
        losses, gathered = [], []
        for step in range(STEPS):
            engine.comm.ledger.reset()
            given = _inputs(case, step)
            inputs = causal_lm_inputs(topology, given["input_ids"], given["labels"], given.get("attention_mask"))
            if "position_ids" in given:
                (inputs["position_ids"],) = split_sequence(topology, given["position_ids"])
                inputs["use_cache"] = given.get("use_cache")
            loss = engine(**inputs).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            gathered.append(engine.comm.ledger.as_dict().get("cp.all_gather", {}).get("forward", {}).get("intra", 0))
        results[case] = dict(state=engine.full_state_dict(), losses=losses, gathered=gathered)
    return results


def test_eager_padding_and_packed_documents_train_as_one_process():
    per_rank = run_ranks(masks_worker, 2)
    for case in CASES:
        ref, ref_losses = reference(case)
        for result in (r[case] for r in per_rank):
            error = max((result["state"][k].float() - ref[k]).abs().max().item() for k in ref)
            assert error <= TOLERANCE, (case, error)
            # a padding mask or position ids: (2 rows x 16 tokens) int64, each rank sending its half once a step
            assert result["gathered"] == [0 if case == "eager" else ROWS * LENGTH * 8 // 2] * STEPS, case
        for step, expected in enumerate(ref_losses):
            got = sum(r[case]["losses"][step] for r in per_rank) / 2
            assert got == pytest.approx(expected, rel=1e-5, abs=0), (case, step)


class _Group:
    size, rank = 2, 0


class _Comm:
    """A group of two whose other rank holds the same slice (the one collective the hook makes)."""

    class topology:  # noqa: N801 (what the hook reads of it: the context-parallel group)
        context_parallel = _Group

    def all_gather(self, out, part, group, **_):
        out.copy_(part.expand_as(out))


@pytest.mark.unit
def test_flash_attention_with_padding_or_packed_documents_is_refused_in_one_line():
    from zeropp.context_parallel.masks import SequenceInputs

    model = make_model("hf-llama")
    ids = torch.zeros((1, 4), dtype=torch.long)
    inputs = SequenceInputs(_Comm(), _Group(), "flash_attention_2")
    inputs.take(model, (), dict(input_ids=ids, attention_mask=torch.ones_like(ids)))  # no padding: taken
    with pytest.raises(ConfigError) as padded:
        inputs.take(model, (), dict(input_ids=ids, attention_mask=torch.tensor([[0, 1, 1, 1]])))
    assert str(padded.value) == (
        "attn_implementation = 'flash_attention_2' with an attention_mask or position_ids is not allowed with "
        "topology.context_parallel_size = 2; expected sdpa or eager (they take padding and packed documents by a mask)"
    )
    with pytest.raises(ConfigError):  # positions 0 1 0 1 | 0 1 0 1: documents of two tokens
        inputs.take(model, (), dict(input_ids=ids, position_ids=torch.tensor([[0, 1, 0, 1]]), use_cache=False))
    args, kwargs = SequenceInputs(_Comm(), _Group(), "sdpa").take(model, (), dict(input_ids=ids))
    assert torch.equal(kwargs["position_ids"], torch.tensor([[0, 1, 2, 3]]))  # rank 0's slice: 0, 1, ...
