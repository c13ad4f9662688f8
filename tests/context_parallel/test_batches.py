"""A host loop's batches under context parallelism (context_parallel.batches): each rank's own rows,
of different lengths on the two ranks, shared over the run and cut to each rank's slice; a step on
the slices trains the weights of one process on every row (the mean over all tokens), and each
rank's evaluation loss is the mean token loss of its own rows (fp32, world 2, C 2)."""

from __future__ import annotations

import pytest
import torch
from launcher import run_ranks
from models import ADAM_EPS, TOLERANCE, make_model

pytest.importorskip("transformers")

OPTIM = dict(lr=1e-2, eps=ADAM_EPS, weight_decay=0.01)
LENGTHS = (10, 13)  # rank 0's rows, rank 1's: padded to 14, the common length C divides


def own_rows(rank: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 256, (2, LENGTHS[rank]), generator=torch.Generator().manual_seed(rank))
    labels = ids.clone()
    labels[0, :3] = -100  # a prompt not trained on
    return dict(input_ids=ids, labels=labels)


def counted(batch: dict[str, torch.Tensor]) -> int:
    return int((batch["labels"][:, 1:] != -100).sum())


def batches_worker() -> dict:
    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.config.sections import TopologyConfig
    from zeropp.context_parallel.batches import own_rows_loss, share_rows
    from zeropp.topology import init_topology

    topology = init_topology(TopologyConfig(context_parallel_size=2))
    engine = ZeroEngine(make_model("hf-llama"), torch.optim.AdamW, OPTIM, ZeroConfig(stage=3), topology)
    batch = own_rows(topology.rank)
    shared = share_rows(engine.comm, topology, batch)
    with torch.no_grad():
        evaluated = own_rows_loss(engine.comm, topology, lambda given: engine(**given).logits, batch).item()
    total = counted(own_rows(0)) + counted(own_rows(1))  # the Trainer's count across ranks
    loss = engine(**shared, num_items_in_batch=total).loss
    engine.backward(loss * topology.world_size)  # as the Trainer scales it for the gradient mean
    engine.step()
    return dict(shared=shared, evaluated=evaluated, state=engine.full_state_dict())


def test_rows_of_different_lengths_are_shared_and_train_as_one_process():
    per_rank = run_ranks(batches_worker, 2)
    model = make_model("hf-llama")
    with torch.no_grad():
        evaluated = [model(**own_rows(rank)).loss.item() for rank in (0, 1)]
    # the slices: both ranks' rows right-padded to 14 tokens (labels by -100), labels shifted before the cut
    padded = [
        {k: torch.nn.functional.pad(v, (0, 14 - v.shape[1]), value=-100 if k == "labels" else 0) for k, v in b.items()}
        for b in (own_rows(0), own_rows(1))
    ]
    every = {k: torch.cat([p[k] for p in padded]) for k in ("input_ids", "labels")}
    every["shift_labels"] = torch.cat([every["labels"][:, 1:], torch.full((4, 1), -100)], dim=1)
    for rank, result in enumerate(per_rank):
        assert result["shared"].keys() == every.keys()
        for name, whole in every.items():
            assert torch.equal(result["shared"][name], whole[:, 7 * rank : 7 * (rank + 1)]), name
        assert result["evaluated"] == pytest.approx(evaluated[rank], rel=1e-5)
    # one process: every row's token losses over every counted token
    optimizer = torch.optim.AdamW(model.parameters(), **OPTIM)
    sums = [model(**own_rows(rank)).loss * counted(own_rows(rank)) for rank in (0, 1)]
    (sum(sums) / (counted(own_rows(0)) + counted(own_rows(1)))).backward()
    optimizer.step()
    for result in per_rank:
        error = max((result["state"][k].float() - v).abs().max().item() for k, v in model.state_dict().items())
        assert error <= TOLERANCE, error
