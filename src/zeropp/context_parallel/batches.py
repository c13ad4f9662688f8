"""A data loader's batch under context parallelism when every rank reads rows of its own (a host
loop's loader, sharded over the whole world as for data parallelism): the C ranks of a run share
their rows, and each keeps its slice of all of them.

[Note: shared rows]
Ulysses needs the C ranks of a context-parallel run to hold slices of the same sequences. The
Trainer's loader hands each rank its own rows, as it would for DDP. Rather than change the loader,
the ranks of a run gather each other's rows (every (rows, T) tensor of the batch: a few bytes a
token, ``cp.all_gather`` in the ledger) and each keeps its 1/C slice of all C x rows: the same
tokens per rank as without context parallelism, the same global batch, each row's tokens now on C
ranks. Rows of different lengths on different ranks (a collator pads to each batch's longest) are
padded on the right to a common length that C divides: labels by -100, padding masks by 0, position
ids counting on, anything else by 0. Padding after a causal sequence changes none of its tokens, and
the labels are shifted over whole rows before the cut (``shift_labels``), so each loss term is the
one a data-parallel rank computes on its own rows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from zeropp.comm.communicator import Communicator
from zeropp.context_parallel.inputs import IGNORE_INDEX, sequence_slice, shift_labels
from zeropp.context_parallel.masks import GATHER_OP
from zeropp.errors import ConfigError
from zeropp.topology import Topology

PADDING = {"labels": IGNORE_INDEX, "shift_labels": IGNORE_INDEX, "attention_mask": 0}  # else 0, positions count on


def share_rows(comm: Communicator, topology: Topology, batch: Mapping[str, Any]) -> dict[str, Any]:
    """`batch` (this rank's rows) as this rank's slice of the rows of its whole context-parallel run,
    rank order; ``shift_labels`` added from ``labels``. See [Note: shared rows]."""
    group = topology.context_parallel
    rowed = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() >= 2}
    if not rowed:
        return dict(batch)
    shapes = {tuple(v.shape[:2]) for v in rowed.values()}
    if len(shapes) > 1:
        raise ConfigError(
            f"a batch whose tensors have different (rows, tokens) {sorted(shapes)} is not allowed with "
            f"topology.context_parallel_size = {group.size}; expected one length for {', '.join(rowed)}"
        )
    ((rows, length),) = shapes
    device = next(iter(rowed.values())).device
    sizes = torch.empty((group.size, 2), dtype=torch.int64, device=device)
    comm.all_gather(sizes, torch.tensor([rows, length], device=device), group, bucket_numel=2, label=GATHER_OP)
    if len(set(sizes[:, 0].tolist())) > 1:
        raise ConfigError(
            f"batches of {sorted(set(sizes[:, 0].tolist()))} rows on the ranks of one context-parallel run are not "
            f"allowed (topology.context_parallel_size = {group.size}); expected as many rows on each (drop the last "
            "batch: dataloader_drop_last)"
        )
    common = -(-int(sizes[:, 1].max()) // group.size) * group.size
    if "labels" in rowed and "shift_labels" not in rowed:
        rowed["shift_labels"] = shift_labels(rowed["labels"])
    part = sequence_slice(topology, common)
    shared = dict(batch)
    for name, tensor in rowed.items():
        padded = _pad(name, tensor, common)
        every = torch.empty((group.size, *padded.shape), dtype=padded.dtype, device=device)
        comm.all_gather(every, padded.contiguous(), group, bucket_numel=padded.numel(), label=GATHER_OP)
        shared[name] = every.flatten(0, 1)[:, part].contiguous()
    return shared


def _pad(name: str, tensor: torch.Tensor, length: int) -> torch.Tensor:
    """`tensor` (rows, T, ...) right-padded to `length` tokens (see PADDING)."""
    extra = length - tensor.shape[1]
    if extra == 0:
        return tensor
    if name == "position_ids":
        more = tensor[:, -1:] + torch.arange(1, extra + 1, device=tensor.device)
        return torch.cat([tensor, more], dim=1)
    trailing = [0, 0] * (tensor.dim() - 2)
    return F.pad(tensor, [*trailing, 0, extra], value=PADDING.get(name, 0))


def own_rows_loss(
    comm: Communicator,
    topology: Topology,
    logits_of: Callable[[dict[str, Any]], torch.Tensor],
    batch: Mapping[str, Any],
) -> torch.Tensor:
    """The mean token loss of this rank's own rows (labels shifted by one, -100 ignored), as a data-parallel
    rank computes it on them, from the slices of its run's shared rows: `logits_of` maps the shared
    inputs (without labels) to the slice's logits; each slice's summed losses and counted tokens are
    added up over the run by the rows' source rank."""
    group = topology.context_parallel
    shared = share_rows(comm, topology, batch)
    targets = shared.pop("shift_labels")
    shared.pop("labels", None)
    logits = logits_of(shared).float()
    losses = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    by_rank = losses.view(group.size, -1).sum(dim=1)
    counted = (targets != IGNORE_INDEX).view(group.size, -1).sum(dim=1).to(by_rank.dtype)
    totals = torch.stack([by_rank, counted])
    comm.all_reduce(totals, group, reduce="sum")
    return totals[0, group.rank] / totals[1, group.rank]
