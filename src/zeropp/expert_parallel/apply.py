"""Expert parallelism installed into a model's mixture-of-experts layers: each rank of the
expert-parallel group keeps its own range of every layer's experts, and tokens reach them by
all-to-all (See [Note: expert dispatch])."""

from __future__ import annotations

import functools
import itertools

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from zeropp.comm.communicator import Communicator
from zeropp.config.sections import ZeroConfig
from zeropp.errors import ConfigError
from zeropp.expert_parallel.dispatch import dispatch_over
from zeropp.topology import Group, ShardGroups
from zeropp.zero.grouping import refuse_expert_units
from zeropp.zero.weights.dtensor_params import EXPERT_SPLIT

IMPLEMENTATION = "zeropp_expert_parallel_"  # transformers' experts implementations registered here, numbered
_names = itertools.count()


def expert_layers(model: nn.Module) -> list[nn.Module]:
    """The embedded GPT's mixture-of-experts layers: modules with ``n_experts``, ``experts`` (the
    container of stacked expert weights, experts on dimension 0) and a replaceable ``dispatch``."""
    return [m for m in model.modules() if hasattr(m, "n_experts") and hasattr(m, "experts") and hasattr(m, "dispatch")]


def hf_experts(model: nn.Module) -> list[nn.Module]:
    """A Hugging Face model's experts modules: those behind transformers' experts interface (their
    weights stacked on dimension 0, ``num_experts`` of them; Mixtral, Qwen-MoE, OLMoE, DeepSeek, ...)."""
    return [m for m in model.modules() if hasattr(m, "_is_expert_parallel") and hasattr(m, "num_experts")]


def experts_containers(model: nn.Module) -> list[nn.Module]:
    """Every experts container of `model` zeropp can split (a unit of its own in the engine)."""
    return [layer.experts for layer in expert_layers(model)] + hf_experts(model)


def _count(container: nn.Module) -> int:
    return getattr(container, "n_experts", None) or container.num_experts


def check_expert_parallel(model: nn.Module, size: int) -> None:
    """Refuse in one line, before any collective, a model expert parallelism cannot split over `size` ranks."""
    if size == 1:
        return
    containers = experts_containers(model)
    if not containers:
        raise ConfigError(
            f"topology.expert_parallel_size = {size} is not allowed with {type(model).__name__}: it has no "
            "mixture-of-experts layer zeropp can split (the embedded GPT's with model.n_experts, or transformers' "
            "experts modules); expected 1"
        )
    for container in containers:
        experts = _count(container)
        if experts % size:
            raise ConfigError(
                f"topology.expert_parallel_size = {size} does not divide the model's {experts} experts; allowed: "
                f"a divisor of {experts} (each rank holds whole experts)"
            )
        for name, param in container.named_parameters(recurse=False):
            if not param.requires_grad:
                raise ConfigError(
                    f"a frozen experts weight ({name}) is not allowed with topology.expert_parallel_size = {size} "
                    "yet (LoRA on a mixture of experts, a frozen base); expected trainable experts, or 1"
                )
            if isinstance(param, DTensor):  # a plan of the user's (zeropp.parallelize's leaves them whole)
                raise ConfigError(
                    f"topology.expert_parallel_size = {size} cannot split {name}: the tensor-parallel plan split it; "
                    "expected the experts left out of the plan (each tensor-parallel rank runs them whole)"
                )
            if not param.dim() or param.shape[0] != experts:
                raise ConfigError(
                    f"topology.expert_parallel_size = {size} cannot split {name} of shape {tuple(param.shape)}: "
                    f"expected every experts weight stacked, {experts} experts on its first dimension"
                )


def apply_expert_parallel(model: nn.Module, comm: Communicator) -> None:
    """Split every experts container of `model` over the topology's expert-parallel group: each rank
    keeps its n / E experts, rows [rank n/E, (rank + 1) n/E) of every stacked weight, in the same
    parameter objects (marked with the group, which :func:`zeropp.checkpoint.per_parameter.full_state_dict`
    gathers them over), and tokens reach them by all-to-all: the GPT's layers dispatch over the
    group, a Hugging Face model's experts run through an implementation of transformers' experts
    interface registered for this engine, wrapping the model's own."""
    group = comm.topology.expert_parallel
    check_expert_parallel(model, group.size)
    for container in experts_containers(model):
        total = _count(container)
        share = total // group.size
        for param in container.parameters(recurse=False):  # in place: optimizers and hooks keep the object
            rows = param.detach()[group.rank * share : (group.rank + 1) * share].clone()
            torch.utils.swap_tensors(param, nn.Parameter(rows, param.requires_grad))
            setattr(param, EXPERT_SPLIT, group)
    for layer in expert_layers(model):
        layer.dispatch = functools.partial(dispatch_over, comm, group)
    for container in hf_experts(model):
        _install_hf(container, comm, group)


def _install_hf(container: nn.Module, comm: Communicator, group: Group) -> None:
    """Run `container` (a transformers experts module, its weights cut to this rank's experts) through
    a fresh experts implementation: tokens dispatched over `group`, this rank's rows computed by the
    implementation the model was built with (indices of its own experts, weights of 1), combined."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    config, total = container.config, container.num_experts
    wrapped = config._experts_implementation
    container.num_experts = total // group.size

    def experts_forward(self: nn.Module, hidden: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor):
        inner = ALL_EXPERTS_FUNCTIONS.get_interface(wrapped, type(self).forward.__wrapped__)

        def run(rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
            index = torch.arange(len(counts), device=rows.device).repeat_interleave(
                torch.tensor(counts, device=rows.device)
            )
            return inner(self, rows, index.unsqueeze(1), weights.new_ones((rows.shape[0], 1)))

        return dispatch_over(comm, group, hidden, chosen, weights, run, total)

    if not str(wrapped).startswith(IMPLEMENTATION):
        name = f"{IMPLEMENTATION}{next(_names)}"
        ALL_EXPERTS_FUNCTIONS.register(name, experts_forward)
        config._experts_implementation = name


def refuse_expert_parallel(
    model: nn.Module, comm: Communicator, config: ZeroConfig, dense: ShardGroups, units: list[nn.Module]
) -> None:
    """What the engine's mixture of experts cannot do, refused in one line before any collective: a
    single expert as a unit (:func:`zeropp.zero.grouping.refuse_expert_units`), and with expert
    parallelism a model it cannot split (:func:`check_expert_parallel`), stage 0 (each rank's
    gradient norm would miss the other ranks' experts), offload (not composed yet), a
    data-parallel group of ZeRO's other than the topology's (DiLoCo's nodes) and Pa under tensor
    parallelism (an experts container's checkpointed input, the rows its tokens sent it, differs in
    size from one tensor-parallel group to the next: the collective sequences could not be compared)."""
    refuse_expert_units(model, units)
    size = comm.topology.expert_parallel.size
    if size == 1:
        return
    check_expert_parallel(model, size)
    refused = {
        "zero.stage = 0": config.stage == 0,
        "zero.offload_optimizer or zero.offload_params (not composed yet)": config.offload.optimizer != "none"
        or config.offload.params != "none",
        "zero.outer_sync_every (DiLoCo)": dense.shard.ranks != comm.topology.data_parallel.ranks,
        "zero.partition_activations under tensor parallelism (not composed yet)": config.activations.partition_activations
        and comm.topology.tensor_parallel.size > 1,
    }
    for what, yes in refused.items():
        if yes:
            raise ConfigError(f"topology.expert_parallel_size = {size} is not allowed with {what}; expected 1")


def split_experts(model: nn.Module, comm: Communicator, dense: ShardGroups) -> tuple[list[nn.Module], ShardGroups]:
    """The engine's mixture-of-experts layers, after :func:`refuse_expert_parallel`: their experts
    containers, units of their own (the same units, so the same initialization, with expert
    parallelism or without), and the groups those shard over: the ranks holding the same experts
    (:func:`apply_expert_parallel`; hpZ over those of one of the dense units' secondary groups), or
    `dense`, the other units' groups, without it."""
    if comm.topology.expert_parallel.size > 1:
        apply_expert_parallel(model, comm)
        return experts_containers(model), comm.topology.expert_shard_groups(dense.hpz_group_size)
    return experts_containers(model), dense
