"""Tensor parallelism from outside the model, the torch-native way: a DTensor plan applied with
``parallelize_module`` before the engine wraps the model (as torchtitan does)::

    topology = zeropp.init_topology(TopologyConfig(tensor_parallel_size=2))
    model = zeropp.parallelize(GPT(config), topology)          # or plan={"name": ColwiseParallel(), ...}
    engine = zeropp.ZeroEngine(model, torch.optim.AdamW, {...}, ZeroConfig(stage=3), topology)

The split weights become DTensor parameters on the tensor-parallel group (consecutive ranks of one
node, :class:`~zeropp.topology.Layout`); the engine flattens each rank's local shard of them and
shards that over the data-parallel group. Everything the plan leaves out stays whole on every
tensor-parallel rank, equal there (taken from the group's first rank here) and kept equal: its
inputs and output gradients are the same on every tensor-parallel rank, so are its gradients.

Traffic (Megatron's layout, per transformer block and micro-batch, b x s x h activations in the
compute dtype): a column-wise linear takes its input whole and all-reduces the input's gradient in
backward; a row-wise linear all-reduces its output in forward. Two of each per block, so 2
all-reduces in forward and 2 in backward, each of b*s*h elements. An all-reduce is a reduce-scatter
and an all-gather (the ZeRO paper's 2 x message size), so a block moves 8 * b*s*h elements per
micro-batch; with activation checkpointing 2 * b*s*h more per forward all-reduce recomputation
repeats: 12 * b*s*h in the ZeRO paper's layout (both: §8's "12 x seq x hidden x batch per layer"),
10 * b*s*h in zeropp's runtime (one: :class:`~zeropp.memory.Activations`). Per rank on a ring of t
ranks that is (t-1)/t of it: :func:`megatron_bytes_per_block`, from the traffic model's
:func:`~zeropp.comm.volume.megatron_transfers`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from fnmatch import fnmatch

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from zeropp.comm import Communicator, Ledger
from zeropp.comm.volume import megatron_transfers
from zeropp.config import ConfigError
from zeropp.conv1d_parallel import gpt2_plan
from zeropp.dtensor_params import splits
from zeropp.materialize import broadcast_packed, is_meta
from zeropp.topology import Topology

Plan = dict[str, ParallelStyle]  # module name (fnmatch patterns allowed) -> how to split it


def gpt_plan(model: nn.Module, tp: int) -> Plan:
    """Megatron's layout for the embedded GPT (:mod:`zeropp.models.gpt`): attention's qkv and the
    MLP's first linear split column-wise (each rank whole heads, a slice of the hidden units), their
    output projections row-wise.

    Embeddings, layer norms and the LM head stay whole on every rank: the head is tied to the token
    embedding, and splitting the vocabulary would take a vocabulary-parallel embedding plus a
    loss-parallel cross-entropy for one vocab x d_model matrix; whole, they cost no traffic."""
    config = model.config
    if config.n_head % tp:
        raise ConfigError(
            f"topology.tensor_parallel_size = {tp} is not allowed with model.n_head = {config.n_head}; "
            f"expected a divisor of n_head (each rank computes whole heads)"
        )
    plan: Plan = {}
    for i in range(len(model.blocks)):
        plan[f"blocks.{i}.attn.qkv"] = ColwiseParallel()
        plan[f"blocks.{i}.attn.proj"] = RowwiseParallel()
        plan[f"blocks.{i}.mlp.0"] = ColwiseParallel()
        plan[f"blocks.{i}.mlp.2"] = RowwiseParallel()
    return plan


def llama_plan(model: nn.Module, tp: int) -> Plan:
    """Megatron's layout for Hugging Face ``LlamaForCausalLM``: q, k, v and the MLP's gate and up
    projections column-wise (each rank whole query and key/value heads), o_proj and down_proj
    row-wise; embeddings, norms and the LM head whole on every rank."""
    config = model.config
    for key in ("num_attention_heads", "num_key_value_heads"):
        if getattr(config, key) % tp:
            raise ConfigError(
                f"topology.tensor_parallel_size = {tp} is not allowed with {key} = {getattr(config, key)}; "
                "expected a divisor of it (each rank computes whole heads)"
            )
    layer = "model.layers.*"
    return {
        **{f"{layer}.self_attn.{name}": ColwiseParallel() for name in ("q_proj", "k_proj", "v_proj")},
        f"{layer}.self_attn.o_proj": RowwiseParallel(),
        **{f"{layer}.mlp.{name}": ColwiseParallel() for name in ("gate_proj", "up_proj")},
        f"{layer}.mlp.down_proj": RowwiseParallel(),
    }


PLANS: dict[str, Callable[[nn.Module, int], Plan]] = {
    "GPT": gpt_plan,
    "LlamaForCausalLM": llama_plan,
    "GPT2LMHeadModel": gpt2_plan,  # transformers' Conv1D: styles of their own (zeropp.conv1d_parallel)
}


def plan_for(model: nn.Module, tp: int) -> Plan:
    """The shipped plan for this model's class; a one-line ConfigError where there is none."""
    name = type(model).__name__
    if name not in PLANS:
        raise ConfigError(
            f"no tensor-parallel plan for model class {name} (plans exist for {', '.join(sorted(PLANS))}); "
            "pass one: zeropp.parallelize(model, topology, plan={'module.name': ColwiseParallel(), ...})"
        )
    return PLANS[name](model, tp)


def tensor_parallel_mesh(topology: Topology) -> DeviceMesh:
    """This rank's tensor-parallel group as a 1-D DTensor device mesh."""
    return DeviceMesh.from_group(topology.tensor_parallel.pg, topology.device.type)


def parallelize(model: nn.Module, topology: Topology, plan: Plan | None = None) -> nn.Module:
    """Split `model` over the topology's tensor-parallel group with `plan` (default: the shipped plan for
    its class); a no-op without tensor parallelism. Collective over the tensor-parallel group."""
    tp = topology.tensor_parallel
    if tp.size == 1:
        return model
    plan = plan_for(model, tp.size) if plan is None else plan
    parallelize_module(model, tensor_parallel_mesh(topology), plan)
    if not is_meta(model):  # a meta-device model is initialized by the engine, the same on every rank
        whole = [t.data for t in (*model.parameters(), *model.buffers()) if not isinstance(t, DTensor)]
        broadcast_packed(Communicator(topology, Ledger()), whole, tp)  # set-up, not the model's traffic
    return model


# (style, module type) -> {parameter: the dimension the style shards it on}; what parallelize_module does
# (a style with ``param_placements``, such as zeropp.conv1d_parallel's, says it itself)
SHARDED_DIMS: tuple[tuple[type[ParallelStyle], type[nn.Module], dict[str, int]], ...] = (
    (ColwiseParallel, nn.Linear, {"weight": 0, "bias": 0}),
    (ColwiseParallel, nn.Embedding, {"weight": 1}),
    (RowwiseParallel, nn.Linear, {"weight": 1}),  # the bias stays whole: added once, after the all-reduce
    (RowwiseParallel, nn.Embedding, {"weight": 0}),
)


def local_numels(model: nn.Module, plan: Plan, tp: int) -> dict[str, int]:
    """{parameter name: elements the first tensor-parallel rank holds} once `plan` splits `model` over
    tp ranks, without splitting it (the model may live on the meta device): a sharded dimension of n
    becomes ceil(n / tp), as ``torch.chunk`` gives the first rank; the rest stays whole."""
    styles = {}
    for name, module in model.named_modules():
        for pattern, style in plan.items():
            atoms, names = pattern.split("."), name.split(".")
            if len(atoms) == len(names) and all(fnmatch(n, a) for n, a in zip(names, atoms, strict=True)):
                styles[name] = (style, module)
    out = {}
    for name, param in model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        dims = {}
        if owner in styles:
            style, module = styles[owner]
            placements = getattr(style, "param_placements", None)
            if placements is not None:
                dims = {key: p.dim for key, p in placements.items() if splits(p)}
            else:
                dims = next((d for s, m, d in SHARDED_DIMS if isinstance(style, s) and isinstance(module, m)), {})
        shape = list(param.shape)
        if leaf in dims:
            shape[dims[leaf]] = math.ceil(shape[dims[leaf]] / tp)
        out[name] = math.prod(shape)
    return out


def megatron_bytes_per_block(
    batch: int, seq: int, hidden: int, tp: int, element_bytes: int, recomputed: int = 0
) -> int:
    """Bytes one rank sends per transformer block and micro-batch under Megatron's layout: 4 ring
    all-reduces of batch*seq*hidden, plus the `recomputed` forward all-reduces activation checkpointing
    repeats (:attr:`~zeropp.memory.Activations.recomputed_all_reduces`), 2 (tp-1)/tp of it each."""
    return sum(t.sent for t in megatron_transfers(batch * seq * hidden, element_bytes, tp, recomputed))
