"""Tensor parallelism in the simulator: each run of T GPUs of a node splits every layer Megatron-style.

A tensor-parallel group trains one data-parallel replica's micro-batch: T times the tokens per GPU, each
GPU a 1/T slice of every weight (:func:`split_units`: Ψ/T, the ZeRO paper's Ψ/N_m), so a GPU's FLOPs
are those of its share of the global batch, as without tensor parallelism. Its collectives (the
ledger's ``tp.*`` and ``pa.*``, :mod:`zeropp.costs.volume`'s Megatron and sequence-parallel transfers,
the estimator's with :func:`group_activations` given) run on the group's NVLink, and each waits for
the matmul before it and blocks the one after it: on the critical path, not overlapped (docs/simulate.md).

Activations (Korthikanti et al. 2022, flash attention): a block holds 34 bytes per token and unit of
d_model, of which :data:`SPLIT_ACTIVATION_BYTES` lie between the split layers (each GPU 1/T of them) and
:data:`REPLICATED_ACTIVATION_BYTES` outside (whole on every GPU of the group, but with sequence
parallelism, which splits them over the sequence too).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from zeropp.costs.memory import Activations
from zeropp.costs.volume import Transfer
from zeropp.errors import ConfigError
from zeropp.tools.estimate.gpt import gpt_norm_parameters

# bytes per token and unit of d_model of one block's activations, Korthikanti et al. 2022 (their 34 s b h):
# outside the split layers the norms' inputs (4), the qkv and MLP inputs (2 each) and two dropout masks (1 each)
REPLICATED_ACTIVATION_BYTES = 10
# between them q, k and v (4 and 2), the output projection's input (2), the MLP's hidden before and after GELU (8 each)
SPLIT_ACTIVATION_BYTES = 24
TENSOR_PARALLEL_OPS = ("tp.", "pa.")  # the ledger's collectives on a tensor-parallel group


def check_tensor_parallel(tp: int, ranks_per_node: int, heads: int | None, sequence_parallel: bool) -> None:
    """Refuse in one line what zeropp cannot lay out: T not dividing a node's GPUs (a group stays inside
    one node) or the attention heads (each GPU computes whole heads); sequence parallelism without T > 1."""
    if tp < 1 or ranks_per_node % tp:
        raise ConfigError(f"--tensor-parallel-size {tp} does not divide --gpus-per-node {ranks_per_node}")
    if heads is not None and heads % tp:
        raise ConfigError(f"--tensor-parallel-size {tp} does not divide the {heads} attention heads (--n-head)")
    if sequence_parallel and tp == 1:
        raise ConfigError("--sequence-parallel needs --tensor-parallel-size > 1")


def split_units(units: Sequence[int | Sequence[int]], tp: int) -> tuple[Any, ...]:
    """Each unit on one tensor-parallel GPU: every parameter's numel over `tp`, rounded up (the layer
    norms and, in zeropp's embedded GPT, the embeddings stay whole there: not modelled)."""
    return tuple(math.ceil(u / tp) if isinstance(u, int) else tuple(math.ceil(n / tp) for n in u) for u in units)


def group_activations(
    n_layer: int,
    d_model: int,
    group_tokens: int,
    checkpointing: bool,
    sequence_parallel: bool,
    partition_activations: bool = False,
) -> Activations:
    """The estimator's activations of one tensor-parallel group's micro-batch (`group_tokens` tokens),
    for its ``tp.*`` transfers and the checkpoints (the norms': the embedded GPT's, two per block); with
    `partition_activations` (ZeRO-R's Pa) each checkpoint split over the group and all-gathered before
    its recomputation (the ledger's ``pa.all_gather``)."""
    return Activations(
        n_layer, d_model, group_tokens, 1, checkpointing, partition_activations=partition_activations,
        sequence_parallel=sequence_parallel, norm_parameters=gpt_norm_parameters(n_layer),
    )  # fmt: skip


def block_activation_bytes(group_tokens: int, d_model: int, tp: int, sequence_parallel: bool) -> float:
    """One block's activations on one GPU of the group: the split part over T, the rest whole unless
    sequence parallelism splits it too (at T = 1: 34 bytes per token and unit of d_model)."""
    replicated = REPLICATED_ACTIVATION_BYTES / (tp if sequence_parallel else 1)
    return group_tokens * d_model * (replicated + SPLIT_ACTIVATION_BYTES / tp)


def on_tensor_parallel_group(transfer: Transfer) -> bool:
    return transfer.op.startswith(TENSOR_PARALLEL_OPS)
