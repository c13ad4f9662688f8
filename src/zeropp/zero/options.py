"""How every unit stores and communicates: the per-run choices the engine derives once from
:class:`~zeropp.config.ZeroConfig` and hands to each :class:`~zeropp.zero.unit.FlatUnit`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zeropp.config.sections import ZeroConfig
from zeropp.errors import ConfigError
from zeropp.quant.spec import QuantKernels, QuantSpec
from zeropp.zero.arena import Arena


@dataclass(frozen=True)
class UnitOptions:
    """How every unit stores and communicates (the engine builds one from ZeroConfig)."""

    device: torch.device
    compute_dtype: torch.dtype
    grad_dtype: torch.dtype
    alignment: int
    persistence_threshold: int
    allgather_bucket: int
    reduce_bucket: int
    weight_quant: QuantSpec | None = None  # qwZ: gather weights over the shard group quantized
    weight_delta: bool = False  # qWD: qwZ gathers the change since the last gather (zero.reference)
    frozen_quant: QuantSpec | None = None  # frozen parameters' shards stored quantized once (stage 3)
    grad_quant: QuantSpec | None = None  # qgZ: reduce gradients by quantized hierarchical all-to-all
    grad_intra_quant: QuantSpec | None = None  # qgZ's intra-node hop (None: unquantized)
    grad_hadamard: bool = False  # qgZ: random Hadamard rotation of every block (zeropp.quant.hadamard)
    grad_error_beta: float | None = None  # qgZ: LoCo error feedback with this beta (None: off)
    qgz_chunks: int = 1  # qgZ pipeline chunks per reduce bucket
    qgz_min_chunk: int = 1  # ... each of at least this many columns
    kernels: QuantKernels | None = None  # quantization kernels (zeropp.quant.kernels_for)
    quant_stream: torch.cuda.Stream | None = None  # CUDA: qwZ quantizes and gathers on this side stream
    master_device: torch.device | None = None  # ZeRO-Offload: the fp32 master's home (None: `device`)
    compute_shard_device: torch.device | None = None  # offloaded parameters: the compute shard's home
    grad_arena: Arena | None = None  # where gradient buffers come from (MD: one preallocated buffer); None: fresh

    @property
    def param_alignment(self) -> int:
        """Where a parameter may start in a unit's flat buffer: on a qwZ block boundary where qwZ
        quantizes blocks, so that a block holds one parameter's weights alone (their own scale)."""
        quant = self.weight_quant
        return quant.block_size if quant is not None and quant.block_size else 1

    def host_empty(self, numel: int, dtype: torch.dtype, where: torch.device | None) -> torch.Tensor:
        """An empty tensor at `where` (default: the device); host memory is pinned when the device is CUDA."""
        where = where or self.device
        pin = where.type == "cpu" and self.device.type == "cuda"
        return torch.empty(numel, dtype=dtype, device=where, pin_memory=pin)


def frozen_quant(zero: ZeroConfig) -> QuantSpec | None:
    """How stage 3 stores frozen weights: with ``quantized_nontrainable_weights`` block-quantized to
    ``nontrainable_weight_bits`` with qwZ's blocks; None: in the compute dtype."""
    return QuantSpec(zero.nontrainable_weight_bits, zero.qwz.block) if zero.quantized_nontrainable_weights else None


def refuse_qwd_without_hpz(zero: ZeroConfig, hpz_group_size: int, nodes: int) -> None:
    """qWD's reference is hpZ's secondary copy (See [Note: qWD's reference]): refuse it, in one line,
    on a topology where hpZ is off."""
    if zero.qwz.delta and hpz_group_size <= 1:
        key = zero.key("qwz")("quantization")
        raise ConfigError(
            f"{key} = 'delta' needs hpZ, which is off on this topology (zero.hpz_partition_size = "
            f"{zero.hpz_partition_size}, {nodes} node(s)); use 'block' or 'tensor'",
            key, "delta",
        )  # fmt: skip
