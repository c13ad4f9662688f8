"""The embedded GPT as the estimator sees it: its units' parameter numels, its activations' shape."""

from __future__ import annotations

from typing import Any

from zeropp.config.model import ModelConfig
from zeropp.costs.expert_parallel import MixtureOfExperts
from zeropp.costs.memory import Activations


def gpt_unit_numels(model: ModelConfig, tensor_parallel: int = 1) -> list[list[int]]:
    """The parameters' numels of every unit the engine makes of the embedded GPT (its blocks, then the
    root), on one tensor-parallel rank: the shipped plan's split weights count their local shard; a
    mixture of experts' containers are :func:`gpt_expert_unit_numels`'."""
    return _gpt_units(model, tensor_parallel)[0]


def gpt_expert_unit_numels(model: ModelConfig) -> list[list[int]]:
    """The parameters' numels of the embedded GPT's experts containers (units of their own), if any."""
    return _gpt_units(model, 1)[1]


def gpt_experts(model: ModelConfig, expert_parallel: int = 1) -> MixtureOfExperts | None:
    """The embedded GPT's mixture-of-experts layers (None: its MLPs are dense)."""
    from zeropp.app.models.gpt import gpt_config

    gpt = gpt_config(model)
    return MixtureOfExperts(gpt.n_layer, gpt.n_experts, gpt.top_k, expert_parallel) if gpt.n_experts else None


def _gpt_units(model: ModelConfig, tensor_parallel: int) -> tuple[list[list[int]], list[list[int]]]:
    import torch

    from zeropp.app.models.gpt import GPT, gpt_config
    from zeropp.costs.tensor_parallel import local_numels
    from zeropp.expert_parallel import expert_layers
    from zeropp.tensor_parallel.plans import gpt_plan
    from zeropp.zero.grouping import group_parameters, repeated_blocks

    with torch.device("meta"):
        gpt = GPT(gpt_config(model))
    local = local_numels(gpt, gpt_plan(gpt, tensor_parallel), tensor_parallel)
    experts = [layer.experts for layer in expert_layers(gpt)]
    grouped = group_parameters(gpt, [*repeated_blocks(gpt), *experts])
    numels = [(any(m is e for e in experts), [local[name] for name, _ in params]) for m, params in grouped]
    return [n for is_expert, n in numels if not is_expert], [n for is_expert, n in numels if is_expert]


def gpt_activations(model: ModelConfig, micro_batch: int, **switches: Any) -> Activations:
    """The embedded GPT's activations per micro-batch: n_layer blocks of micro_batch x block_size x d_model
    and its layer norms' weights and biases; `switches`: the other fields of
    :class:`~zeropp.costs.memory.Activations` (ZeRO-R's, sequence parallelism, the recomputed all-reduces)."""
    from zeropp.app.models.gpt import gpt_config

    gpt = gpt_config(model)
    return Activations(
        gpt.n_layer, gpt.d_model, gpt.block_size, micro_batch, norm_parameters=gpt_norm_parameters(gpt.n_layer),
        # the saved activations' formula is the dense MLP's: not priced for a mixture of experts
        heads=0 if gpt.n_experts else gpt.n_head, vocab=gpt.vocab_size, logit_tiles=gpt.logit_tiles,
        split_sublayers=1 if gpt.n_experts else 2, **switches,  # a mixture of experts runs whole on every tp rank
    )  # fmt: skip


def gpt_norm_parameters(layers: int) -> int:
    """Vectors of d_model in the embedded GPT's layer norms (two per block and the final one, a weight and
    a bias each): what sequence parallelism all-reduces the partial gradients of."""
    return 2 * (2 * layers + 1)
