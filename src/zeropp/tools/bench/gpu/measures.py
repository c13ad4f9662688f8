"""The measuring stages of ``zeropp bench gpu`` (b exactness, c memory, d speed, f offload overlap).

Each stage is a generator of ``(key, result)`` pairs; ``zeropp bench gpu`` runs it in a process of
its own and writes every result as it comes. A result holding ``"passed": False`` or ``"error"``
fails the stage. ``Sizes`` picks the models: the GPU's, ``--quick`` smaller ones, and on the CPU
(``--allow-cpu``, for development) tiny ones.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from zeropp.app.models.gpt import GPT, GPTConfig
from zeropp.tools.bench.gpu.ranks import first_line, launch, probe_backends, working_backend

Result = Iterator[tuple[str, Any]]
EXACT_STEPS, EXACT_LR, ADAM_EPS, EXACT_BOUND = 5, 1e-2, 1e-4, 1e-5
# ZeRO++ is lossy: its run is compared with the exact reference by the error of the weights' change,
# |(w - w0) - (w_ref - w0)| / |w_ref - w0| (L2 over every weight), which must stay under 1: its weights
# moved towards the reference's (int4 gradients on the tiny GPT give 0.4-0.5 on 2-4 CPU ranks)
ZEROPP_RELATIVE_BOUND = 1.0
EXACT_CONFIG = GPTConfig(block_size=16, n_layer=2, n_head=2, d_model=32)
EXACT_SCENARIOS = {  # name: ZeroConfig fields
    "stage3": {},
    "stage3-zero++": dict(quantized_weights=True, hpz_partition_size=0, quantized_gradients=True),
    "stage3-offload-cpu": dict(offload_optimizer="cpu"),
    "stage3-in-backward": dict(step_in_backward=True),  # the worker's kernels after the gradient's event
    "stage3-offload-cpu-in-backward": dict(offload_optimizer="cpu", step_in_backward=True),
    "stage3-Pa+cpu": dict(activation_checkpointing=True, partition_activations=True, cpu_checkpointing=True),
    "stage3-zero++-qwd": dict(
        quantized_weights=True,
        weight_quantization="delta",
        weight_bits=4,
        hpz_partition_size=0,
        quantized_gradients=True,
    ),  # fmt: skip
    "stage3-owners-adafactor": {},  # OWN_OPTIMIZERS
}
ACROSS_NODES_ONLY = {"stage3-zero++-qwd"}  # qWD's reference is hpZ's copy: refused on one node
# scenarios with an optimizer of their own, built on the model's parameters (reference and engine alike):
# Adafactor reads each parameter's shape, so the engine steps whole parameters on owner ranks
OWN_OPTIMIZERS = {"stage3-owners-adafactor": lambda params: torch.optim.Adafactor(params, lr=EXACT_LR)}


def _adamw(params):
    return torch.optim.AdamW(params, lr=EXACT_LR, eps=ADAM_EPS, weight_decay=0.01)


@dataclass(frozen=True)
class Sizes:
    """The models and step counts of a run."""

    memory: GPTConfig
    memory_batch: int
    speed: GPTConfig
    speed_batch: int
    offload: GPTConfig
    offload_batch: int
    reps: int
    steps: int  # timed steps per variant and repetition (after one warm-up)

    @staticmethod
    def pick(device_kind: str, quick: bool) -> Sizes:
        if device_kind == "cpu":
            tiny = GPTConfig(block_size=32, n_layer=2, n_head=2, d_model=64)
            return Sizes(tiny, 2, tiny, 2, tiny, 2, reps=2, steps=2)
        if quick:
            mid = GPTConfig(block_size=512, n_layer=8, n_head=8, d_model=1024)
            return Sizes(mid, 4, mid, 4, GPTConfig(block_size=256, n_layer=6, n_head=8, d_model=512), 4, 2, 3)
        memory = GPTConfig(block_size=512, n_layer=12, n_head=16, d_model=1024)
        speed = GPTConfig(block_size=1024, n_layer=24, n_head=16, d_model=2048)  # ~1.2B parameters
        return Sizes(memory, 2, speed, 8, GPTConfig(block_size=512, n_layer=12, n_head=12, d_model=768), 4, 2, 4)


def _batch(config: GPTConfig, step: int, rows: int, device: torch.device, rank: int = 0, world: int = 1):
    """Step `step`'s global batch of `world * rows` sequences (a fixed seed); this rank's rows on `device`."""
    generator = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, config.vocab_size, (world * rows, config.block_size + 1), generator=generator)
    mine = tokens[rank * rows : (rank + 1) * rows].to(device)
    return mine[:, :-1], mine[:, 1:]


def _exact_model(device: torch.device) -> GPT:
    torch.manual_seed(0)
    return GPT(EXACT_CONFIG).to(device)


def _reference(world: int, device: torch.device, build: Callable = _adamw) -> dict[str, torch.Tensor]:
    """One process, plain PyTorch, on every rank's rows at once: the weights after EXACT_STEPS."""
    model = _exact_model(device)
    optimizer = build(model.parameters())
    for step in range(EXACT_STEPS):
        x, y = _batch(EXACT_CONFIG, step, 2 * world, device)
        optimizer.zero_grad()
        model(x, y).backward()
        optimizer.step()
    return {k: v.detach().float().cpu() for k, v in model.state_dict().items()}


def _compare(name: str, ours: dict, ref: dict, initial: dict) -> dict[str, Any]:
    """Max |w - w_ref|; for ZeRO++ also the relative error of the change, against its bound."""
    diff = max((ours[k] - ref[k]).abs().max().item() for k in ref)
    if "zero++" not in name:
        return {"max_abs_diff": diff, "bound": EXACT_BOUND, "passed": diff <= EXACT_BOUND}
    error = sum(((ours[k] - ref[k]) ** 2).sum().item() for k in ref) ** 0.5
    change = sum(((ref[k] - initial[k]) ** 2).sum().item() for k in ref) ** 0.5
    relative = error / change
    return {"max_abs_diff": diff, "relative_change_error": relative, "bound": ZEROPP_RELATIVE_BOUND,
            "passed": relative <= ZEROPP_RELATIVE_BOUND}  # fmt: skip


def exactness_rank(topology: Any, scenarios: list[str]) -> dict[str, Any]:
    """Train every scenario on this rank's rows; rank 0 compares with the single-process reference."""
    from zeropp.config.sections import ZeroConfig
    from zeropp.engine import ZeroEngine

    device, world, rank = topology.device, topology.world_size, topology.rank
    refs = {None: _reference(world, device)} if rank == 0 else {}
    initial = {k: v.detach().float().cpu() for k, v in _exact_model(device).state_dict().items()}
    out = {}
    for name in scenarios:
        try:
            config, build = ZeroConfig(stage=3, **EXACT_SCENARIOS[name]), OWN_OPTIMIZERS.get(name, _adamw)
            model = _exact_model(device)
            engine = ZeroEngine(model, build(model.parameters()), None, config, topology)
            for step in range(EXACT_STEPS):
                x, y = _batch(EXACT_CONFIG, step, 2, device, rank, world)
                engine.backward(engine(x, y))
                engine.step()
            ours = {k: v.float().cpu() for k, v in engine.full_state_dict().items()}
            if rank == 0 and name in OWN_OPTIMIZERS:
                refs[name] = _reference(world, device, build)
            out[name] = _compare(name, ours, refs.get(name, refs.get(None)), initial) if rank == 0 else {}
        except Exception as error:  # recorded; the next scenario goes on
            out[name] = {"error": first_line(error)}
    return out


def stage_b(device_kind: str, sizes: Sizes, budget: Callable[[], float]) -> Result:
    """Exactness at world 1, the collective probe on 2 ranks sharing the device, then worlds 2 and 4."""
    scenarios = list(EXACT_SCENARIOS)
    first = "nccl" if device_kind == "cuda" else "gloo"
    yield from _exactness(1, first, device_kind, scenarios, budget)
    answers = probe_backends(device_kind, timeout_s=min(30, budget()))
    backend = working_backend(answers)
    yield "probe", {"backends": answers, "chosen": backend}
    if backend is None:
        yield "world2", {"skipped": "no backend ran every collective on 2 ranks sharing the device"}
        return
    for world in (2, 4):
        yield from _exactness(world, backend, device_kind, scenarios, budget)


def _exactness(world: int, backend: str, device_kind: str, scenarios: list[str], budget: Callable) -> Result:
    nodes = 2 if world == 4 else 1  # world 4: two simulated nodes, so hpZ and qgZ's two hops run
    scenarios = [name for name in scenarios if nodes > 1 or name not in ACROSS_NODES_ONLY]
    try:
        per_scenario = launch(exactness_rank, world, backend, device_kind, budget(), nodes, scenarios=scenarios)[0]
    except RuntimeError as error:
        yield f"world{world}", {"backend": backend, "error": first_line(error)}
        return
    for name, result in per_scenario.items():
        yield f"world{world}/{name}", {"backend": backend, **result}


def _formula(psi: int, world: int, unit_numel: int, prefetch: int, config: GPTConfig, batch: int) -> dict[str, float]:
    """The step's bound from zeropp.costs.memory: 16Ψ/N + 1 + prefetch units gathered (bf16) + on more
    than one rank three units' whole gradients (the unit in backward, two reductions in flight) +
    activation checkpoints."""
    from zeropp.costs.memory import Activations, analytic_model_state_bytes, stage3_transient_bytes

    states = analytic_model_state_bytes(psi, world, 3, "bf16")
    acts = Activations(config.n_layer, config.d_model, config.block_size, batch, activation_checkpointing=True)
    transient = stage3_transient_bytes(largest_gathered=unit_numel, largest_trainable=unit_numel, world=world,
                                       compute_bytes=2, grad_bytes=2, prefetch=prefetch)  # fmt: skip
    return {"model_states": states, **transient,
            "activation_checkpoints": acts.checkpoint_bytes(tp=1, element_bytes=2)}  # fmt: skip


def _backend_staging(backend: str, world: int, unit_numel: int) -> dict[str, float]:
    """gloo on CUDA tensors copies each reduction's input to the host side before it reduces: one unit's
    bf16 gradient for each reduction in flight, allocated inside the collective call (seen in the CUDA
    allocator's history at stage c's world-2 peak, 2026-11-26). NCCL reduces in place; it adds nothing."""
    from zeropp.runtime.reductions import MAX_IN_FLIGHT

    if backend != "gloo" or world == 1:
        return {}
    return {"gloo_reduction_copies": MAX_IN_FLIGHT * unit_numel * 2}


def memory_rank(
    topology: Any, config: GPTConfig, batch: int, optimizer: dict | None = None, collective_backend: str = "nccl"
) -> dict[str, Any]:
    """Peak allocated bytes after construction and during the second step (stage 3, bf16, AC), the
    step's peak split at ``engine.step()``: forward + backward, then the optimizer step (with
    `optimizer`'s AdamW options, e.g. ``fused``), and what is allocated when the step starts."""
    from zeropp.config.sections import ZeroConfig
    from zeropp.engine import ZeroEngine

    device, cuda = topology.device, topology.device.type == "cuda"
    with torch.device("meta"):
        model = GPT(config)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    zero = ZeroConfig(stage=3, precision="bf16", activation_checkpointing=True)
    engine = ZeroEngine(model, torch.optim.AdamW, {"lr": 1e-4, **(optimizer or {})}, zero, topology)
    built = torch.cuda.max_memory_allocated(device) if cuda else None

    def peak_since_reset() -> int | None:
        if not cuda:
            return None
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return peak

    peaks, split = [], {}
    for step in range(2):
        peak_since_reset()
        x, y = _batch(config, step, batch, device, topology.rank, topology.world_size)
        engine.backward(engine(x, y))
        backward_peak = peak_since_reset()
        before_step = torch.cuda.memory_allocated(device) if cuda else None
        engine.step()
        step_peak = peak_since_reset()
        peaks.append(max(backward_peak, step_peak) if cuda else None)
        split = {"backward_peak_bytes": backward_peak, "allocated_at_step_bytes": before_step,
                 "optimizer_step_peak_bytes": step_peak}  # fmt: skip
    unit = max(u.layout.numel for u in engine.units)
    formula = _formula(engine.param_count, topology.world_size, unit, zero.prefetch, config, batch)
    if cuda:
        formula |= _backend_staging(collective_backend, topology.world_size, unit)
    bound = sum(formula.values())
    result = {"psi": engine.param_count, "constructed_bytes": built, "step_peak_bytes": peaks[-1], **split,
              "formula_bytes": bound, "formula": formula, "ratio": peaks[-1] / bound if cuda else None}  # fmt: skip
    result["passed"] = None if not cuda else result["ratio"] <= 1.1
    return result


def stage_c(device_kind: str, sizes: Sizes, budget: Callable[[], float], world2_backend: str | None) -> Result:
    """Measured peak against 1.1 x the formula, at world 1 and (on stage b's backend) world 2."""
    first = "nccl" if device_kind == "cuda" else "gloo"
    runs = ((1, first, "", None), (1, first, "-fused-adamw", {"fused": True}), (2, world2_backend, "", None))
    for world, backend, label, optimizer in runs:
        if optimizer and device_kind != "cuda":
            continue  # fused AdamW is a CUDA kernel
        if backend is None:
            yield f"world{world}{label}", {"skipped": "no backend found by stage b's probe"}
            continue
        try:
            ranks = launch(memory_rank, world, backend, device_kind, budget(), config=sizes.memory,
                           batch=sizes.memory_batch, optimizer=optimizer, collective_backend=backend)  # fmt: skip
            yield f"world{world}{label}", {"backend": backend, "bound": "step peak <= 1.1 x formula", **ranks[0],
                                           "ranks_step_peak_bytes": [r["step_peak_bytes"] for r in ranks]}  # fmt: skip
        except RuntimeError as error:
            yield f"world{world}{label}", {"backend": backend, "error": first_line(error)}


SPEED_VARIANTS = ("pytorch", "zeropp-3", "zeropp-3-qwz-qgz", "fsdp2")


def _speed_step(variant: str, config: GPTConfig, topology: Any) -> tuple[Callable, dict[str, Any]]:
    """`variant`'s training step on a fresh bf16 model on the device, and notes on what it ran."""
    from zeropp.config.sections import ZeroConfig
    from zeropp.engine import ZeroEngine
    from zeropp.tools.bench.rivals import adamw, engine_step, module_step, wrap

    torch.manual_seed(0)
    with topology.device:
        model = GPT(config)
    if variant.startswith("zeropp"):
        quantized = variant.endswith("qwz-qgz")
        zero = ZeroConfig(stage=3, precision="bf16", quantized_weights=quantized, quantized_gradients=quantized)
        engine = ZeroEngine(model, torch.optim.AdamW, adamw(1e-4), zero, topology)
        shard_ranks = engine.groups.shard.size
        gathered = any(not u.resident for u in engine.units)
        note = {"shard_group_ranks": shard_ranks, "units_gathered": gathered}
        if quantized and shard_ranks == 1:
            note["quantization"] = "skipped: a shard group of one rank gathers and reduce-scatters nothing"
        return engine_step(engine), note
    if variant == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        model = wrap(model, "fsdp2", topology.world_size, topology.ranks_per_node, mp_policy=policy)
        return module_step(model, torch.optim.AdamW(model.parameters(), **adamw(1e-4))), {"mixed_precision": "bf16"}
    step = module_step(model, torch.optim.AdamW(model.parameters(), **adamw(1e-4)))
    device_type = topology.device.type

    def autocast_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type, dtype=torch.bfloat16):
            return step(x, y)

    return autocast_step, {"mixed_precision": "fp32 weights, bf16 autocast"}


def _time_steps(step: Callable, config: GPTConfig, batch: int, device: torch.device, steps: int) -> list[float]:
    """Seconds of each of `steps` training steps after one warm-up (the device synchronized around each)."""
    times = []
    for i in range(steps + 1):
        x, y = _batch(config, i, batch, device)
        _sync(device)
        tick = time.perf_counter()
        step(x, y)
        _sync(device)
        times.append(time.perf_counter() - tick)
    return times[1:]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fresh(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def speed_rank(topology: Any, config: GPTConfig, batch: int, reps: int, steps: int) -> dict[str, Any]:
    """Every variant in turn, `reps` times (A B C D A B C D ...): median step, tokens/s, MFU."""
    from zeropp.app.metrics import flops_per_token, peak_flops

    device = topology.device
    times: dict[str, list[float]] = {v: [] for v in SPEED_VARIANTS}
    notes: dict[str, Any] = {}
    for _ in range(reps):
        for variant in SPEED_VARIANTS:
            if "error" in notes.get(variant, {}):
                continue
            try:
                step, notes[variant] = _speed_step(variant, config, topology)
                times[variant] += _time_steps(step, config, batch, device, steps)
            except Exception as error:  # e.g. out of memory: the other variants go on
                notes[variant] = {"error": first_line(error)}
            step = None
            _fresh(device)
    peak, per_token = peak_flops(device), flops_per_token(config.param_count, config.n_layer, config.d_model,
                                                          config.block_size)  # fmt: skip
    out = {}
    for variant in SPEED_VARIANTS:
        if "error" in notes.get(variant, {}) or not times[variant]:
            out[variant] = notes.get(variant, {"error": "no step ran"})
            continue
        median = statistics.median(times[variant])
        tokens = batch * config.block_size / median
        out[variant] = {"median_step_s": median, "tokens_per_s": tokens,
                        "mfu": tokens * per_token / peak if peak else None, "steps_s": times[variant],
                        **notes[variant]}  # fmt: skip
    return out


def stage_d(device_kind: str, sizes: Sizes, budget: Callable[[], float]) -> Result:
    """tokens/s and MFU of the ~1B bf16 GPT at world 1, the variants alternating."""
    from zeropp.app.metrics import flops_per_token

    config = sizes.speed
    yield "model", {"n_layer": config.n_layer, "d_model": config.d_model, "block_size": config.block_size,
                    "params": config.param_count, "micro_batch": sizes.speed_batch,
                    "flops_per_token": flops_per_token(config.param_count, config.n_layer, config.d_model,
                                                       config.block_size)}  # fmt: skip
    backend = "nccl" if device_kind == "cuda" else "gloo"
    try:
        variants = launch(speed_rank, 1, backend, device_kind, budget(), config=config, batch=sizes.speed_batch,
                          reps=sizes.reps, steps=sizes.steps)[0]  # fmt: skip
    except RuntimeError as error:
        yield "variants", {"error": first_line(error)}
        return
    yield from variants.items()


def offload_rank(topology: Any, config: GPTConfig, batch: int, reps: int, steps: int) -> dict[str, Any]:
    """Stage 3 bf16 without and with offload_optimizer="cpu", after backward and inside it
    (``step_in_backward``), steps alternating; median step times."""
    from zeropp.config.sections import ZeroConfig
    from zeropp.engine import ZeroEngine
    from zeropp.tools.bench.rivals import adamw, engine_step

    variants = {"none": {}, "cpu": dict(offload_optimizer="cpu"),
                "cpu, step in backward": dict(offload_optimizer="cpu", step_in_backward=True)}  # fmt: skip
    device, steps_of, times = topology.device, {}, {name: [] for name in variants}
    for name, fields in variants.items():
        torch.manual_seed(0)
        with device:
            model = GPT(config)
        zero = ZeroConfig(stage=3, precision="bf16", **fields)
        steps_of[name] = engine_step(ZeroEngine(model, torch.optim.AdamW, adamw(1e-4), zero, topology))
    for _ in range(reps):
        for name, step in steps_of.items():
            times[name] += _time_steps(step, config, batch, device, steps)
    medians = {k: statistics.median(v) for k, v in times.items()}
    return {"median_step_s": medians, "ratio_offload_to_device": medians["cpu"] / medians["none"],
            "ratio_in_backward_to_device": medians["cpu, step in backward"] / medians["none"], "steps_s": times}  # fmt: skip


def stage_f(device_kind: str, sizes: Sizes, budget: Callable[[], float]) -> Result:
    """Step time of a mid-size model with and without the optimizer offloaded to the host."""
    config = sizes.offload
    yield "model", {"n_layer": config.n_layer, "d_model": config.d_model, "block_size": config.block_size,
                    "params": config.param_count, "micro_batch": sizes.offload_batch}  # fmt: skip
    backend = "nccl" if device_kind == "cuda" else "gloo"
    try:
        result = launch(offload_rank, 1, backend, device_kind, budget(), config=config, batch=sizes.offload_batch,
                        reps=sizes.reps, steps=sizes.steps)[0]  # fmt: skip
    except RuntimeError as error:
        result = {"error": first_line(error)}
    yield "offload", result
