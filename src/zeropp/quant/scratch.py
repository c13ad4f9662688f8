"""Scratch memory for the temporaries of the torch reference kernels, kept from call to call.

On the CPU a fresh tensor above glibc's mmap threshold (128 KiB where ``MALLOC_MMAP_THRESHOLD_``
pins it, as ``zeropp bench step`` and ``bench memory`` do) is a new mapping whose pages fault in at
first touch and are unmapped again when it dies: for a quantization call that costs more than its
arithmetic. The reference kernels therefore take every temporary that does not outlive the call
from :func:`empty`: one buffer per named slot and thread, grown to the largest request and reused.
Each slot belongs to one temporary of one kernel, so two live temporaries never share memory.

Only CPU tensors use it: CUDA's caching allocator already reuses memory, and a buffer shared by
work on two streams (qwZ's quantization stream and the default one) would race. The memory kept is
each slot's largest request: for qgZ about 9 bytes per element of the largest chunk a rank
quantizes (its fp32 values, the fp32 sum of the node's sources, the int4 packing's words); qwZ's
bf16/fp16 dequantization widens through the same fp32 values slot. Switching qgZ off empties the
slots (``ZeroEngine.set_quantized_gradients``).
"""

from __future__ import annotations

import math
import threading

import torch


class _Slots(threading.local):
    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}  # slot -> uint8 storage


_slots = _Slots()


def empty(slot: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized contiguous tensor for the temporary `slot`: on the CPU a view of this thread's
    buffer for the slot (valid until the next request for the same slot), elsewhere a fresh tensor."""
    if device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    buffer = _slots.buffers.get(slot)
    if buffer is None or buffer.numel() < nbytes:
        buffer = _slots.buffers[slot] = torch.empty(nbytes, dtype=torch.uint8)
    return buffer[:nbytes].view(dtype).view(shape)


def kept_bytes() -> int:
    """Bytes this thread's slots hold."""
    return sum(buffer.numel() for buffer in _slots.buffers.values())


def release() -> None:
    """Drop this thread's buffers (the next call allocates them again)."""
    _slots.buffers.clear()
