"""Expert parallelism installed into a model's mixture-of-experts layers: each rank of the
expert-parallel group keeps its own range of every layer's experts, and tokens reach them by
all-to-all (See [Note: expert dispatch])."""

from __future__ import annotations

import functools

import torch
from torch import nn

from zeropp.comm.communicator import Communicator
from zeropp.config.sections import ZeroConfig
from zeropp.errors import ConfigError
from zeropp.expert_parallel.dispatch import dispatch_over
from zeropp.topology import Group, ShardGroups

EXPERT_SPLIT = "_zeropp_expert_split"  # on a parameter split over the expert-parallel group: that Group


def expert_layers(model: nn.Module) -> list[nn.Module]:
    """The mixture-of-experts layers zeropp can split: modules with ``n_experts``, ``experts`` (the
    container of stacked expert weights, experts on dimension 0, with ``held``: the [start, stop) of
    the experts it holds, which its ``reset_parameters`` keeps of the whole draw) and a replaceable
    ``dispatch``."""
    return [m for m in model.modules() if hasattr(m, "n_experts") and hasattr(m, "experts") and hasattr(m, "dispatch")]


def check_expert_parallel(model: nn.Module, size: int) -> None:
    """Refuse in one line, before any collective, a model expert parallelism cannot split over `size` ranks."""
    if size == 1:
        return
    layers = expert_layers(model)
    if not layers:
        raise ConfigError(
            f"topology.expert_parallel_size = {size} is not allowed with {type(model).__name__}: it has no "
            "mixture-of-experts layer zeropp can split; expected the embedded GPT with model.n_experts, or 1"
        )
    experts = layers[0].n_experts
    if experts % size:
        raise ConfigError(
            f"topology.expert_parallel_size = {size} does not divide the model's {experts} experts "
            f"(model.n_experts); allowed: a divisor of {experts} (each rank holds whole experts)"
        )


def apply_expert_parallel(model: nn.Module, comm: Communicator) -> list[nn.Module]:
    """Split every mixture-of-experts layer of `model` over the topology's expert-parallel group (a
    no-op without one): each rank keeps its n / E experts, rows [rank n/E, (rank + 1) n/E) of every
    stacked weight, as parameters of their own (marked with the group, which
    :func:`zeropp.checkpoint.per_parameter.full_state_dict` gathers them over), and dispatches by
    all-to-all. Returns the experts containers, which the engine shards over the ranks holding the
    same experts."""
    group = comm.topology.expert_parallel
    if group.size == 1:
        return []
    check_expert_parallel(model, group.size)
    containers = []
    for layer in expert_layers(model):
        share = layer.n_experts // group.size
        for name, param in list(layer.experts.named_parameters(recurse=False)):
            piece = nn.Parameter(
                param.detach()[group.rank * share : (group.rank + 1) * share].clone(), param.requires_grad
            )
            setattr(piece, EXPERT_SPLIT, group)
            setattr(layer.experts, name, piece)
        layer.experts.held = (group.rank * share, (group.rank + 1) * share)  # what a reset draws for
        layer.dispatch = functools.partial(dispatch_over, comm, group)
        containers.append(layer.experts)
    return containers


def split_experts(
    model: nn.Module, comm: Communicator, config: ZeroConfig, dense: ShardGroups
) -> tuple[list[nn.Module], ShardGroups]:
    """The engine's mixture-of-experts layers: their experts containers, units of their own (the same
    units, so the same initialization, with expert parallelism or without), and the groups those
    shard over: the ranks holding the same experts (:func:`apply_expert_parallel`), or `dense`, the
    other units' groups, without expert parallelism. Refused in one line: stage 0 (each rank's gradient
    norm would miss the other ranks' experts), qgZ, and a data-parallel group of ZeRO's other than the
    topology's (DiLoCo's nodes)."""
    size = comm.topology.expert_parallel.size
    if size > 1 and config.stage == 0:
        raise ConfigError(
            f"topology.expert_parallel_size = {size} is not allowed with zero.stage = 0; expected a stage of 1 to 3"
        )
    if size > 1 and config.qgz.enabled:
        raise ConfigError(
            f"topology.expert_parallel_size = {size} is not allowed with zero.quantized_gradients (qgZ: its second "
            "hop starts when the first completes, which can reorder it against the experts' collectives over the "
            "same ranks); expected zero.quantized_gradients = false"
        )
    if size > 1 and dense.shard.ranks != comm.topology.data_parallel.ranks:
        raise ConfigError(
            f"topology.expert_parallel_size = {size} is not allowed with zero.outer_sync_every (DiLoCo); expected 1"
        )
    if size > 1:
        apply_expert_parallel(model, comm)
        return [layer.experts for layer in expert_layers(model)], comm.topology.expert_shard_groups()
    return [layer.experts for layer in expert_layers(model)], dense


def expert_group(param: torch.Tensor) -> Group | None:
    """The expert-parallel group a parameter's experts are split over (None: not split)."""
    return getattr(param, EXPERT_SPLIT, None)
