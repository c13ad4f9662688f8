"""Context parallelism (Ulysses): every sequence split over consecutive data-parallel ranks, attention
by all-to-all between a sequence split and a head split."""

from zeropp.context_parallel.apply import (
    apply_context_parallel,
    check_context_parallel,
    check_heads,
    refuse_whole_prompts,
)
from zeropp.context_parallel.inputs import causal_lm_inputs, check_length, sequence_positions, split_sequence
from zeropp.context_parallel.ulysses import ulysses_attention

__all__ = [
    "apply_context_parallel", "causal_lm_inputs", "check_context_parallel", "check_heads", "check_length",
    "refuse_whole_prompts", "sequence_positions", "split_sequence", "ulysses_attention",
]  # fmt: skip
