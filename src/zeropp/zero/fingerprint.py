"""Every rank must build the same model: a structural fingerprint compared across ranks.

A rank that builds another model (another config, another code version on one node) would train
wrong weights silently when the shapes happen to agree. The fingerprint describes the model as
lines: each module's class and plain attributes (``n_head``, ``eps``, ...), each parameter's and
buffer's name, shape, dtype and trainability, and the unit layout (which parameters form each
unit). Ranks all-gather a 32-byte digest of it through a Communicator; only when digests
differ do they gather the descriptions, to name the first line that differs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch
from torch import nn

from zeropp.comm.communicator import Communicator
from zeropp.comm.ledger import Ledger
from zeropp.errors import ConfigError
from zeropp.topology import Group, Topology
from zeropp.zero.grouping import group_parameters, repeated_blocks

_PLAIN = (bool, int, float, str, tuple)


class ModelMismatch(ConfigError):
    """Ranks built different models. One line: the ranks and the first difference."""


def describe(model: nn.Module, unit_modules: list[nn.Module]) -> list[str]:
    """The model's structure as lines, equal on two ranks exactly when they built the same model."""
    lines = []
    for name, module in model.named_modules():
        attrs = {k: v for k, v in vars(module).items() if isinstance(v, _PLAIN) and not k.startswith("_")}
        attrs.pop("training", None)
        lines.append(f"module {name or '(root)'}: {type(module).__qualname__} {sorted(attrs.items())}")
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in named:
            trainable = " trainable" if t.requires_grad else ""
            lines.append(f"{kind} {name}: {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}{trainable}")
    for index, (_, params) in enumerate(group_parameters(model, unit_modules)):
        lines.append(f"unit {index}: {[name for name, _ in params]}")
    return lines


def check_same_model(topology: Topology, model: nn.Module, units: Iterable[nn.Module] | None) -> list[nn.Module] | None:
    """Refuse (ModelMismatch, on every rank) when the ranks of the world built different models.

    Collective, through a Communicator with a ledger of its own: the engine's ledger holds the
    model's traffic (at construction, the initial broadcast only). Returns `units` as a list (it may
    be a one-pass iterable), None staying None.
    """
    comm, group = Communicator(topology, Ledger()), topology.world
    unit_modules = None if units is None else list(units)
    lines = describe(model, repeated_blocks(model) if unit_modules is None else unit_modules)
    text = "\n".join(lines).encode()
    digests = _gather_bytes(comm, group, hashlib.sha256(text).digest(), 32)
    different = [r for r, digest in enumerate(digests) if digest != digests[0]]
    if different:
        texts = _gather_bytes(comm, group, text)
        theirs = texts[different[0]].decode().split("\n")
        ours = texts[0].decode().split("\n")
        first = next((a, b) for a, b in zip([*ours, "(nothing)"], [*theirs, "(nothing)"], strict=False) if a != b)
        raise ModelMismatch(
            f"rank {group.ranks[different[0]]} built a different model than rank {group.ranks[0]}: "
            f"{first[1]!r} there, {first[0]!r} on rank {group.ranks[0]}"
        )
    return unit_modules


def _gather_bytes(comm: Communicator, group: Group, data: bytes, length: int | None = None) -> list[bytes]:
    """Every group rank's `data`, in group-rank order: `length` bytes on every rank (one all-gather),
    or any lengths when None (their lengths first)."""
    if length is None:
        sizes = [int.from_bytes(b, "little") for b in _gather_bytes(comm, group, len(data).to_bytes(8, "little"), 8)]
        padded = _gather_bytes(comm, group, data.ljust(max(sizes), b"\0"), max(sizes))
        return [p[:n] for p, n in zip(padded, sizes, strict=True)]
    device = comm.topology.device
    out = torch.empty(group.size * length, dtype=torch.uint8, device=device)
    local = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    comm.all_gather(out, local, group, bucket_numel=length)
    rows = out.view(group.size, length).cpu()
    return [rows[r].numpy().tobytes() for r in range(group.size)]
