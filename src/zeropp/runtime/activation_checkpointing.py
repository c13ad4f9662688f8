"""Activation checkpointing per unit, and ZeRO-R's partitioned checkpoints (Pa), their CPU offload
(Pa+cpu) and contiguous checkpoint memory (MD).

With ``activation_checkpointing`` the ``forward`` of every block (a unit that contains no other
unit, :func:`zeropp.zero.grouping.innermost_units`) runs through torch's non-reentrant
``torch.utils.checkpoint.checkpoint`` inside a pair of saved-tensor hooks of ours. Torch's
checkpoint saves the block's positional tensor inputs as saved tensors *before* it installs its own
hooks for what runs inside the block, so ours see exactly the block's checkpointed inputs: *pack*
at forward, *unpack* right before the block's recomputation in backward. Nothing else of the block's
forward is kept. (Keyword tensor arguments are kept by torch's closure as they are.)

- Plain checkpointing keeps each input as it is.
- Pa (``partition_activations``): the input is replicated on the tensor-parallel ranks (Megatron's
  layout: a block takes the whole hidden state), so each keeps 1/t of it: flattened, padded to a
  multiple of t, this rank's contiguous 1/t copied out (any shape, any dtype). Unpack all-gathers
  the pieces over the tensor-parallel group through :class:`~zeropp.comm.Communicator` (the
  ledger's ``pa.all_gather``, phase backward, (t-1)/t of the input's bytes per rank) and cuts the
  padding off. With t = 1 the piece is the whole input (a copy, no traffic); so it is with
  sequence parallelism, where the engine gives a group of one rank: each rank's block input is
  already its own 1/t of the sequence, different on every rank.
- Pa+cpu (``cpu_checkpointing``): the piece is copied to host memory at pack (pinned, non-blocking
  on CUDA). When a block's input is unpacked, the piece of the block recomputed next (the one
  stored before it) starts coming back to the device first, so each piece is fetched one block
  ahead; at most two pieces are on the device at once, none between forward and backward.
- MD (``contiguous_memory_optimization``): pieces (on the device, or on the host with Pa+cpu) and
  the device staging copies come from :class:`~zeropp.zero.arena.Arena` buffers preallocated
  after the first step.

:class:`ActivationCheckpointMemory` counts what is stored, exactly: bytes alive on the device and on the
host (each stored tensor's own bytes, added at pack, removed when autograd frees it) and their
peaks since the last step.

Hook ordering: the unit's gather / reshard hooks live in ``nn.Module.__call__``, outside
``forward``, so recomputation runs none of them: the unit was gathered for backward by its
pre-backward hook (on its outputs, which fires before any tensor the unit saved is unpacked),
nothing is gathered twice, resharded early or recorded in an ExecutionOrder. Recomputation runs
inside ``engine.backward``, so its collectives (DTensor's and Pa's) are in the backward phase.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from zeropp.comm.communicator import Communicator
from zeropp.comm.ledger import PA_GATHER
from zeropp.config.sections import ZeroConfig
from zeropp.topology import Group, Topology
from zeropp.zero.arena import Arena
from zeropp.zero.grouping import innermost_units
from zeropp.zero.unit import FlatUnit
from zeropp.zero.weights.dtensor_params import local_tensor


@dataclass
class ActivationCheckpointMemory:
    """Bytes of stored checkpoints alive now and their peaks since :meth:`new_step`."""

    device: int = 0
    host: int = 0
    device_peak: int = 0
    host_peak: int = 0

    def add(self, nbytes: int, on_host: bool) -> None:
        if on_host:
            self.host += nbytes
            self.host_peak = max(self.host_peak, self.host)
        else:
            self.device += nbytes
            self.device_peak = max(self.device_peak, self.device)

    def remove(self, nbytes: int, on_host: bool) -> None:
        self.add(-nbytes, on_host)

    def new_step(self) -> None:
        self.device_peak, self.host_peak = self.device, self.host


@dataclass(frozen=True)
class ActivationCheckpointStep:
    """One optimizer step's stored checkpoints: peak bytes on the device and on the host (every
    micro-batch's), and the allocations made for pieces and staging copies during the step."""

    device_peak_bytes: int
    host_peak_bytes: int
    allocations: int


@dataclass(frozen=True)
class ActivationCheckpointOptions:
    """What the engine's activation checkpointing does (from ZeroConfig)."""

    partition: bool  # Pa
    offload: bool  # Pa+cpu
    contiguous: bool  # MD
    bucket_numel: int  # Pa's all-gather is split in pieces of this many elements (CB)


class _Stored:
    """One checkpointed input between its forward and its backward."""

    def __init__(self, data: torch.Tensor, shape: torch.Size, index: int, partitioned: bool) -> None:
        self.data, self.shape, self.dtype, self.index, self.partitioned = data, shape, data.dtype, index, partitioned
        self.unpacked = False  # its backward has used it: never fetched again
        self.staged: torch.Tensor | None = None  # Pa+cpu: a device copy of data
        self.unstage: weakref.finalize | None = None  # gives the staged copy back, at once or when this dies


class ActivationCheckpointing:
    def __init__(
        self,
        units: Sequence[FlatUnit],
        comm: Communicator,
        group: Group,
        device: torch.device,
        options: ActivationCheckpointOptions,
    ) -> None:
        self.comm, self.group, self.device, self.options = comm, group, device, options
        self.memory = ActivationCheckpointMemory()
        cuda = device.type == "cuda"
        home = torch.device("cpu") if options.offload else device
        self.pieces = Arena(home, pinned=cuda and options.offload, contiguous=options.contiguous)
        self.staging = Arena(device, pinned=False, contiguous=options.contiguous) if options.offload else None
        self._order: list[weakref.ref[_Stored]] = []  # what is stored, in forward order
        self._alive = 0
        self.units = innermost_units(units)
        for unit in self.units:
            unit.module.forward = functools.partial(self._checkpointed, unit.module.forward)

    # -- forward ---------------------------------------------------------------------------------

    def _checkpointed(self, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing to keep for a backward
            return forward(*args, **kwargs)
        with saved_tensors_hooks(self._pack, self._unpack):
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    def _pack(self, tensor: torch.Tensor) -> _Stored:
        tensor = tensor.detach()
        if not self.options.partition or isinstance(tensor, DTensor):  # kept as it is
            stored = _Stored(tensor, tensor.shape, len(self._order), partitioned=False)
            kept = local_tensor(tensor)
            self._keep(stored, kept.numel() * kept.element_size(), on_host=False, release=None)
            return stored
        flat, size, rank = tensor.reshape(-1), self.group.size, self.group.rank
        piece_numel = -(-flat.numel() // size)
        start = min(rank * piece_numel, flat.numel())
        stop = min(start + piece_numel, flat.numel())
        piece, release = self.pieces.take(piece_numel, tensor.dtype)
        # ordered by the current stream: the piece's only reader is _fetch's copy back, issued on it later
        piece[: stop - start].copy_(flat[start:stop], non_blocking=True)
        piece[stop - start :].zero_()  # padding
        stored = _Stored(piece, tensor.shape, len(self._order), partitioned=True)
        self._keep(stored, piece.numel() * piece.element_size(), on_host=self.options.offload, release=release)
        return stored

    def _keep(self, stored: _Stored, nbytes: int, on_host: bool, release: Callable[[], None] | None) -> None:
        self._order.append(weakref.ref(stored))
        self._alive += 1
        self.memory.add(nbytes, on_host)
        weakref.finalize(stored, self._forget, nbytes, on_host, release)

    def _forget(self, nbytes: int, on_host: bool, release: Callable[[], None] | None) -> None:
        """A stored input was freed (autograd dropped its block's graph)."""
        self.memory.remove(nbytes, on_host)
        if release is not None:
            release()
        self._alive -= 1
        if self._alive == 0:
            self._order.clear()

    # -- backward --------------------------------------------------------------------------------

    def _unpack(self, stored: _Stored) -> torch.Tensor:
        if not stored.partitioned:
            return stored.data
        stored.unpacked = True
        if self.options.offload:
            self._fetch(stored)
            previous = self._order[stored.index - 1]() if stored.index > 0 else None
            if previous is not None and previous.partitioned and not previous.unpacked:
                self._fetch(previous)  # the input unpacked next comes back while this one is used
            piece = stored.staged
        else:
            piece = stored.data
        numel = stored.shape.numel()
        whole = torch.empty(self.group.size * piece.numel(), dtype=stored.dtype, device=self.device)
        self.comm.all_gather(
            whole.view(torch.uint8),
            piece.view(torch.uint8),
            self.group,
            bucket_numel=self.options.bucket_numel * stored.dtype.itemsize,
            label=PA_GATHER,
        )
        if stored.unstage is not None:  # the staged copy has done its job
            stored.staged = None
            stored.unstage()
        return whole[:numel].view(stored.shape)

    def _fetch(self, stored: _Stored) -> None:
        """Pa+cpu: start copying a stored piece back to the device (once)."""
        if stored.staged is not None:
            return
        copy, release = self.staging.take(stored.data.numel(), stored.dtype)
        # ordered by the current stream: read by _unpack's all-gather, which the backend orders after it
        copy.copy_(stored.data, non_blocking=True)
        nbytes = copy.numel() * copy.element_size()
        self.memory.add(nbytes, on_host=False)
        stored.staged = copy
        stored.unstage = weakref.finalize(stored, self._unstage, nbytes, release)  # also if its graph dies first

    def _unstage(self, nbytes: int, release: Callable[[], None]) -> None:
        release()
        self.memory.remove(nbytes, on_host=False)

    # -- per step --------------------------------------------------------------------------------

    def new_step(self) -> ActivationCheckpointStep:
        """The end of an optimizer step: what the step stored, then peaks start again; MD's arenas
        allocate their buffers after the first step."""
        arenas = [arena for arena in (self.pieces, self.staging) if arena is not None]
        step = ActivationCheckpointStep(
            self.memory.device_peak, self.memory.host_peak, sum(a.end_step() for a in arenas)
        )
        self.memory.new_step()
        return step


def kv_cache_configs(model: torch.nn.Module) -> list[Any]:
    """The configs of the Hugging Face models in `model` (it, or any module of it, e.g. under a
    wrapper of the user's) that say whether forward fills a KV cache (``use_cache``)."""
    configs = {id(c): c for m in model.modules() if hasattr(c := getattr(m, "config", None), "use_cache")}
    return list(configs.values())


@contextlib.contextmanager
def kv_cache_off(configs: Sequence[Any]) -> Iterator[None]:
    """`configs` say ``use_cache = False`` while inside. A forward that builds a graph for backward runs
    so under checkpointing (in train or eval mode: the blocks are recomputed either way): a recomputed
    block would write its keys into the KV cache a second time (and attend to them twice), so Hugging
    Face's own gradient checkpointing turns the cache off too. A forward called with ``use_cache``
    itself is left to it."""
    changed: list[tuple[Any, Any]] = []
    try:
        for config in configs:
            changed.append((config, config.use_cache))
            config.use_cache = False
        yield
    finally:
        for config, use_cache in changed:
            config.use_cache = use_cache


def activation_checkpointing_for(
    config: ZeroConfig, units: Sequence[FlatUnit], comm: Communicator, topology: Topology
) -> ActivationCheckpointing | None:
    """The engine's activation checkpointing as ``zero.activation_checkpointing`` and ZeRO-R's switches
    ask for it (None: off)."""
    if not config.activations.enabled:
        return None
    options = ActivationCheckpointOptions(
        partition=config.activations.partition_activations,
        offload=config.activations.cpu_checkpointing,
        contiguous=config.contiguous_memory_optimization,
        bucket_numel=config.allgather_bucket_numel,
    )
    # Pa splits each block input over the tensor-parallel ranks, which all hold it whole; with sequence
    # parallelism each holds its own 1/tp of the sequence already: Pa keeps that (over a group of one)
    # See [Note: Pa under sequence parallelism] (docs/design.md)
    group = Group(None, (topology.rank,), 0) if topology.sequence_parallel else topology.tensor_parallel
    return ActivationCheckpointing(units, comm, group, topology.device, options)
