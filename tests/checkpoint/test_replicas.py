"""Checkpoints of DiLoCo runs (``zero.outer``): every node's replica and the outer step's state saved
between synchronizations; a resume continues bit for bit (with Streaming DiLoCo's fragments too, each
fragment's residuals under keys of its own); another node count continues saved node k mod N's replica
from the same anchors; a plain run and export take node 0's."""

from __future__ import annotations

import torch
from launcher import run_ranks
from models import ADAM_EPS, global_batch, loss_of, make_model, rows

from zeropp.checkpoint import residuals
from zeropp.checkpoint.dcp import consolidated_state, find_latest, load_checkpoint, save_checkpoint

STEPS, SAVED_AT = 5, 3  # synchronized after steps 2 and 4: the save falls between, with outer momentum
OPTIM = dict(lr=1e-2, eps=ADAM_EPS, weight_decay=0.01)
OUTER = dict(outer_sync_every=2, outer_bits=8, outer_block_size=64)


def _engine(nodes: int, outer: dict):  # `nodes` simulated: the launcher's env sets the ranks
    from zeropp import ZeroEngine
    from zeropp.config.sections import TopologyConfig, ZeroConfig
    from zeropp.topology import init_topology

    topology = init_topology(TopologyConfig(nodes=nodes))
    config = ZeroConfig(stage=3, sequence_check_interval=0, **outer)
    return ZeroEngine(make_model("gpt"), torch.optim.AdamW, OPTIM, config, topology)


def _train(engine, steps: range) -> None:
    for step in steps:
        x, y = rows(global_batch("gpt", step, 0, engine.topology.world_size), engine.topology.rank)
        engine.backward(loss_of("gpt", engine, x, y))
        assert engine.step()


def _outer_state(engine) -> list[torch.Tensor]:
    outer = engine.outer
    momentum = [outer.optimizer.state[a]["momentum_buffer"] for a in outer.anchors]
    return [t.clone() for t in (*outer.anchors, *momentum, *outer.residuals().values())]


def save_and_resume_worker(root: str, outer: dict = OUTER) -> dict:
    engine = _engine(2, outer)
    _train(engine, range(SAVED_AT))
    save_checkpoint(engine, root, SAVED_AT)
    at_save = engine.full_state_dict()
    _train(engine, range(SAVED_AT, STEPS))
    through, outer_through = engine.full_state_dict(), _outer_state(engine)
    resumed = _engine(2, outer)
    load_checkpoint(resumed, find_latest(root))
    _train(resumed, range(SAVED_AT, STEPS))
    return dict(
        node=engine.topology.node_of(engine.topology.rank),
        residual_keys=sorted(residuals.to_save(engine)),
        at_save=at_save,
        bit_identical=all(torch.equal(through[k], v) for k, v in resumed.full_state_dict().items()),
        outer_identical=all(torch.equal(a, b) for a, b in zip(outer_through, _outer_state(resumed), strict=True)),
    )


def resume_worker(root: str, simulated_nodes: int, outer: dict) -> dict:
    """The masters as loaded (before any step), and with the outer loop the anchors, read the same way."""
    engine = _engine(simulated_nodes, outer)
    load_checkpoint(engine, find_latest(root))
    masters, anchors = engine.full_state_dict(), None
    if engine.outer is not None:
        for unit, anchor in zip(engine.units, engine.outer.anchors, strict=True):
            unit.master.data.copy_(anchor)
        anchors = engine.full_state_dict()
    return dict(masters=masters, anchors=anchors)


def test_a_diloco_checkpoint_resumes_bit_for_bit_on_any_node_count_and_exports_node_0(tmp_path, capfd):
    root = str(tmp_path / "ckpt")
    results = run_ranks(save_and_resume_worker, 4, nodes=2, root=root)
    for rank, result in enumerate(results):
        assert result["bit_identical"] and result["outer_identical"], rank
    saved = {r["node"]: r["at_save"] for r in results}
    assert max((saved[0][k] - saved[1][k]).abs().max().item() for k in saved[0]) > 1e-4  # the replicas differ
    # four nodes of one rank: node k continues saved node k mod 2's replica, every node from the same
    # anchors (the weights both replicas were synchronized to at step 2)
    capfd.readouterr()
    four = run_ranks(resume_worker, 4, nodes=4, root=root, simulated_nodes=4, outer=OUTER)
    note = "holds DiLoCo replicas of 2 nodes; this run continues on its node k saved node k mod 2's"
    assert note in capfd.readouterr().out
    for rank, result in enumerate(four):
        assert all(torch.equal(result["masters"][k], saved[rank % 2][k]) for k in saved[0]), rank
        assert all(torch.equal(result["anchors"][k], four[0]["anchors"][k]) for k in saved[0]), rank
    assert any(not torch.equal(four[0]["anchors"][k], saved[0][k]) for k in saved[0])  # step 3 moved node 0
    # a plain run, and export, take node 0's replica
    plain = run_ranks(resume_worker, 2, root=root, simulated_nodes=1, outer={})
    assert all(torch.equal(plain[0]["masters"][k], saved[0][k]) for k in saved[0])
    _, exported = consolidated_state(find_latest(root))
    assert all(torch.equal(exported[k], saved[0][k]) for k in saved[0])


def test_streaming_fragments_and_qgz_inside_the_nodes_resume_bit_for_bit_with_their_residuals(tmp_path, capfd):
    # H = 2, F = 2: fragment 0 synchronized after steps 1, 3 and 5, fragment 1 after 2 and 4; saved after 3;
    # qgZ with LoCo's error feedback inside each node (its residuals' rows: the node's ranks)
    outer = dict(OUTER, outer_fragments=2, quantized_gradients=True, gradient_error_feedback="loco")
    results = run_ranks(save_and_resume_worker, 4, nodes=2, root=str(tmp_path / "ckpt"), outer=outer)
    for rank, result in enumerate(results):
        assert result["bit_identical"] and result["outer_identical"], rank
        hops = ("gather", "inter")
        outer_keys = [f"outer_residual.rank{rank}.fragment{f}.{h}" for f in (0, 1) for h in hops]
        assert [k for k in result["residual_keys"] if k.startswith("outer_")] == outer_keys
        assert any(k.startswith(f"qgz_residual.rank{rank}.") for k in result["residual_keys"])  # qgZ's, loaded too
    # resumed with one fragment: the fragments' outer residuals have no place here, and rank 0 says so
    capfd.readouterr()
    plain = dict(OUTER, quantized_gradients=True, gradient_error_feedback="loco")
    run_ranks(resume_worker, 4, nodes=2, root=str(tmp_path / "ckpt"), simulated_nodes=2, outer=plain)
    said = [line for line in capfd.readouterr().out.splitlines() if "error-feedback residuals" in line]
    assert len(said) == 1 and said[0].startswith("zeropp: 4 of this rank's "), said  # the 2 fragments' 2 hops
