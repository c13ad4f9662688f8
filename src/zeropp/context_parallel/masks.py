"""What attention needs of the whole sequence when each rank holds a slice of it: the padding mask
and the positions of every slice, and the mask transformers builds from them for the implementation
Ulysses wraps.

[Note: masks of split sequences]
Transformers builds a model's attention mask in its forward, from the 2-D padding mask and the
positions it was given, for the length it sees: under context parallelism, a slice. Ulysses attends
whole sequences, so the mask must be the one one process would build for the whole sequence. A
forward pre-hook on the model (:meth:`SequenceInputs.take`) gathers the slices' padding masks and
given position ids over the context-parallel group (``cp.all_gather`` in the ledger; a few bytes a
token, only when the caller gives them), fills in this slice's positions when the caller gave none
(one process counts 0, 1, ... over the whole sequence), and hands the model its slice as before. The
attention then asks :meth:`SequenceInputs.mask` for the whole sequence's mask, which transformers'
own ``create_causal_mask`` builds from the gathered inputs for the wrapped implementation: causal,
padding, and packed documents (positions restarting, with no padding mask and no key-value cache:
``use_cache=False``, as transformers reads them) exactly as one process would; None where that
implementation attends causally without one (sdpa without padding or packing). Flash attention takes padding and packing through its own arguments, which zeropp does not
route: refused in one line.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from zeropp.comm.communicator import Communicator
from zeropp.context_parallel.inputs import sequence_positions
from zeropp.errors import ConfigError
from zeropp.topology import Group

GATHER_OP = "cp.all_gather"  # the ledger's name of the gathered masks and positions
MASK_ARGUMENT, POSITION_ARGUMENTS = "attention_mask", ("position_ids", "positions")  # HF's, the embedded GPT's
TOKEN_ARGUMENTS = ("input_ids", "inputs_embeds", "idx")  # what says the slice's length


class SequenceInputs:
    """The whole-sequence inputs of the forward under way (see [Note: masks of split sequences])."""

    def __init__(self, comm: Communicator, group: Group, implementation: str | None = None) -> None:
        self.comm, self.group, self.implementation = comm, group, implementation  # None: the embedded GPT's
        self.padding: torch.Tensor | None = None  # (batch, T) bool, None: no padding anywhere
        self.positions: torch.Tensor | None = None  # (batch or 1, T), None: 0, 1, ... (as not given)
        self._built: dict[tuple, torch.Tensor | None] = {}

    def take(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """The model's forward pre-hook: gather what the caller gave, fill in this slice's positions."""
        try:
            bound = inspect.signature(module.forward).bind_partial(*args, **kwargs)
        except TypeError:  # the forward itself will say what is wrong with its arguments
            return None
        given = bound.arguments
        self._built.clear()
        mask = given.get(MASK_ARGUMENT)
        self.padding = None
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            whole = self._gather(mask.to(torch.int64)).bool()
            self.padding = None if bool(whole.all()) else whole
        elif mask is not None:
            raise ConfigError(
                f"an {MASK_ARGUMENT} of {mask.dim() if isinstance(mask, torch.Tensor) else type(mask).__name__} "
                f"dimensions is not allowed with topology.context_parallel_size = {self.group.size}; expected the "
                "2-D padding mask of this rank's slice (batch, tokens)"
            )
        self.positions = None
        name = next((n for n in POSITION_ARGUMENTS if n in inspect.signature(module.forward).parameters), None)
        if name == "position_ids" and given.get(name) is not None:  # transformers finds packed documents in them
            whole = self._gather(given[name].to(torch.int64))
            counted = bool((whole == torch.arange(whole.shape[1], device=whole.device)).all())
            self.positions = None if counted or _caches(module, given) else whole  # as one process reads them
        self._check_flash()
        if name is None or given.get(name) is not None:
            return None
        tokens = next((given[n] for n in TOKEN_ARGUMENTS if given.get(n) is not None), None)
        if tokens is None:
            return None
        whole = tokens.shape[1] * self.group.size
        bound.arguments[name] = sequence_positions(self.comm.topology, whole, tokens.device).unsqueeze(0)
        return bound.args, bound.kwargs

    def _gather(self, part: torch.Tensor) -> torch.Tensor:
        """(rows, T/C) slices of every rank of the group -> (rows, T), in slice order."""
        c = self.group.size
        out = torch.empty((c, *part.shape), dtype=part.dtype, device=part.device)
        self.comm.all_gather(out, part.contiguous(), self.group, bucket_numel=part.numel(), label=GATHER_OP)
        return out.permute(1, 0, 2).reshape(part.shape[0], c * part.shape[1])

    @property
    def masked(self) -> bool:
        """Whether attention needs more than causality: padding, or positions that may restart."""
        return self.padding is not None or self.positions is not None

    def mask(self, config: Any, implementation: str, query: torch.Tensor) -> torch.Tensor | None:
        """The mask transformers builds for one process on the whole sequences of this forward, for
        `implementation` (sdpa: boolean or None; eager: additive); `query`: (batch, heads, T, d)."""
        key = (implementation, query.dtype, query.device)
        if key not in self._built:
            self._built[key] = None if "flash" in implementation else self._build(config, implementation, query)
        return self._built[key]

    def _build(self, config: Any, implementation: str, query: torch.Tensor) -> torch.Tensor | None:
        from transformers.masking_utils import create_causal_mask

        batch, _, length, _ = query.shape
        embeds = query.new_empty((batch, length, 0))  # what the builder reads: batch, length, dtype, device
        # positional: the cache argument's name changed within transformers 5
        return create_causal_mask(_Implemented(config, implementation), embeds, self.padding, None, self.positions)

    def _check_flash(self) -> None:
        """Flash attention takes padding and packed documents through arguments zeropp does not route
        (checked after the gather, so every rank of the group refuses alike)."""
        if self.implementation is not None and "flash" in self.implementation and self.masked:
            raise ConfigError(
                f"attn_implementation = {self.implementation!r} with an {MASK_ARGUMENT} or position_ids is not allowed "
                f"with topology.context_parallel_size = {self.group.size}; expected sdpa or eager (they take padding "
                "and packed documents by a mask)"
            )


def _caches(model: nn.Module, given: dict) -> bool:
    """Whether transformers' forward would make a key-value cache, and so not look for packed documents
    in the positions: ``use_cache`` as given, else the config's, off under transformers' own gradient
    checkpointing (its rule for training)."""
    use = given.get("use_cache")
    if use is None:
        use = getattr(getattr(model, "config", None), "use_cache", False)
        if use and getattr(model, "is_gradient_checkpointing", False) and model.training and torch.is_grad_enabled():
            use = False
    return bool(use)


class _Implemented:
    """A model config as transformers' mask builder reads it, naming the implementation Ulysses wraps."""

    def __init__(self, config: Any, implementation: str) -> None:
        self._config, self._attn_implementation = config, implementation

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)
