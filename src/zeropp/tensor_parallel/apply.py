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
sequence, a ``Partial`` DTensor; each unit all-reduces its norms' as one message over the
tensor-parallel group when it reduces its gradients, :meth:`~zeropp.zero.unit.FlatUnit.reduce_gradients`.)

Traffic (Megatron's layout, per transformer block and micro-batch, b x s x h activations in the
compute dtype): a column-wise linear takes its input whole and all-reduces the input's gradient in
backward; a row-wise linear all-reduces its output in forward. Two of each per block, so 2
all-reduces in forward and 2 in backward, each of b*s*h elements. An all-reduce is a reduce-scatter
and an all-gather (the ZeRO paper's 2 x message size), so a block moves 8 * b*s*h elements per
micro-batch; with activation checkpointing 2 * b*s*h more per forward all-reduce recomputation
repeats: 12 * b*s*h in the ZeRO paper's layout (both: §8's "12 x seq x hidden x batch per layer"),
10 * b*s*h in zeropp's runtime (one: :class:`~zeropp.costs.memory.Activations`). Per rank on a ring of t
ranks that is (t-1)/t of it: :func:`~zeropp.costs.tensor_parallel.megatron_bytes_per_block`, from the traffic model's
:func:`~zeropp.costs.volume.megatron_transfers`.

Sequence parallelism (``topology.sequence_parallel``, :func:`sequence_parallel_plan`): between the
split layers each rank keeps 1/t of the sequence (residual stream, norms, block inputs and so
activation checkpoints). Each all-reduce above becomes a reduce-scatter (a row-wise linear's output)
and an all-gather (a column-wise linear's input), of the same bytes. Per rank and micro-batch, with
r = (t-1)/t and e bytes per element::

    L x 8 r b*s*h*e          the blocks: 4 all-gathers and 4 reduce-scatters each (Megatron's bytes)
    + 2 r b*s*h*e            the model's ends: the head's input gathered in forward, the first
                             block's input gradient gathered in backward
    + P x 2 r h*g            the norms' partial gradients all-reduced, per gradient reduction (each
                             micro-batch at stages 2-3, once a step at 0-1; g bytes per gradient
                             element), one message per unit holding norms: P vectors of h, 2 (2L + 1)
                             for the GPT's layer norms, 2L + 1 for Llama's RMSNorms, 4L for
                             GPT-2's (its final norm runs on the whole sequence)
    + L x 3 r b*s*h*e        with activation checkpointing: recomputation repeats attention's
                             all-gather and reduce-scatter and the MLP's all-gather

(:func:`~zeropp.costs.volume.sequence_parallel_transfers`, :func:`~zeropp.costs.volume.sequence_parallel_ends`,
:func:`~zeropp.costs.volume.norm_gradient_transfers`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from zeropp.comm.communicator import Communicator
from zeropp.comm.ledger import Ledger
from zeropp.errors import ConfigError
from zeropp.tensor_parallel.hf_plans import has_hf_plan, hf_plan
from zeropp.tensor_parallel.plans import Plan, gpt2_plan, gpt_plan, llama_plan
from zeropp.tensor_parallel.rng import fork_split_regions
from zeropp.topology import Topology
from zeropp.zero.materialize import broadcast_packed, is_meta
from zeropp.zero.weights.dtensor_params import is_split, local_tensor

# model class -> plan(model, tp, sequence_parallel)
PLANS: dict[str, Callable[..., Plan]] = {"GPT": gpt_plan, "LlamaForCausalLM": llama_plan, "GPT2LMHeadModel": gpt2_plan}


def plan_for(model: nn.Module, tp: int, sequence_parallel: bool = False, experts_whole: bool = False) -> Plan:
    """The shipped plan for this model's class (with `sequence_parallel`'s layout when asked), else
    transformers' own plan translated (:func:`~zeropp.tensor_parallel.hf_plans.hf_plan`; `experts_whole`:
    its experts left whole, as expert parallelism runs them); a one-line ConfigError where there is none."""
    name = type(model).__name__
    if name in PLANS:
        return PLANS[name](model, tp, sequence_parallel=sequence_parallel)
    if has_hf_plan(model) and not sequence_parallel:
        return hf_plan(model, tp, experts_whole)
    what = "sequence-parallel plan" if has_hf_plan(model) else "tensor-parallel plan"
    raise ConfigError(
        f"no {what} for model class {name} (shipped for {', '.join(sorted(PLANS))}, and translated from "
        "transformers' config.base_model_tp_plan); pass one: "
        "zeropp.parallelize(model, topology, plan={'module.name': ColwiseParallel(), ...})"
    )


def tensor_parallel_mesh(topology: Topology) -> DeviceMesh:
    """This rank's tensor-parallel group as a 1-D DTensor device mesh."""
    return DeviceMesh.from_group(topology.tensor_parallel.pg, topology.device.type)


def parallelize(model: nn.Module, topology: Topology, plan: Plan | None = None) -> nn.Module:
    """Split `model` over the topology's tensor-parallel group with `plan` (default: the shipped plan for
    its class, with ``topology.sequence_parallel``'s layout when set, the experts whole under expert
    parallelism); a no-op without tensor parallelism. Collective over the tensor-parallel group. A plan
    of your own under ``topology.sequence_parallel`` must hand every block its input split over the
    sequence (:func:`sequence_parallel_plan`): the engine's Pa keeps a block's input as it is then;
    under expert parallelism it must leave the experts whole."""
    tp = topology.tensor_parallel
    if tp.size == 1:
        return model
    experts_whole = topology.expert_parallel.size > 1
    plan = plan_for(model, tp.size, topology.sequence_parallel, experts_whole) if plan is None else plan
    parallelize_module(model, tensor_parallel_mesh(topology), plan)
    fork_split_regions(model, plan, tp.rank, topology.device)  # each rank's own dropout masks where parts differ
    if topology.sequence_parallel:
        model.register_forward_pre_hook(functools.partial(_check_inputs, tp.size), with_kwargs=True)
    if not is_meta(model):  # a meta-device model is initialized by the engine, the same on every rank
        whole = [local_tensor(t).data for t in (*model.parameters(), *model.buffers()) if not is_split(t)]
        broadcast_packed(Communicator(topology, Ledger()), whole, tp)  # set-up, not the model's traffic
    return model


def check_split(model: nn.Module, tp: int) -> None:
    """A tensor-parallel topology needs a model split by :func:`parallelize`, and only it (one line)."""
    split = any(is_split(p) for p in model.parameters())
    if tp > 1 and not split:
        raise ConfigError(
            f"topology.tensor_parallel_size = {tp} but no parameter of the model is split; "
            "call zeropp.parallelize(model, topology) before the engine"
        )
    if split and tp == 1:
        raise ConfigError("the model has DTensor-split parameters but topology.tensor_parallel_size = 1")


def check_sequence_length(length: int, tp: int) -> None:
    """Sequence parallelism cuts the sequence into tp equal slices: refuse one that does not split evenly."""
    if length % tp:
        raise ConfigError(
            f"a sequence of {length} tokens is not allowed with topology.sequence_parallel; "
            f"expected a multiple of topology.tensor_parallel_size = {tp} (each rank keeps an equal slice)"
        )


def _check_inputs(tp: int, module: nn.Module, args: tuple, kwargs: dict) -> None:
    """The model's tokens (batch, sequence, ...) before its forward's first collective: the first
    positional input, else Hugging Face's ``input_ids`` or ``inputs_embeds`` (masks are not looked at:
    a 4-D one is (batch, 1, sequence, sequence))."""
    tokens = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs_embeds"))
    if isinstance(tokens, torch.Tensor) and tokens.dim() >= 2:
        check_sequence_length(tokens.shape[1], tp)
