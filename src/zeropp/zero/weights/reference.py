"""qWD's reference of one sharded unit: the weights the unit's last gather reconstructed.

See [Note: qWD's reference] (docs/design.md). The whole reference is hpZ's secondary copy spread over
the secondary group (each rank's 1/H, cut when the unit reshards, gathered inside the node when the
next delta gather needs it); this rank's own rows of it, which it subtracts from its shard before
quantizing, are :attr:`WeightReference.shard`, cut at the same moment. ``version`` is the weights'
version (``FlatUnit.version``) the reconstruction was made from: the *previous* version once an
optimizer step has changed the weights, which is when a delta gather is wanted, while hpZ's
``secondary_valid`` asks for the current one.
"""

from __future__ import annotations

import torch

NONE = -1  # no reconstruction to refer to: the next gather sends the full weights


class WeightReference:
    """The reconstruction a unit's next delta gather refers to: ``secondary`` (this rank's 1/H of the whole
    buffer, hpZ's copy, shared with the unit) and ``shard`` (this rank's rows of it), made at ``version``."""

    def __init__(self, secondary: torch.Tensor, shard_numel: int) -> None:
        self.secondary = secondary
        self.shard = torch.empty(shard_numel, dtype=secondary.dtype, device=secondary.device)
        self.version = NONE

    @property
    def usable(self) -> bool:
        """Whether a gather may send changes against it (else it sends the full weights and records anew)."""
        return self.version != NONE

    def record(self, own_rows: torch.Tensor, version: int) -> None:
        """The unit reshards with hpZ's copy just cut from what was gathered at `version`: keep this rank's
        rows of the same reconstruction."""
        self.shard.copy_(own_rows)
        self.version = version

    def forget(self) -> None:
        """The weights changed outside the optimizer's step (a load): the next gather sends them in full."""
        self.version = NONE
