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
(With sequence parallelism the norms' are not: each rank's is the partial sum over its slice of the
sequence, a ``Partial`` DTensor, which :meth:`~zeropp.units.FlatUnit.add_grad` all-reduces.)

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

Sequence parallelism (``topology.sequence_parallel``, :func:`sequence_parallel_plan`): between the
split layers each rank keeps 1/t of the sequence (residual stream, norms, block inputs and so
activation checkpoints). Each all-reduce above becomes a reduce-scatter (a row-wise linear's output)
and an all-gather (a column-wise linear's input), of the same bytes. Per rank and micro-batch, with
r = (t-1)/t and e bytes per element::

    L x 8 r b*s*h*e          the blocks: 4 all-gathers and 4 reduce-scatters each (Megatron's bytes)
    + 2 r b*s*h*e            the model's ends: the head's input gathered in forward, the first
                             block's input gradient gathered in backward
    + P x 2 r h*e            the norms' partial gradients all-reduced: P vectors of h, 2 (2L + 1)
                             for the GPT's layer norms, 2L + 1 for Llama's RMSNorms
    + L x 3 r b*s*h*e        with activation checkpointing: recomputation repeats attention's
                             all-gather and reduce-scatter and the MLP's all-gather

(:func:`~zeropp.comm.volume.sequence_parallel_transfers`, :func:`~zeropp.comm.volume.sequence_parallel_ends`).
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from fnmatch import fnmatch

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils._pytree import tree_flatten

from zeropp.comm import Communicator, Ledger
from zeropp.comm.volume import SEQUENCE_PARALLEL_RECOMPUTED, megatron_transfers, sequence_parallel_transfers
from zeropp.config import ConfigError
from zeropp.conv1d_parallel import gpt2_plan
from zeropp.dtensor_params import is_split, local_tensor, splits
from zeropp.materialize import broadcast_packed, is_meta
from zeropp.topology import Topology

Plan = dict[str, ParallelStyle]  # module name (fnmatch patterns allowed) -> how to split it
SEQUENCE = Shard(1)  # activations are batch-first: (batch, sequence, hidden)


def gpt_plan(model: nn.Module, tp: int, sequence_parallel: bool = False) -> Plan:
    """Megatron's layout for the embedded GPT (:mod:`zeropp.models.gpt`): attention's qkv and the
    MLP's first linear split column-wise (each rank whole heads, a slice of the hidden units), their
    output projections row-wise.

    Embeddings, layer norms and the LM head stay whole on every rank: the head is tied to the token
    embedding, and splitting the vocabulary would take a vocabulary-parallel embedding plus a
    loss-parallel cross-entropy for one vocab x d_model matrix; whole, they cost no traffic.
    `sequence_parallel`: :func:`sequence_parallel_plan`'s layout on top."""
    config = model.config
    if config.n_head % tp:
        raise ConfigError(
            f"topology.tensor_parallel_size = {tp} is not allowed with model.n_head = {config.n_head}; "
            f"expected a divisor of n_head (each rank computes whole heads)"
        )
    plan: Plan = {}
    for i in range(len(model.blocks)):
        plan[f"blocks.{i}.attn.qkv"] = ColwiseParallel()
        plan[f"blocks.{i}.attn.proj"] = _rowwise(sequence_parallel)
        plan[f"blocks.{i}.mlp.0"] = ColwiseParallel()
        plan[f"blocks.{i}.mlp.2"] = _rowwise(sequence_parallel)
    if sequence_parallel:
        block = "blocks.*"
        plan |= sequence_parallel_plan(
            first_block="blocks.0",
            norms=(f"{block}.ln_1", f"{block}.ln_2", "ln_f"),
            gathered={f"{block}.attn": None, f"{block}.mlp": None},
            head="head",
        )
    return plan


def llama_plan(model: nn.Module, tp: int, sequence_parallel: bool = False) -> Plan:
    """Megatron's layout for Hugging Face ``LlamaForCausalLM``: q, k, v and the MLP's gate and up
    projections column-wise (each rank whole query and key/value heads), o_proj and down_proj
    row-wise; embeddings, norms and the LM head whole on every rank. `sequence_parallel`:
    :func:`sequence_parallel_plan`'s layout on top (a decoder layer hands its attention the hidden
    states as a keyword)."""
    config = model.config
    for key in ("num_attention_heads", "num_key_value_heads"):
        if getattr(config, key) % tp:
            raise ConfigError(
                f"topology.tensor_parallel_size = {tp} is not allowed with {key} = {getattr(config, key)}; "
                "expected a divisor of it (each rank computes whole heads)"
            )
    layer = "model.layers.*"
    plan = {
        **{f"{layer}.self_attn.{name}": ColwiseParallel() for name in ("q_proj", "k_proj", "v_proj")},
        f"{layer}.self_attn.o_proj": _rowwise(sequence_parallel),
        **{f"{layer}.mlp.{name}": ColwiseParallel() for name in ("gate_proj", "up_proj")},
        f"{layer}.mlp.down_proj": _rowwise(sequence_parallel),
    }
    if sequence_parallel:
        plan |= sequence_parallel_plan(
            first_block="model.layers.0",
            norms=(f"{layer}.input_layernorm", f"{layer}.post_attention_layernorm", "model.norm"),
            gathered={f"{layer}.self_attn": "hidden_states", f"{layer}.mlp": None},
            head="lm_head",
        )
    return plan


def _rowwise(sequence_parallel: bool) -> RowwiseParallel:
    """A row-wise linear: its partial outputs all-reduced, or with sequence parallelism reduce-scattered
    over the sequence."""
    return RowwiseParallel(output_layouts=SEQUENCE) if sequence_parallel else RowwiseParallel()


def sequence_parallel_plan(first_block: str, norms: tuple[str, ...], gathered: dict[str, str | None], head: str) -> Plan:
    """Megatron's sequence parallelism (as torchtitan lays it out): between the split layers every
    tensor-parallel rank keeps 1/tp of the sequence of the residual stream, and the norms run on it.

    - `first_block`: takes the whole embeddings and keeps this rank's slice (a local cut; its
      backward all-gathers the input gradient);
    - `norms`: :class:`SequenceParallel` (their weights whole on every rank, their gradients partial:
      each rank saw its own slice; the engine sums them over the tensor-parallel group);
    - `gathered`: the modules whose column-wise linears need the whole sequence ({name: the keyword
      their input comes as, None: the first positional}): all-gathered in forward, kept a DTensor so
      that their linears' partial input gradients add up to one reduce-scatter in backward; the
      row-wise linears that end them reduce-scatter their outputs over the sequence (:func:`_rowwise`);
    - `head`: the (whole) LM head takes the whole sequence: all-gathered in forward, its input
      gradient cut locally in backward.

    Module outputs are this rank's slice as a plain tensor, so the model's own code (residual adds,
    slicing) runs on them unchanged."""
    plan: Plan = {first_block: PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=SEQUENCE, use_local_output=True)}
    plan |= {norm: SequenceParallel(use_local_output=True) for norm in norms}
    for name, keyword in gathered.items():
        plan[name] = (
            PrepareModuleInput(input_layouts=SEQUENCE, desired_input_layouts=Replicate())
            if keyword is None
            else PrepareModuleInput(input_kwarg_layouts={keyword: SEQUENCE}, desired_input_kwarg_layouts={keyword: Replicate()})
        )
    plan[head] = PrepareModuleInput(input_layouts=SEQUENCE, desired_input_layouts=Replicate(), use_local_output=True)
    return plan


# model class -> plan(model, tp), with a `sequence_parallel` keyword where the plan has that layout too
PLANS: dict[str, Callable[..., Plan]] = {"GPT": gpt_plan, "LlamaForCausalLM": llama_plan, "GPT2LMHeadModel": gpt2_plan}


def plan_for(model: nn.Module, tp: int, sequence_parallel: bool = False) -> Plan:
    """The shipped plan for this model's class; a one-line ConfigError where there is none (or none
    with sequence parallelism when it is asked for)."""
    name = type(model).__name__
    if name not in PLANS:
        raise ConfigError(
            f"no tensor-parallel plan for model class {name} (plans exist for {', '.join(sorted(PLANS))}); "
            "pass one: zeropp.parallelize(model, topology, plan={'module.name': ColwiseParallel(), ...})"
        )
    if not sequence_parallel:
        return PLANS[name](model, tp)
    layouts = [n for n, plan in sorted(PLANS.items()) if "sequence_parallel" in inspect.signature(plan).parameters]
    if name not in layouts:
        raise ConfigError(
            f"topology.sequence_parallel = True is not allowed with model class {name}; expected false (its plan "
            f"has no sequence-parallel layout; plans with one exist for {', '.join(layouts)})"
        )
    return PLANS[name](model, tp, sequence_parallel=True)


def tensor_parallel_mesh(topology: Topology) -> DeviceMesh:
    """This rank's tensor-parallel group as a 1-D DTensor device mesh."""
    return DeviceMesh.from_group(topology.tensor_parallel.pg, topology.device.type)


def parallelize(model: nn.Module, topology: Topology, plan: Plan | None = None) -> nn.Module:
    """Split `model` over the topology's tensor-parallel group with `plan` (default: the shipped plan for
    its class, with ``topology.sequence_parallel``'s layout when set); a no-op without tensor
    parallelism. Collective over the tensor-parallel group. A plan of your own under
    ``topology.sequence_parallel`` must hand every block its input split over the sequence
    (:func:`sequence_parallel_plan`): the engine's Pa keeps a block's input as it is then."""
    tp = topology.tensor_parallel
    if tp.size == 1:
        return model
    plan = plan_for(model, tp.size, topology.sequence_parallel) if plan is None else plan
    parallelize_module(model, tensor_parallel_mesh(topology), plan)
    if topology.sequence_parallel:
        model.register_forward_pre_hook(functools.partial(_check_inputs, tp.size), with_kwargs=True)
    if not is_meta(model):  # a meta-device model is initialized by the engine, the same on every rank
        whole = [local_tensor(t).data for t in (*model.parameters(), *model.buffers()) if not is_split(t)]
        broadcast_packed(Communicator(topology, Ledger()), whole, tp)  # set-up, not the model's traffic
    return model


def check_sequence_length(length: int, tp: int) -> None:
    """Sequence parallelism cuts the sequence into tp equal slices: refuse one that does not split evenly."""
    if length % tp:
        raise ConfigError(
            f"a sequence of {length} tokens is not allowed with topology.sequence_parallel; "
            f"expected a multiple of topology.tensor_parallel_size = {tp} (each rank keeps an equal slice)"
        )


def _check_inputs(tp: int, module: nn.Module, args: tuple, kwargs: dict) -> None:
    """The model's inputs (batch, sequence, ...) before its forward's first collective."""
    for tensor in tree_flatten((args, kwargs))[0]:
        if isinstance(tensor, torch.Tensor) and tensor.dim() >= 2:
            check_sequence_length(tensor.shape[1], tp)


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
    batch: int, seq: int, hidden: int, tp: int, element_bytes: int, recomputed: int = 0, sequence_parallel: bool = False
) -> int:
    """Bytes one rank sends per transformer block and micro-batch under Megatron's layout: 4 ring
    all-reduces of batch*seq*hidden, plus the `recomputed` forward all-reduces activation checkpointing
    repeats (:attr:`~zeropp.memory.Activations.recomputed_all_reduces`), 2 (tp-1)/tp of it each. With
    `sequence_parallel` the same bytes without recomputation: 4 all-gathers and 4 reduce-scatters,
    (tp-1)/tp of it each, plus those recomputation repeats (:data:`~zeropp.comm.volume.SEQUENCE_PARALLEL_RECOMPUTED`)."""
    elements = batch * seq * hidden
    if sequence_parallel:
        transfers = sequence_parallel_transfers(elements, element_bytes, tp, SEQUENCE_PARALLEL_RECOMPUTED[recomputed])
    else:
        transfers = megatron_transfers(elements, element_bytes, tp, recomputed)
    return sum(t.sent for t in transfers)
