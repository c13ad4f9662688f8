"""Expert parallelism: each mixture-of-experts layer's experts split over consecutive data-parallel
ranks of a node, tokens sent to them by all-to-all, each expert sharded ZeRO's way over the ranks
holding it."""

from zeropp.expert_parallel.apply import (
    apply_expert_parallel,
    check_expert_parallel,
    expert_layers,
    experts_containers,
    refuse_expert_parallel,
    split_experts,
)
from zeropp.expert_parallel.dispatch import dispatch_locally, dispatch_over

__all__ = [
    "apply_expert_parallel", "check_expert_parallel", "dispatch_locally", "dispatch_over", "expert_layers",
    "experts_containers", "refuse_expert_parallel", "split_experts",
]  # fmt: skip
