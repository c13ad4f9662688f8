"""ZeRO stages as policies over the same units: what each rank keeps whole and what it keeps a shard of.

One engine runs every stage; a stage only answers three questions (ZeRO paper, section 5):

=====  ======================  ======================  =====================
stage  optimizer state + fp32  gradients               compute-dtype params
=====  ======================  ======================  =====================
0      whole (plain DP)        whole, all-reduced      whole
1      shard                   whole until the step    whole
2      shard                   shard, every backward   whole
3      shard                   shard, every backward   shard, gathered per use
=====  ======================  ======================  =====================
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StagePolicy:
    stage: int
    shard_optimizer: bool
    shard_gradients: bool
    shard_parameters: bool

    @classmethod
    def for_stage(cls, stage: int) -> StagePolicy:
        return cls(stage, shard_optimizer=stage >= 1, shard_gradients=stage >= 2, shard_parameters=stage >= 3)

    # See [Note: one-rank shard groups] (docs/design.md)
    def keeps_resident(
        self, numel: int, persistence_threshold: int, shard_ranks: int, params_offloaded: bool = False
    ) -> bool:
        """Whether a unit of `numel` elements stays gathered between uses: always below stage 3, and at
        stage 3 when it is small enough that gathering it every use costs more than it saves, or when
        its shard group is one rank (its shard is the whole unit: nothing to gather) and its
        parameters are not offloaded (then the compute copy's home is the host, not the device)."""
        alone = shard_ranks == 1 and not params_offloaded
        return not self.shard_parameters or numel <= persistence_threshold or alone
