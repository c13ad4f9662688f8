"""Tensor parallelism from outside the model: DTensor plans applied before the engine wraps it.

- :mod:`~zeropp.tensor_parallel.apply`: ``parallelize`` (and the shipped plan of a model class,
  ``plan_for``), the sequence-length check of sequence parallelism;
- :mod:`~zeropp.tensor_parallel.plans`: Megatron's layout for the embedded GPT, Hugging Face
  Llama and GPT-2, with sequence parallelism as an option;
- :mod:`~zeropp.tensor_parallel.conv1d`: the styles for transformers' ``Conv1D``;
- :mod:`~zeropp.tensor_parallel.rng`: each rank's own dropout stream where activations are split.

What a plan costs (bytes per block, each rank's parameter sizes) is a cost model:
:mod:`zeropp.costs.tensor_parallel`.
"""

from zeropp.tensor_parallel.apply import PLANS, check_sequence_length, parallelize, plan_for, tensor_parallel_mesh
from zeropp.tensor_parallel.plans import Plan, sequence_parallel_plan

__all__ = [
    "PLANS",
    "Plan",
    "check_sequence_length",
    "parallelize",
    "plan_for",
    "sequence_parallel_plan",
    "tensor_parallel_mesh",
]
