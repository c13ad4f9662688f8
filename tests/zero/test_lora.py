"""LoRA (peft) through the engine: the adapters are sharded at every stage, the frozen base at stage 3
(below it stays whole on every rank), and every stage at world 2 trains the adapters to the weights of
one process (fp32, 1e-5)."""

from __future__ import annotations

import math

import pytest
import torch
from launcher import run_ranks
from models import ADAM_EPS, STEPS, TOLERANCE, global_batch, loss_of, make_model, reference_state, rows
from safetensors.torch import load_file

pytest.importorskip("peft")

OPTIM = dict(lr=1e-2, eps=ADAM_EPS, weight_decay=0.01)


def lora_model() -> torch.nn.Module:
    """The tiny Llama of tests/models.py with rank-4 LoRA adapters on q_proj and v_proj (seeded)."""
    import peft

    model = make_model("hf-llama")
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    return peft.get_peft_model(model, config)


def lora_worker() -> dict[int, float]:
    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.topology import init_topology

    topology = init_topology()
    errors = {}
    for stage in (1, 2, 3):
        engine = ZeroEngine(
            lora_model(), torch.optim.AdamW, OPTIM, ZeroConfig(stage=stage, persistence_threshold=0), topology
        )
        for step in range(STEPS):
            x, _ = rows(global_batch("hf-llama", step, 0, topology.world_size), topology.rank)
            engine.backward(loss_of("hf-llama", engine, x, None))
            assert engine.step()
        ours = engine.full_state_dict()
        ref = reference_state("hf-llama", STEPS, topology.world_size, 1, None, OPTIM, model=lora_model())
        assert ours.keys() == ref.keys()
        initial = lora_model().state_dict()
        lora = [k for k in ref if "lora_" in k]
        assert lora and all(not torch.equal(ours[k], initial[k]) for k in lora)  # trained
        errors[stage] = max((ours[k] - ref[k]).abs().max().item() for k in ref)
    return errors


def test_lora_at_every_stage_matches_single_process_lora():
    for errors in run_ranks(lora_worker, 2):
        assert all(error <= TOLERANCE for error in errors.values()), errors


def sharded_base_worker() -> dict[str, float]:
    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.comm.ledger import Ledger
    from zeropp.costs.volume import frozen_transfers, unit_transfers
    from zeropp.topology import init_topology

    topology, ledger = init_topology(), Ledger()
    config = ZeroConfig(stage=3, persistence_threshold=0, precision="fp32")
    engine = ZeroEngine(lora_model(), torch.optim.AdamW, OPTIM, config, topology, ledger=ledger)
    base = {n: p.numel() for n, p in lora_model().named_parameters() if not p.requires_grad}
    frozen = [u.frozen for u in engine.units if u.frozen is not None]
    assert sum(len(f.params) for f in frozen) == len(base)  # every frozen parameter is in a unit
    gathered = _gathered_per_phase(engine, ledger, topology)
    layout = topology.layout
    units = [(u.layout.padded_numel, u.resident) for u in engine.units if u.params]
    expected = [
        *unit_transfers(units, layout, config, 1),
        *frozen_transfers([f.layout.padded_numel for f in frozen], layout, config, 1),
    ]
    predicted = {
        phase: sum(t.sent for t in expected if t.op == "all_gather" and t.phase == phase) for phase in gathered
    }
    frozen_only = sum(t.sent for t in frozen_transfers([f.layout.padded_numel for f in frozen], layout, config, 1))
    ours = engine.full_state_dict()
    ref = reference_state("hf-llama", STEPS, topology.world_size, 1, None, OPTIM, model=lora_model())
    return dict(
        error=max((ours[k] - ref[k]).abs().max().item() for k in ref),
        base_bytes=4 * sum(base.values()),
        shard_bytes=sum(f.shard.numel() * f.shard.element_size() for f in frozen),
        held_bytes=sum(f.flat.untyped_storage().nbytes() for f in frozen),  # between uses: nothing gathered
        gathered=gathered,
        predicted=predicted,
        frozen_gathered=frozen_only,
        world=topology.world_size,
    )


def test_lora_at_stage_3_shards_the_frozen_base_and_gathers_it_per_use():
    for rank in run_ranks(sharded_base_worker, 2):
        assert rank["error"] <= TOLERANCE, rank
        assert rank["held_bytes"] == 0
        # each rank keeps its half of the base (padding aside), not the whole
        assert rank["base_bytes"] / 2 <= rank["shard_bytes"] <= rank["base_bytes"] / 2 * 1.05, rank
        assert rank["gathered"] == rank["predicted"], rank  # the ledger's forward and backward gathers
        print(rank)


def pretrained_worker(path: str) -> dict[str, float]:
    from safetensors.torch import load_file

    import zeropp.checkpoint.pretrained as pretrained
    from zeropp import ZeroConfig, ZeroEngine, load_pretrained
    from zeropp.topology import init_topology

    topology = init_topology()
    engine = ZeroEngine(lora_model(), torch.optim.AdamW, OPTIM, ZeroConfig(stage=3, persistence_threshold=0), topology)
    read, counted = pretrained._read_elements, []

    def counting(handle, key, start, stop, *block):  # what this rank reads of the units' parameters
        rows = read(handle, key, start, stop, *block)
        counted.append(rows.numel())
        return rows

    pretrained._read_elements = counting
    load_pretrained(engine, path)
    pretrained._read_elements = read
    expected, loaded = load_file(path), engine.full_state_dict()
    shards = sum(u.master.numel() + (u.frozen.shard.numel() if u.frozen else 0) for u in engine.units)
    error = max((loaded[k] - expected[k]).abs().max().item() for k in expected)
    return dict(error=error, keys=float(loaded.keys() != expected.keys()), beyond=float(sum(counted) > shards))


def test_load_pretrained_reads_each_ranks_piece_of_the_frozen_base(tmp_path):
    from safetensors.torch import save_file

    model = lora_model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))  # nothing like a fresh initialization
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "w.safetensors"))
    for rank in run_ranks(pretrained_worker, 2, path=str(tmp_path / "w.safetensors")):
        assert all(value == 0.0 for value in rank.values()), rank


def meta_peft_worker(path: str) -> dict[str, float]:
    """A PeftModel built on the meta device, its base loaded after construction: the adapters start as
    peft starts them (B zero, A Kaiming-uniform) with no initializer given, and it trains to the weights
    of one process started from the same values."""
    from zeropp import ZeroConfig, ZeroEngine, load_pretrained
    from zeropp.checkpoint.pretrained import base_name
    from zeropp.topology import init_topology

    topology = init_topology()
    with torch.device("meta"):
        model = lora_model()
    engine = ZeroEngine(model, torch.optim.AdamW, OPTIM, ZeroConfig(stage=3, persistence_threshold=0), topology)
    load_pretrained(engine, path, base_only=True)
    start = engine.full_state_dict()
    file = load_file(path)
    lora = [k for k in start if "lora_" in k]
    bound = 1 / math.sqrt(32)  # kaiming_uniform_(a=sqrt(5)) over the 32 inputs of q_proj / v_proj
    for step in range(STEPS):
        x, _ = rows(global_batch("hf-llama", step, 0, topology.world_size), topology.rank)
        engine.backward(loss_of("hf-llama", engine, x, None))
        engine.step()
    reference = lora_model()
    reference.load_state_dict(start)
    ref = reference_state("hf-llama", STEPS, topology.world_size, 1, None, OPTIM, model=reference)
    ours = engine.full_state_dict()
    return dict(
        lora=float(len(lora)),
        base=max((start[k] - file[base_name(k)]).abs().max().item() for k in start if "lora_" not in k),
        b_nonzero=float(sum(int(start[k].any()) for k in lora if "lora_B" in k)),
        a_outside=float(sum(int(not 0.5 * bound < start[k].abs().max() <= bound) for k in lora if "lora_A" in k)),
        trained=max((ours[k] - ref[k]).abs().max().item() for k in ref),
    )


def test_a_peft_model_built_on_meta_starts_as_peft_does_and_loads_its_base(tmp_path):
    from safetensors.torch import save_file

    base = make_model("hf-llama")  # the base model's own weights, under its own names
    with torch.no_grad():
        for p in base.parameters():
            p.add_(0.1 * torch.randn_like(p))  # nothing like a fresh initialization
    save_file({k: v.contiguous() for k, v in base.state_dict().items()}, str(tmp_path / "w.safetensors"))
    for rank in run_ranks(meta_peft_worker, 2, path=str(tmp_path / "w.safetensors")):
        assert rank["lora"] == 8 and rank["base"] == 0.0 and rank["b_nonzero"] == rank["a_outside"] == 0, rank
        assert rank["trained"] <= TOLERANCE, rank


def test_a_peft_init_that_reads_the_base_is_refused_on_meta_in_one_line():
    import peft

    from zeropp.zero.materialize import MaterializeError, default_init

    with torch.device("meta"):
        config = peft.LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights="pissa")
        model = peft.get_peft_model(make_model("hf-llama"), config)
    with pytest.raises(MaterializeError, match="init_lora_weights = 'pissa', which reads the base weights") as error:
        default_init(model)
    assert "\n" not in str(error.value)


def dequantized_base(model: torch.nn.Module, world: int, bits: int) -> torch.nn.Module:
    """`model` with its frozen weights quantized and dequantized as the engine stores them with
    quantized_nontrainable_weights: per unit, every rank's shard of the frozen flat buffer one row of
    `bits`-bit values."""
    from zeropp import ZeroConfig
    from zeropp.index.flat import FlatLayout
    from zeropp.quant.backends import kernels_for
    from zeropp.quant.spec import QuantSpec
    from zeropp.zero.grouping import group_parameters, repeated_blocks

    config, kernels = ZeroConfig(), kernels_for(torch.device("cpu"))
    spec = QuantSpec(bits, config.qwz.block)
    for _, params in group_parameters(model, repeated_blocks(model), frozen=True):
        frozen = [p for _, p in params if not p.requires_grad]
        layout = FlatLayout(tuple(tuple(p.shape) for p in frozen), world, config.shard_alignment, spec.block_size)
        full = layout.join(frozen, torch.float32, torch.device("cpu")).view(world, -1)
        values = kernels.dequantize(kernels.quantize(full, spec), torch.float32).reshape(-1)
        with torch.no_grad():
            for p, value in zip(frozen, layout.split(values), strict=True):
                p.copy_(value)
    return model


def quantized_base_worker(bits: int, hpz: int, simulated_nodes: int) -> dict[str, float]:
    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.comm.ledger import Ledger
    from zeropp.config.sections import TopologyConfig
    from zeropp.costs.memory import analytic_model_state_bytes
    from zeropp.costs.volume import frozen_transfers, unit_transfers
    from zeropp.topology import init_topology
    from zeropp.zero.options import frozen_quant

    topology, ledger = init_topology(TopologyConfig(nodes=simulated_nodes)), Ledger()
    config = ZeroConfig(
        stage=3, persistence_threshold=0, quantized_nontrainable_weights=True, nontrainable_weight_bits=bits,
        hpz_partition_size=hpz,
    )  # fmt: skip
    engine = ZeroEngine(lora_model(), torch.optim.AdamW, OPTIM, config, topology, ledger=ledger)
    frozen = [u.frozen for u in engine.units if u.frozen is not None]
    gathered = _gathered_per_phase(engine, ledger, topology)
    layout, padded = topology.layout, [f.layout.padded_numel for f in frozen]
    group = layout.hpz_group_size(hpz)
    units = [(u.layout.padded_numel, u.resident) for u in engine.units if u.params]
    predicted = [
        t for t in (*unit_transfers(units, layout, config, group), *frozen_transfers(padded, layout, config, group))
        if t.op == "all_gather" and t.phase != "step"
    ]  # fmt: skip
    ours = engine.full_state_dict()
    world = topology.world_size
    ref = reference_state("hf-llama", STEPS, world, 1, None, OPTIM, model=dequantized_base(lora_model(), world, bits))
    base = {k: v for k, v in lora_model().state_dict().items() if "lora_" not in k and k in ref}
    frozen_numel = sum(padded)

    def analytic(**quant) -> float:  # Table 1's frozen terms alone (no trainable parameter)
        return analytic_model_state_bytes(0, world, 3, "fp32", hpz_group_size=group, frozen=frozen_numel, **quant)

    return dict(
        error=max((ours[k] - ref[k]).abs().max().item() for k in ref),
        rounded=max((ours[k] - v).abs().max().item() for k, v in base.items()),  # quantization moved the base
        held=sum(f.message.numel() + (f.secondary.numel() if f.secondary is not None else 0) for f in frozen),
        held_predicted=analytic(frozen_quant=frozen_quant(config)),
        held_plain=analytic(),
        blocks=sum(math.ceil(f.layout.shard_numel / config.qwz.block_size) for f in frozen),
        gathered=gathered,
        predicted={phase: sum(t.sent for t in predicted if t.phase == phase) for phase in gathered},
        frozen_gathered=sum(t.sent for t in frozen_transfers(padded, layout, config, group)),
        plain_frozen=sum(t.sent for t in frozen_transfers(padded, layout, ZeroConfig(stage=3), group)),
        secondary_rows=[f.secondary.numel() / f.message.numel() for f in frozen if f.secondary is not None],
        inter_backward=ledger.total(op="all_gather", phase="backward", link="inter"),
    )


@pytest.mark.parametrize(("bits", "hpz", "nodes"), [(8, 1, 1), (4, 1, 1), (4, 2, 2)], ids=["int8", "int4", "int4-hpz"])
def test_quantized_frozen_weights_equal_one_process_on_the_dequantized_base(bits, hpz, nodes):
    """int8 or int4 frozen shards at world 2, and at world 4 as 2 nodes x 2 with hpZ's copy of them
    stored quantized too (each rank two rows' messages, gathered inside the node)."""
    world = 4 if hpz > 1 else 2
    for rank in run_ranks(quantized_base_worker, world, nodes=nodes, bits=bits, hpz=hpz, simulated_nodes=nodes):
        assert rank["error"] <= TOLERANCE, rank
        assert rank["gathered"] == rank["predicted"], rank  # the ledger's forward and backward gathers
        assert rank["rounded"] > 1e-4, rank
        # bits/8 bytes a weight plus an fp32 scale per block (a unit's last block may be short) against fp32
        secondary = 2 if hpz > 1 else 0
        assert (
            rank["held_predicted"] <= rank["held"] <= rank["held_predicted"] + 4 * rank["blocks"] * (1 + secondary)
        ), rank
        assert rank["held"] <= rank["held_plain"] * (bits / 32 + 0.02), rank
        assert rank["frozen_gathered"] <= rank["plain_frozen"] * (bits / 32 + 0.02), rank
        if hpz > 1:  # the secondary copy: world / hpZ rows' messages, and backward never leaves the node
            assert rank["secondary_rows"] and all(r == world // hpz for r in rank["secondary_rows"]), rank
            assert rank["inter_backward"] == 0, rank
        print(rank)


def variants_worker(root: str) -> dict[str, float]:
    from zeropp import ZeroConfig, ZeroEngine
    from zeropp.checkpoint import load_checkpoint, save_checkpoint
    from zeropp.config.policies import ActivationCheckpointPolicy, OffloadPolicy
    from zeropp.topology import init_topology

    topology = init_topology()
    errors = {}
    variants = {
        "engine-checkpointing": dict(activations=ActivationCheckpointPolicy(enabled=True)),
        "model-checkpointing": {},
        "accumulation": dict(gradient_accumulation_steps=2),
        "offloaded": dict(offload=OffloadPolicy(optimizer="cpu", params="cpu")),
    }
    for name, settings in variants.items():
        model = lora_model()
        if name == "model-checkpointing":  # the block's own recomputation runs its hooks again in backward
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        config = ZeroConfig(stage=3, persistence_threshold=0, **settings)
        engine = ZeroEngine(model, torch.optim.AdamW, OPTIM, config, topology)
        micro = config.gradient_accumulation_steps
        for step in range(STEPS):
            for m in range(micro):
                x, _ = rows(global_batch("hf-llama", step, m, topology.world_size), topology.rank)
                engine.backward(loss_of("hf-llama", engine, x, None))
            assert engine.step()
        ours = engine.full_state_dict()
        ref = reference_state("hf-llama", STEPS, topology.world_size, micro, None, OPTIM, model=lora_model())
        errors[name] = max((ours[k] - ref[k]).abs().max().item() for k in ref)
    # a full checkpoint holds the frozen base (gathered); it loads into another base at stage 3 and at stage 2
    path = save_checkpoint(engine, root, STEPS)
    for stage in (3, 2):
        other = lora_model()
        with torch.no_grad():
            for p in other.parameters():
                p.add_(1.0)
        fresh = ZeroEngine(other, torch.optim.AdamW, OPTIM, ZeroConfig(stage=stage, persistence_threshold=0), topology)
        load_checkpoint(fresh, path)
        loaded = fresh.full_state_dict()
        errors[f"resumed at stage {stage}"] = max((loaded[k] - ours[k]).abs().max().item() for k in ours)
    return errors


def test_lora_at_stage_3_with_recomputation_accumulation_offload_and_checkpoints(tmp_path):
    for errors in run_ranks(variants_worker, 2, root=str(tmp_path)):
        assert all(error <= TOLERANCE for error in errors.values()), errors


def _gathered_per_phase(engine, ledger, topology) -> dict[str, float]:
    """Train STEPS steps; the all-gather bytes of the last step's forward and backward (the ledger's)."""
    for step in range(STEPS):
        x, _ = rows(global_batch("hf-llama", step, 0, topology.world_size), topology.rank)
        ledger.reset()
        engine.backward(loss_of("hf-llama", engine, x, None))
        gathered = {phase: ledger.total(op="all_gather", phase=phase) for phase in ("forward", "backward")}
        assert engine.step()
    return gathered
