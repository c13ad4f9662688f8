"""A batch as one context-parallel rank sees it: its slice of every sequence, the slice's positions,
and for causal language models the labels shifted before the split and the loss normalized over the
whole sequence (a mean over all of its tokens, not a mean of the slices' means)."""

from __future__ import annotations

import torch

from zeropp.errors import ConfigError
from zeropp.topology import Topology

IGNORE_INDEX = -100  # transformers' and torch's cross-entropy default


def check_length(length: int, size: int) -> None:
    """Each rank keeps an equal slice: refuse a sequence that does not split evenly."""
    if length % size:
        raise ConfigError(
            f"a sequence of {length} tokens is not allowed with topology.context_parallel_size = {size}; "
            f"expected a multiple of {size} (each rank keeps an equal slice)"
        )


def sequence_slice(topology: Topology, length: int) -> slice:
    """This rank's tokens of a sequence of `length`: the group's rank-th of equal consecutive slices."""
    group = topology.context_parallel
    check_length(length, group.size)
    step = length // group.size
    return slice(group.rank * step, (group.rank + 1) * step)


def split_sequence(topology: Topology, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each (batch, T, ...) tensor cut to this rank's slice of T (a copy: the whole batch is not kept
    alive by a view of it)."""
    return tuple(t[:, sequence_slice(topology, t.shape[1])].contiguous() for t in tensors)


def sequence_positions(topology: Topology, length: int, device: torch.device | None = None) -> torch.Tensor:
    """The positions of this rank's slice in a sequence of `length` (for position embeddings, rotary)."""
    part = sequence_slice(topology, length)
    return torch.arange(part.start, part.stop, device=device)


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Each token's label moved to the token before it (the next-token target), the last ignored."""
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], dim=1)


def causal_lm_inputs(
    topology: Topology,
    input_ids: torch.Tensor,
    labels: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
) -> dict[str, torch.Tensor | float]:
    """A Hugging Face causal language model's keyword arguments for this rank's slice of whole
    sequences: input_ids (and `attention_mask`, the padding mask, where given), the labels shifted by
    one over the whole sequence before the cut (``shift_labels``; `labels` default to the input ids),
    and ``num_items_in_batch`` so that the rank's loss is its summed token losses over the rows'
    counted tokens / C: averaged over the data-parallel group (ZeRO's gradient mean), the mean over
    every token. The slice's positions are filled in by the model's context-parallel hook (See [Note:
    masks of split sequences]). Without context parallelism: the model's own loss, unchanged."""
    labels = input_ids if labels is None else labels
    shifted = shift_labels(labels)
    counted = int((shifted != IGNORE_INDEX).sum())
    part = sequence_slice(topology, input_ids.shape[1])
    sliced = dict(input_ids=input_ids, labels=labels, shift_labels=shifted)
    if attention_mask is not None:
        sliced["attention_mask"] = attention_mask
    return {
        **{name: tensor[:, part].contiguous() for name, tensor in sliced.items()},
        "num_items_in_batch": counted / topology.context_parallel.size,
    }
