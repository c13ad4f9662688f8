"""The user's own optimizers, on the path each takes: optimizers that read a parameter's shape or norm
on whole parameters (zeropp.zero.optim.owners), param groups with different hyperparameters and
element-wise optimizers on the shards' segments (zeropp.zero.optim.segments), several optimizers over
disjoint parameters on either, train to the weights of one process running torch's own optimizers, at
worlds 1, 2 and 4, stages 1-3; the ledger's exchange bytes are what the owners' layout says; schedulers
on the user's optimizer drive the engine's; a parameter without a gradient is left as torch leaves it."""

from __future__ import annotations

import pytest
import torch
from launcher import run_ranks
from models import ADAM_EPS, STEPS, TOLERANCE, global_batch, loss_of, make_model, rows
from torch import nn

from zeropp.errors import ConfigError
from zeropp.zero.optim.owners import balanced_owners
from zeropp.zero.optim.spec import read_optimizer

# Muon's Newton-Schulz iteration runs in bf16, which turns rounding-level differences of the gradient into
# differences of about 1e-3 in the weights after 5 steps: torch's own Muon, given the same batch's gradient
# as the mean of the ranks' parts instead of whole, lands 1.5e-3 away. Its bound is that distance, measured.
SENSITIVITY_FACTOR = 1.5


class NormalizedDescent(torch.optim.Optimizer):
    """A user's own optimizer that reads each parameter's norm: p -= lr * g / |g|."""

    def __init__(self, params, lr: float = 1e-2) -> None:
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / (p.grad.norm() + 1e-12), alpha=-group["lr"])


def three_adamw_groups(model: nn.Module) -> list[torch.optim.Optimizer]:
    """Embeddings at their own rate and betas, matrices decayed, vectors not."""
    named = list(model.named_parameters())
    embeddings = [p for n, p in named if n.startswith(("wte", "wpe"))]
    matrices = [p for n, p in named if p.dim() == 2 and not n.startswith(("wte", "wpe"))]
    vectors = [p for _, p in named if p.dim() < 2]
    return [
        torch.optim.AdamW(
            [
                {"params": embeddings, "lr": 3e-3, "betas": (0.8, 0.95), "weight_decay": 0.0},
                {"params": matrices, "lr": 1e-3, "weight_decay": 0.1},
                {"params": vectors, "lr": 2e-3, "betas": (0.9, 0.99), "weight_decay": 0.0},
            ],
            eps=ADAM_EPS,
        )
    ]


def muon_and_adamw(model: nn.Module) -> list[torch.optim.Optimizer]:
    """Muon for the blocks' matrices, AdamW for the rest (Moonlight's recipe)."""
    named = list(model.named_parameters())
    hidden = [p for n, p in named if n.startswith("blocks") and p.dim() == 2]
    rest = [p for n, p in named if not (n.startswith("blocks") and p.dim() == 2)]
    return [torch.optim.Muon(hidden, lr=2e-2, momentum=0.9), torch.optim.AdamW(rest, lr=1e-3, eps=ADAM_EPS)]


def sgd_and_rmsprop(model: nn.Module) -> list[torch.optim.Optimizer]:
    """Nesterov SGD for the matrices in two groups, RMSprop for the rest: element-wise, on segments."""
    named = list(model.named_parameters())
    embeddings = [p for n, p in named if n.startswith(("wte", "wpe"))]
    matrices = [p for n, p in named if p.dim() == 2 and not n.startswith(("wte", "wpe"))]
    vectors = [p for _, p in named if p.dim() < 2]
    groups = [{"params": embeddings, "lr": 5e-2}, {"params": matrices, "weight_decay": 1e-2}]
    sgd = torch.optim.SGD(groups, lr=2e-2, momentum=0.9, nesterov=True)
    return [sgd, torch.optim.RMSprop(vectors, lr=1e-3, momentum=0.5)]


OPTIMIZERS = {  # name: (build, tolerance; None: torch's own sensitivity to the gradient's rounding)
    "adamw-3-groups": (three_adamw_groups, TOLERANCE),
    "sgd-nesterov+rmsprop": (sgd_and_rmsprop, TOLERANCE),
    "adafactor": (lambda m: [torch.optim.Adafactor(m.parameters(), lr=1e-2)], TOLERANCE),
    "muon+adamw": (muon_and_adamw, None),
    "custom-norm": (lambda m: [NormalizedDescent(m.parameters(), lr=1e-2)], TOLERANCE),
}


def reference(build, world: int, parts: int = 1) -> dict[str, torch.Tensor]:
    """One process on the global batch; `parts` > 1: its gradient as the mean of that many parts' gradients."""
    model = make_model("gpt")
    optimizers = build(model)
    for step in range(STEPS):
        x, y = global_batch("gpt", step, 0, world)
        grads = []
        for part in zip(x.chunk(parts), y.chunk(parts), strict=True):
            for optimizer in optimizers:
                optimizer.zero_grad()
            loss_of("gpt", model, *part).backward()
            grads.append([p.grad for p in model.parameters()])
        for p, *each in zip(model.parameters(), *grads, strict=True):
            p.grad = torch.stack(each).mean(0)
        for optimizer in optimizers:
            optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def distance(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    return max((ours[k] - ref[k]).abs().max().item() for k in ref)


def train(engine, topology, steps: range = range(STEPS), kind: str = "gpt", per_rank: int = 2) -> None:
    """`steps` of this rank's rows of each step's global batch (world size x `per_rank` rows)."""
    for step in steps:
        x, y = rows(global_batch(kind, step, 0, topology.world_size, per_rank), topology.rank, per_rank)
        engine.backward(loss_of(kind, engine, x, y))
        engine.step()


def expected_exchange_bytes(engine) -> int:
    """What the ranks send together one way per step: every element held by a rank other than its owner, fp32
    (none on the segments)."""
    whole = engine.whole
    total = 0
    if whole is None:
        return 0
    for k, i in whole.keys:
        unit, owner = engine.units[k], whole.owner[(k, i)]
        start, stop = unit.layout.param_range(i)
        held = unit.layout.shard_range(owner) if unit.shard_world > 1 else (0, unit.layout.padded_numel)
        total += 4 * ((stop - start) - max(0, min(stop, held[1]) - max(start, held[0])))
    return total


def train_every_optimizer() -> dict[str, tuple[float, float, int, int]]:
    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.topology import init_topology

    topology = init_topology()
    results = {}
    for name, (build, tolerance) in OPTIMIZERS.items():
        ref = reference(build, topology.world_size)
        if tolerance is None:
            tolerance = SENSITIVITY_FACTOR * distance(reference(build, topology.world_size, parts=2), ref)
        for stage in (1, 2, 3):
            model = make_model("gpt")
            engine = ZeroEngine(model, build(model), None, ZeroConfig(stage=stage), topology)
            train(engine, topology)
            error = distance(engine.full_state_dict(), ref)
            ledger = engine.comm.ledger.bytes
            sent = sum(v for (op, _, _), v in ledger.items() if op == "to_owners") // STEPS
            back = sum(v for (op, _, _), v in ledger.items() if op == "from_owners") // STEPS
            results[f"{name}-stage{stage}"] = (error, tolerance, sent + back, expected_exchange_bytes(engine))
    return results


@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_optimizer_trains_to_the_weights_of_one_process(world):
    by_rank = run_ranks(train_every_optimizer, world)
    results = by_rank[0]
    assert len(results) == 3 * len(OPTIMIZERS)
    errors = {name: error for name, (error, tolerance, _, _) in results.items() if error > tolerance}
    assert not errors, errors
    for name in results:  # the ranks' bytes together, one way and back, are the layout's (none on one rank)
        sent = sum(r[name][2] for r in by_rank)
        whole = name.startswith(("adafactor", "muon", "custom"))
        assert sent == 2 * results[name][3] and (sent > 0) == (world > 1 and whole), (name, sent, results[name][3])


def test_owners_are_balanced_by_bytes_and_the_same_everywhere():
    assert balanced_owners([10, 1, 1, 8, 2], 2) == [0, 0, 1, 1, 1]  # loads 11 and 11
    assert balanced_owners([5, 5, 5, 5], 4) == [0, 1, 2, 3]
    assert balanced_owners([], 3) == []


def test_which_path_each_form_takes():
    from zeropp import ZeroConfig
    from zeropp.zero.optim.spec import optimizer_path

    model = make_model("gpt")

    def path(optimizer, kwargs=None, **config) -> str:
        return optimizer_path(read_optimizer(optimizer, kwargs, model), ZeroConfig(**config))

    assert path(torch.optim.AdamW, {"lr": 1e-3}) == "segments"
    assert path(torch.optim.AdamW(model.parameters(), lr=1e-3)) == "segments"
    assert path(three_adamw_groups(model)) == "segments"
    assert path(sgd_and_rmsprop(model)) == "segments"
    assert path(torch.optim.AdamW, {"lr": 1e-3}, optimizer_path="flat") == "flat"
    assert path(torch.optim.AdamW, {"lr": 1e-3}, optimizer_state_dtype="bf16") == "flat"
    assert path(torch.optim.AdamW, {"lr": 1e-3}, optimizer_path="whole") == "whole"
    assert path(torch.optim.Adafactor, {"lr": 1e-2}) == "whole"
    assert path(lambda ps: torch.optim.Muon(ps)) == "whole"
    spec = read_optimizer(muon_and_adamw(model), None, model)
    assert optimizer_path(spec, ZeroConfig()) == "whole" and spec.described == "Muon + AdamW"
    refused = _one_line(lambda: path(three_adamw_groups(model), optimizer_path="flat"))
    assert refused.startswith("zero.optimizer_path = 'flat' steps one element-wise optimizer") and "3 group" in refused
    refused = _one_line(lambda: path(torch.optim.Adafactor, {}, offload_optimizer="nvme", offload_path="/tmp"))
    assert refused.startswith("zero.offload_optimizer = 'nvme'") and "does not step element by element" in refused


def _one_line(fn) -> str:
    with pytest.raises(ConfigError) as refused:
        fn()
    assert "\n" not in str(refused.value)
    return str(refused.value)


def test_bad_optimizers_are_refused_in_one_line():
    model, other = make_model("gpt"), make_model("gpt")
    params = list(model.parameters())
    assert "is in optimizer 0" in _one_line(
        lambda: read_optimizer([torch.optim.AdamW(params), torch.optim.SGD(params[:1])], None, model)
    )
    assert "is in no optimizer" in _one_line(lambda: read_optimizer(torch.optim.AdamW(params[1:]), None, model))
    assert "is not the model's" in _one_line(lambda: read_optimizer(torch.optim.AdamW(other.parameters()), None, model))
    empty = torch.optim.AdamW(params)
    empty.add_param_group({"params": [], "lr": 1.0})
    assert "param group 1 holds no parameters" in _one_line(lambda: read_optimizer(empty, None, model))
    assert "closure" in _one_line(lambda: read_optimizer(torch.optim.LBFGS, {}, model))
    assert "sparse" in _one_line(lambda: read_optimizer(torch.optim.SparseAdam, {}, model))
    assert "kwargs" in _one_line(lambda: read_optimizer(torch.optim.AdamW(params), {"lr": 1.0}, model))


def _no_collective(*args, **kwargs):
    raise AssertionError("a process group was started before the optimizer was read")


def test_the_engine_refuses_a_bad_optimizer_before_any_process_group(monkeypatch):
    from zeropp import ZeroConfig, ZeroEngine

    monkeypatch.setattr(torch.distributed, "init_process_group", _no_collective)
    model = make_model("gpt")
    with pytest.raises(ConfigError, match="is in no optimizer"):
        ZeroEngine(model, torch.optim.AdamW(list(model.parameters())[1:]), None, ZeroConfig(stage=3))


def _scheduled(build, engine_of=None) -> dict[str, torch.Tensor]:
    """STEPS steps under a scheduler built on the user's optimizers, by one process or (engine_of) by the engine."""
    model = make_model("gpt")
    optimizers = build(model)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1.0 / (1 + step)) for o in optimizers]
    engine = engine_of(model, optimizers) if engine_of else None
    for step in range(STEPS):
        x, y = global_batch("gpt", step, 0, 1)
        if engine is None:
            for optimizer in optimizers:
                optimizer.zero_grad()
            loss_of("gpt", model, x, y).backward()
            for optimizer in optimizers:
                optimizer.step()
        else:
            engine.backward(loss_of("gpt", engine, x, y))
            engine.step()
        for scheduler in schedulers:
            scheduler.step()
    return engine.full_state_dict() if engine else {k: v.detach().clone() for k, v in model.state_dict().items()}


def schedulers_drive_the_engine() -> dict[str, float]:
    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.topology import init_topology

    topology = init_topology()
    builds = {
        "adamw (segments)": lambda m: [torch.optim.AdamW(m.parameters(), lr=1e-2, eps=ADAM_EPS)],
        "adafactor (whole)": lambda m: [torch.optim.Adafactor(m.parameters(), lr=1e-2)],
    }
    errors = {}
    for name, build in builds.items():
        ours = _scheduled(build, lambda m, o: ZeroEngine(m, o, None, ZeroConfig(stage=3), topology))
        errors[name] = distance(ours, _scheduled(build))
    return errors


def test_a_scheduler_on_the_users_optimizer_drives_the_engine():
    errors = run_ranks(schedulers_drive_the_engine, 1)[0]
    assert len(errors) == 2 and all(e <= TOLERANCE for e in errors.values()), errors


CHECKPOINTED = {"adafactor": OPTIMIZERS["adafactor"], "adamw-3-groups": OPTIMIZERS["adamw-3-groups"]}
SAVED_AT = 3


def save_and_resume(folder: str, stage: int) -> dict[str, float]:
    """At this world size and `stage`: steps 0-2, save; a fresh engine loads and runs steps 3-4 (and, at
    world 2, against the same engine run straight through: bit for bit)."""
    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.checkpoint import load_checkpoint, save_checkpoint
    from zeropp.topology import init_topology

    topology = init_topology()
    per_rank = 4 // topology.world_size  # the same 4-row global batch at every world size
    distances = {}
    for name, (build, _) in CHECKPOINTED.items():
        path = f"{folder}/{name}"
        if topology.world_size == 2:
            model = make_model("gpt")
            straight = ZeroEngine(model, build(model), None, ZeroConfig(stage=3), topology)
            train(straight, topology, range(SAVED_AT), per_rank=per_rank)
            save_checkpoint(straight, path, SAVED_AT)
            train(straight, topology, range(SAVED_AT, STEPS), per_rank=per_rank)
        model = make_model("gpt")
        resumed = ZeroEngine(model, build(model), None, ZeroConfig(stage=stage), topology)
        load_checkpoint(resumed, f"{path}/step-{SAVED_AT:08d}")
        train(resumed, topology, range(SAVED_AT, STEPS), per_rank=per_rank)
        ours = resumed.full_state_dict()
        if topology.world_size == 2:
            distances[f"{name}: resumed against straight"] = distance(ours, straight.full_state_dict())
        distances[f"{name}: against one process"] = distance(ours, reference(build, 2))
    return distances


def test_the_whole_parameter_path_saves_resumes_bit_for_bit_and_reshards(tmp_path):
    same = run_ranks(save_and_resume, 2, folder=str(tmp_path), stage=3)[0]
    assert all(same[f"{name}: resumed against straight"] == 0.0 for name in CHECKPOINTED), same
    resharded = run_ranks(save_and_resume, 4, folder=str(tmp_path), stage=1)[0]  # world 2 -> 4, stage 3 -> 1
    assert all(d <= TOLERANCE for d in (*same.values(), *resharded.values())), (same, resharded)


def edge_adamw(model: nn.Module) -> list[torch.optim.Optimizer]:
    """Decay on the matrices, none elsewhere: two groups."""
    matrices = [p for p in model.parameters() if p.requires_grad and p.dim() == 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.dim() != 2]
    return [torch.optim.AdamW([{"params": matrices}, {"params": rest, "weight_decay": 0.0}], lr=1e-2, eps=ADAM_EPS)]


def plain_adamw(model: nn.Module) -> list[torch.optim.Optimizer]:
    return [torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, eps=ADAM_EPS)]


EDGE_CASES = {  # name: (optimizer, zero.optimizer_path, whether it moves the unused parameters)
    "two groups": (edge_adamw, "auto", False),
    "one group": (plain_adamw, "auto", False),
    "one group, optimizer_path whole": (plain_adamw, "whole", False),
    "one group, optimizer_path flat": (plain_adamw, "flat", True),  # DeepSpeed's way: a zero gradient
}


def train_edge_model(folder: str) -> dict[str, float]:
    """The model's never-called layer and module get no gradient: torch's AdamW skips them (no decay,
    no step), and so do the segments and the owners, where the flat shards step them; a checkpoint of
    the segments' states (the unused parameters' without a step count) resumes bit for bit."""
    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.checkpoint import load_checkpoint, save_checkpoint
    from zeropp.topology import init_topology

    topology = init_topology()
    results = {}
    for case, (optimizer_of, path, _) in EDGE_CASES.items():
        reference = make_model("edge")
        optimizers = optimizer_of(reference)
        for step in range(STEPS):
            x, y = global_batch("edge", step, 0, topology.world_size)
            optimizers[0].zero_grad()
            loss_of("edge", reference, x, y).backward()
            optimizers[0].step()
        start, ref = make_model("edge").state_dict(), reference.state_dict()
        for stage in (1, 3):
            model = make_model("edge")
            config = ZeroConfig(stage=stage, optimizer_path=path)
            engine = ZeroEngine(model, optimizer_of(model), None, config, topology)
            train(engine, topology, range(SAVED_AT), kind="edge")
            if case == "two groups":
                save_checkpoint(engine, f"{folder}/{stage}", SAVED_AT)
                model = make_model("edge")
                resumed = ZeroEngine(model, optimizer_of(model), None, config, topology)
                load_checkpoint(resumed, f"{folder}/{stage}/step-{SAVED_AT:08d}")
                train(resumed, topology, range(SAVED_AT, STEPS), kind="edge")
            train(engine, topology, range(SAVED_AT, STEPS), kind="edge")
            ours = engine.full_state_dict()
            if case == "two groups":
                results[f"{case}, stage{stage} resumed against straight"] = distance(resumed.full_state_dict(), ours)
            results[f"{case}, stage{stage}"] = distance(ours, ref)
            unused = [k for k in ref if k.startswith(("unused.", "layers.3."))]
            results[f"{case}, stage{stage} unused moved"] = max((ours[k] - start[k]).abs().max().item() for k in unused)
    return results


def test_a_parameter_without_a_gradient_is_left_as_torch_leaves_it(tmp_path):
    results = run_ranks(train_edge_model, 2, folder=str(tmp_path))[0]
    for case, (_, _, moves) in EDGE_CASES.items():
        for stage in (1, 3):
            moved = results[f"{case}, stage{stage} unused moved"]
            assert (moved > 1e-5) if moves else (moved == 0.0), (case, stage, results)
            if not moves:
                assert results[f"{case}, stage{stage}"] <= TOLERANCE, (case, stage, results)
    assert all(results[f"two groups, stage{stage} resumed against straight"] == 0.0 for stage in (1, 3)), results


def pretrained_then_trained(folder: str) -> float:
    """Weights loaded after construction (zeropp.checkpoint.load_pretrained) reach the owners' whole masters."""
    from safetensors.torch import save_file

    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.checkpoint.pretrained import load_pretrained
    from zeropp.topology import init_topology

    topology = init_topology()
    pretrained = make_model("gpt")
    with torch.no_grad():
        for p in pretrained.parameters():
            p.mul_(0.5).add_(0.01)
    path = f"{folder}/model.safetensors"
    if topology.rank == 0:
        save_file({k: v.contiguous().clone() for k, v in pretrained.state_dict().items()}, path)
    torch.distributed.barrier()
    build = OPTIMIZERS["adafactor"][0]
    model = make_model("gpt")
    engine = ZeroEngine(model, build(model), None, ZeroConfig(stage=3), topology)
    load_pretrained(engine, path)
    optimizers = build(pretrained)
    for step in range(2):
        x, y = global_batch("gpt", step, 0, topology.world_size)
        optimizers[0].zero_grad()
        loss_of("gpt", pretrained, x, y).backward()
        optimizers[0].step()
        x, y = rows((x, y), topology.rank)
        engine.backward(loss_of("gpt", engine, x, y))
        engine.step()
    return distance(engine.full_state_dict(), pretrained.state_dict())


def test_weights_loaded_after_construction_reach_the_owners(tmp_path):
    assert run_ranks(pretrained_then_trained, 2, folder=str(tmp_path))[0] <= TOLERANCE
