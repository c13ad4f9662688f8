"""``zero.compile``: torch.compile per unit, under zeropp's eager gather and reshard hooks."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from zeropp.zero.grouping import innermost_units
from zeropp.zero.unit import FlatUnit


def compile_units(units: Sequence[FlatUnit]) -> None:
    """``torch.compile`` the forward of every unit that calls no other unit (the blocks: per block, as
    FSDP2 recommends). Only ``forward`` is replaced, so ``nn.Module.__call__`` still runs the hooks
    that gather and reshard eagerly around it, and the compiled code sees gathered parameters only.
    A unit that contains others (the root) stays eager: its forward calls the hooked units."""
    for unit in innermost_units(list(units)):
        unit.module.forward = torch.compile(unit.module.forward)
