"""What a plan costs, without applying it: the elements each tensor-parallel rank holds of every
parameter (for the estimator; the model may live on the meta device) and the bytes a transformer
block sends per micro-batch (Megatron's layout, with or without sequence parallelism; any plan of the
styles transformers' plans translate to, derived module by module: :func:`plan_transfers`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from zeropp.comm.ledger import ring_bytes
from zeropp.costs.volume import (
    SEQUENCE_PARALLEL_RECOMPUTED,
    Transfer,
    megatron_transfers,
    sequence_parallel_transfers,
)
from zeropp.tensor_parallel.hf_plans import AllReducedOutput, MoeExperts, Plan, blocks_name, matches
from zeropp.zero.weights.dtensor_params import splits

# (style, module type) -> {parameter: the dimension the style shards it on}; what parallelize_module does
# (a style with ``param_placements``, such as zeropp.tensor_parallel.conv1d's, says it itself)
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
    styles = styled_modules(model, plan)
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
    repeats (:attr:`~zeropp.costs.memory.Activations.recomputed_all_reduces`), 2 (tp-1)/tp of it each. With
    `sequence_parallel` the same bytes without recomputation: 4 all-gathers and 4 reduce-scatters,
    (tp-1)/tp of it each, plus those recomputation repeats (:data:`~zeropp.costs.volume.SEQUENCE_PARALLEL_RECOMPUTED`)."""
    elements = batch * seq * hidden
    if sequence_parallel:
        transfers = sequence_parallel_transfers(elements, element_bytes, tp, SEQUENCE_PARALLEL_RECOMPUTED[recomputed])
    else:
        transfers = megatron_transfers(elements, element_bytes, tp, recomputed)
    return sum(t.sent for t in transfers)


def styled_modules(model: nn.Module, plan: Plan) -> dict[str, tuple[ParallelStyle, nn.Module]]:
    """{module name: (its style, the module)} for every module of `model` a pattern of `plan` matches."""
    return {
        name: (style, module)
        for name, module in model.named_modules()
        for pattern, style in plan.items()
        if matches(name, pattern)
    }


def plan_step_transfers(model: nn.Module, plan: Plan, tokens: int, element_bytes: int, tp: int) -> Iterator[Transfer]:
    """Every tensor-parallel collective of one micro-batch under `plan`: each block's
    (:func:`plan_transfers`, the blocks named by ``base_model_pp_plan``), then the rest of the model's
    (a split embedding)."""
    blocks = blocks_name(model)
    styled = styled_modules(model, plan)
    for index in range(len(model.get_submodule(blocks))):
        yield from plan_transfers(model, plan, tokens, element_bytes, tp, f"{blocks}.{index}.")
    outside = {n: s for n, s in styled.items() if not n.startswith(f"{blocks}.")}
    yield from _transfers(model, outside, tokens, element_bytes, tp)


def plan_transfers(
    model: nn.Module, plan: Plan, tokens: int, element_bytes: int, tp: int, block: str
) -> Iterator[Transfer]:
    """The tensor-parallel collectives one micro-batch of `tokens` tokens costs one rank in `block` (a
    prefix: ``"model.layers.0."``) under `plan` (the styles :func:`~zeropp.tensor_parallel.hf_plans.hf_plan`
    translates to), module by module (`element_bytes`: activations' and gradients' size):

    - column-wise linear: its whole input's gradient all-reduced in backward; an output gathered
      whole (``colwise_rep``) all-gathered in forward;
    - row-wise linear: its output all-reduced in forward; a whole input (``rowwise_rep``) is cut
      locally, its gradient all-gathered in backward;
    - embedding: the vocabulary split, lookups all-reduced; the hidden dimension split, gathered;
    - experts (:class:`~zeropp.tensor_parallel.hf_plans.MoeExperts`): the output all-reduced in forward,
      the tokens' and routing weights' gradients in backward (``num_experts_per_tok`` weights a token);
    - all-reduced output: the module's output (``out_features``, else the hidden size);
    - head norms (``replicated_with_grad_allreduce``): their partial weight gradients, all-reduced with
      the unit's gradients as one message (once per gradient reduction: every micro-batch at stages 2-3)."""
    styled = {n: s for n, s in styled_modules(model, plan).items() if n.startswith(block)}
    yield from _transfers(model, styled, tokens, element_bytes, tp)


def _transfers(
    model: nn.Module, styled: dict[str, tuple[ParallelStyle, nn.Module]], tokens: int, element_bytes: int, tp: int
) -> Iterator[Transfer]:
    """:func:`plan_transfers` of the `styled` modules (one unit's: their head norms' gradients one message)."""

    def reduce(elements: int, phase: str) -> Transfer:
        return Transfer("tp.all_reduce", phase, ring_bytes(elements * element_bytes, tp, passes=2), 0.0)

    def gather(elements: int, phase: str) -> Transfer:
        return Transfer("tp.all_gather", phase, ring_bytes(elements * element_bytes, tp), 0.0)

    config = getattr(model, "config", None)
    hidden = getattr(config, "hidden_size", 0)
    partial = 0
    for style, module in styled.values():
        embedding = isinstance(module, nn.Embedding)
        width_in = 0 if embedding else getattr(module, "in_features", 0)
        width_out = module.embedding_dim if embedding else getattr(module, "out_features", hidden)
        if isinstance(style, MoeExperts):
            yield reduce(tokens * module.hidden_dim, "forward")
            yield reduce(tokens * module.hidden_dim, "backward")
            yield reduce(tokens * config.num_experts_per_tok, "backward")
        elif isinstance(style, AllReducedOutput):
            yield reduce(tokens * width_out, "forward")
        elif isinstance(style, SequenceParallel):
            partial += sum(p.numel() for p in module.parameters(recurse=False))
        elif isinstance(style, ColwiseParallel):
            if width_in:
                yield reduce(tokens * width_in, "backward")
            if style.output_layouts == (Replicate(),):
                yield gather(tokens * width_out, "forward")
        elif isinstance(style, RowwiseParallel):
            yield reduce(tokens * width_out, "forward")
            if width_in and style.input_layouts == (Replicate(),):
                yield gather(tokens * width_in, "backward")
    if partial:
        yield Transfer("tp.all_reduce", "backward", ring_bytes(partial * element_bytes, tp, passes=2), 0.0)
