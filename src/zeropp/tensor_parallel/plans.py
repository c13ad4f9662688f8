"""The shipped tensor-parallel plans: Megatron's layout for the embedded GPT, Hugging Face
``LlamaForCausalLM`` (transformers' own, translated) and ``GPT2LMHeadModel``, each with sequence
parallelism as an option
(:func:`sequence_parallel_plan`). A plan maps module names (fnmatch patterns) to DTensor styles.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from zeropp.errors import ConfigError
from zeropp.tensor_parallel.conv1d import Conv1DColwise, Conv1DRowwise, LocalHeads
from zeropp.tensor_parallel.hf_plans import Plan, hf_plan, require_equal_shares

SEQUENCE = Shard(1)  # activations are batch-first: (batch, sequence, hidden)


def gpt_plan(model: nn.Module, tp: int, sequence_parallel: bool = False) -> Plan:
    """Megatron's layout for the embedded GPT (:mod:`zeropp.app.models.gpt`): attention's qkv and the
    MLP's first linear split column-wise (each rank whole heads, a slice of the hidden units), their
    output projections row-wise.

    Embeddings, layer norms and the LM head stay whole on every rank: the head is tied to the token
    embedding, and splitting the vocabulary would take a vocabulary-parallel embedding plus a
    loss-parallel cross-entropy for one vocab x d_model matrix; whole, they cost no traffic. A
    mixture of experts (``model.n_experts``: router and experts) stays whole too, every rank routing
    the same tokens (expert parallelism splits its experts over data-parallel ranks instead).
    `sequence_parallel`: :func:`sequence_parallel_plan`'s layout on top (not with experts, whose
    gradients would be partial sums over the ranks' slices of the sequence)."""
    config = model.config
    require_equal_shares(tp, {"model.n_head": config.n_head})  # the MLP's 4 d_model follows
    if sequence_parallel and config.n_experts:
        raise ConfigError(
            f"topology.sequence_parallel is not allowed with model.n_experts = {config.n_experts} (not composed yet); "
            "expected false (tensor parallelism without it runs the experts whole on every rank)"
        )
    plan: Plan = {}
    for i in range(len(model.blocks)):
        plan[f"blocks.{i}.attn.qkv"] = ColwiseParallel()
        plan[f"blocks.{i}.attn.proj"] = _rowwise(sequence_parallel)
        if not config.n_experts:  # a dense MLP
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
    """Megatron's layout for Hugging Face ``LlamaForCausalLM``: transformers' own plan translated
    (:func:`~zeropp.tensor_parallel.hf_plans.hf_plan`: q, k, v and the MLP's gate and up projections
    column-wise, each rank whole query and key/value heads, o_proj and down_proj row-wise; embeddings,
    norms and the LM head whole on every rank). `sequence_parallel`: :func:`sequence_parallel_plan`'s
    layout on top, the row-wise linears reduce-scattering (a decoder layer hands its attention the
    hidden states as a keyword)."""
    plan = hf_plan(model, tp)
    if sequence_parallel:
        layer = "model.layers.*"
        plan |= {f"{layer}.self_attn.o_proj": _rowwise(True), f"{layer}.mlp.down_proj": _rowwise(True)}
        plan |= sequence_parallel_plan(
            first_block="model.layers.0",
            norms=(f"{layer}.input_layernorm", f"{layer}.post_attention_layernorm", "model.norm"),
            gathered={f"{layer}.self_attn": "hidden_states", f"{layer}.mlp": None},
            head="lm_head",
        )
    return plan


def gpt2_plan(model: nn.Module, tp: int, sequence_parallel: bool = False) -> Plan:
    """Megatron's layout for Hugging Face ``GPT2LMHeadModel``: c_attn (each rank its heads of q, k and
    v) and the MLP's c_fc column-wise, the two c_proj row-wise; embeddings, layer norms and the LM
    head (tied to the token embedding) whole on every rank. `sequence_parallel`:
    :func:`sequence_parallel_plan`'s layout on top; attention and the MLP each begin with one
    column-wise Conv1D, which gathers the sequence itself (its input hook) where the other plans
    gather at the module holding several. The region starts at the embeddings' dropout and ends
    before the final norm, which runs on the whole sequence (GPT2Model views its output with the
    whole sequence length), so its gradient is whole, not partial."""
    config = model.config
    require_equal_shares(tp, {"n_head": config.n_head, "n_inner": config.n_inner or 4 * config.n_embd})
    block = "transformer.h.*"
    gathered = SEQUENCE if sequence_parallel else None
    plan: Plan = {
        f"{block}.attn": LocalHeads(),
        f"{block}.attn.c_attn": Conv1DColwise(fused=3, input_layouts=gathered),
        f"{block}.attn.c_proj": _rowwise(sequence_parallel, Conv1DRowwise),
        f"{block}.mlp.c_fc": Conv1DColwise(input_layouts=gathered),
        f"{block}.mlp.c_proj": _rowwise(sequence_parallel, Conv1DRowwise),
    }
    if sequence_parallel:  # GPT2Model reshapes ln_f's output with the whole sequence length: gather before it
        plan |= sequence_parallel_plan(
            first_block="transformer.drop",
            norms=(f"{block}.ln_1", f"{block}.ln_2"),
            gathered={},
            head="transformer.ln_f",
        )
    return plan


def _rowwise(sequence_parallel: bool, style: type[RowwiseParallel] = RowwiseParallel) -> RowwiseParallel:
    """A row-wise linear: its partial outputs all-reduced, or with sequence parallelism reduce-scattered
    over the sequence."""
    return style(output_layouts=SEQUENCE) if sequence_parallel else style()


def sequence_parallel_plan(
    first_block: str, norms: tuple[str, ...], gathered: dict[str, str | None], head: str
) -> Plan:
    """Megatron's sequence parallelism (as torchtitan lays it out): between the split layers every
    tensor-parallel rank keeps 1/tp of the sequence of the residual stream, and the norms run on it.

    - `first_block`: the region's first module: takes the whole embeddings (its one positional
      input) and keeps this rank's slice (a local cut; its
      backward all-gathers the input gradient);
    - `norms`: :class:`SequenceParallel` (their weights whole on every rank, their gradients partial:
      each rank saw its own slice; the engine sums them over the tensor-parallel group);
    - `gathered`: the modules whose column-wise linears need the whole sequence ({name: the keyword
      their input comes as, None: the first positional}): all-gathered in forward, kept a DTensor so
      that their linears' partial input gradients add up to one reduce-scatter in backward; the
      row-wise linears that end them reduce-scatter their outputs over the sequence (:func:`_rowwise`);
    - `head`: the first module after the region (the whole LM head, or the final norm) takes the
      whole sequence: all-gathered in forward, its input
      gradient cut locally in backward.

    Module outputs are this rank's slice as a plain tensor, so the model's own code (residual adds,
    slicing) runs on them unchanged."""
    plan: Plan = {first_block: SequenceSliced()}
    plan |= {norm: SequenceParallel(use_local_output=True) for norm in norms}
    for name, keyword in gathered.items():
        plan[name] = (
            PrepareModuleInput(input_layouts=SEQUENCE, desired_input_layouts=Replicate())
            if keyword is None
            else PrepareModuleInput(
                input_kwarg_layouts={keyword: SEQUENCE}, desired_input_kwarg_layouts={keyword: Replicate()}
            )
        )
    plan[head] = SequenceGathered()
    return plan


class SequenceSliced(PrepareModuleInput):
    """The sequence-parallel region's first module: takes its input whole, keeps this rank's slice."""

    def __init__(self) -> None:
        super().__init__(input_layouts=Replicate(), desired_input_layouts=SEQUENCE, use_local_output=True)


class SequenceGathered(PrepareModuleInput):
    """The first module after the sequence-parallel region: takes the whole sequence, all-gathered."""

    def __init__(self) -> None:
        super().__init__(input_layouts=SEQUENCE, desired_input_layouts=Replicate(), use_local_output=True)
