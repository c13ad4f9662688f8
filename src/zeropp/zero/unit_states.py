"""The two states of a :class:`~zeropp.zero.unit.FlatUnit`: whether its weights are gathered, and where it
stands in a backward pass."""

from __future__ import annotations

import enum


class ShardState(enum.Enum):
    SHARDED = "sharded"  # only this rank's shard exists; parameters point at empty storage
    GATHERING = "gathering"  # an all-gather into compute_flat is in flight
    UNSHARDED = "unsharded"  # parameters are views of the gathered compute_flat


class TrainingState(enum.Enum):
    IDLE = "idle"  # no backward pass under way (forward and evaluation run here)
    PRE_BACKWARD = "pre_backward"  # backward has begun; no output gradient has reached the unit yet
    BACKWARD = "backward"  # gathered for backward; parameter gradients are arriving
    POST_BACKWARD = "post_backward"  # every gradient of this backward is in (reduced, or kept to accumulate)
