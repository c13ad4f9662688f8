"""Triton kernels implementing ``zeropp.quant.QuantKernels``: the bits of ``zeropp.quant.reference``, fused.

Every kernel walks *units*: one block of one row (``unit = row * blocks + block index``). A program
holds a tile of ``GROUP`` consecutive units by ``CHUNK`` elements (``CHUNK`` is the block size
rounded up to a power of two, at most ``TILE``, or twice that when quantizing to int4), so a block
is reduced inside one program and the loads of neighbouring blocks of a row are contiguous. A block
longer than the tile (a large ``block_size``, or ``block_size=None`` on long rows) is walked in
``CHUNKS`` pieces by one program: a first pass for the absmax and a second to quantize, reading the
input twice.

Bit-identity with the reference rests on these choices:

* divisions use ``tl.div_rn`` (IEEE round-to-nearest): Triton's ``/`` on fp32 is the approximate
  ``div.full.f32``. Dividing the values by their block's scale takes one such division a block, for
  the reciprocal, and multiplications and fmas an element that give the same quotient (``_divide``);
* round-half-even is an fp32 add of ``1.5 * 2**23``, which leaves ``round(y)`` in the low bits of
  the sum (for ``|y| < 2**22``; ``|x / scale| <= qmax`` here): libdevice ``rint`` does not run
  under the interpreter, and this also spares the float-to-int conversion;
* the absmax reduction propagates NaN (``tl.max`` drops it), so a block holding a NaN gets a NaN
  scale as with ``torch.amax``;
* kernels are built with ``enable_fp_fusion=False``: a fused multiply-add in ``total + q * scale``
  would round once where the reference rounds twice;
* bf16 converts to and from fp32 through its bits: exact on the GPU as ``cvt`` is, and the
  interpreter's own bf16 casts truncate and mishandle subnormals.

Codes become fp32 by conversion. Conversions run at 16 a clock per SM on Hopper (against 128 fp32
adds), as reciprocals do: while every element also took a reciprocal for its division they bounded
the fused reductions, and codes went through the ``1.5 * 2**23`` offset (an integer add and an fp32
subtract) instead; with one reciprocal a block, the conversion is the faster (docs/kernels.md).

The fp values to quantize are loaded with ``evict_first``: read once, they should not displace
what the L2 cache holds (dirty lines that would otherwise be written back while the kernel reads).

int4 codes are packed in the layout of ``zeropp.quant`` (``pack_int4``), inside the kernels
(``_load_codes``, ``_store_codes``). With an odd ``block_size`` and several blocks a row a byte
straddles two blocks: the kernels then read and write int8 codes, and ``pack_int4`` /
``unpack_int4`` convert them (a rare layout, not a fast path).

Kernels are decorated at import, so ``TRITON_INTERPRET=1`` (the CPU interpreter) must be set before
this module is first imported; ``INTERPRETED`` records which way it went. They call none of the
``@triton.jit`` functions of Triton's standard library (``tl.zeros``, ``tl.max``...), which are
decorated when triton itself is imported: so triton may have been imported before the variable was set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from zeropp.quant import reference
from zeropp.quant.spec import Quantized, QuantSpec, pack_int4, unpack_int4

__all__ = ["INTERPRETED", "quantize", "dequantize", "dequantize_reduce", "dequantize_reduce_quantize"]

INTERPRETED: bool = triton.knobs.runtime.interpret
# Tuned on an H100 (docs/kernels.md). A program quantizing to int4 holds 2 * TILE elements (the bytes
# it writes are then those of an int8 program).
TILE = 1024  # elements a program holds per chunk (GROUP * CHUNK)
NUM_WARPS = 4

_ROUND = tl.constexpr(12582912.0)  # 1.5 * 2**23: for |y| < 2**22, y + _ROUND lands where the fp32 spacing is 1
_ROUND_BITS = tl.constexpr(0x4B400000)  # the bits of _ROUND: bits(_ROUND + i) = _ROUND_BITS + i for integers i there
_INF = tl.constexpr(float("inf"))
_EXACT_FMA = tl.constexpr(not INTERPRETED)  # numpy, under the interpreter, rounds a * b + c twice


# -- device helpers ------------------------------------------------------------------------------
# A chunk is given by `first` (the row offset of its first element, [GROUP]) and `valid` (how many
# of its CHUNK elements are in the block and the row, <= 0 for units past the end).


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def lane_mask(valid, STEP: tl.constexpr, CHUNK: tl.constexpr, FULL: tl.constexpr):
    """[GROUP, CHUNK // STEP] mask of the elements 0, STEP, 2 * STEP... of a chunk (STEP 2: int4 bytes).

    FULL: every unit's chunks are whole, so the mask is constant along a row, which keeps loads and
    stores vectorized."""
    if FULL:
        return tl.broadcast_to((valid > 0)[:, None], (valid.shape[0], CHUNK // STEP))
    return (STEP * tl.arange(0, CHUNK // STEP))[None, :] < valid[:, None]


@triton.jit
def _load_fp32(ptrs, mask):
    """Load floats, read once, as fp32 (0 where masked); bf16 is widened through its bits."""
    if ptrs.dtype.element_ty == tl.bfloat16:
        bits = tl.load(ptrs, mask=mask, other=0, eviction_policy="evict_first").to(tl.int16, bitcast=True)
        return (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return tl.load(ptrs, mask=mask, other=0, eviction_policy="evict_first").to(tl.float32)


@triton.jit
def _from_fp32(x, dtype: tl.constexpr):
    """Cast fp32 to `dtype`, rounding to nearest even; bf16 through its bits (a NaN becomes 0x7FC0)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
        return tl.where(x != x, 0x7FC0, rounded).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)


@triton.jit
def _load_codes(ptr, row_base, first, valid, BITS: tl.constexpr, CHUNK: tl.constexpr, FULL: tl.constexpr):
    """A chunk's codes as fp32 [GROUP, CHUNK] (0 where masked); int4 unpacked as ``unpack_int4`` does."""
    if BITS == 8:
        offset = first[:, None] + tl.arange(0, CHUNK)[None, :]
        return tl.load(ptr + row_base[:, None] + offset, mask=lane_mask(valid, 1, CHUNK, FULL), other=0).to(tl.float32)
    else:
        offset = first[:, None] // 2 + tl.arange(0, CHUNK // 2)[None, :]
        byte = tl.load(ptr + row_base[:, None] + offset, mask=lane_mask(valid, 2, CHUNK, FULL), other=0).to(tl.int32)
        low = ((byte & 0xF) ^ 8) - 8  # sign-extend the two's-complement nibbles
        high = ((byte >> 4) ^ 8) - 8
        return tl.reshape(tl.join(low, high), (byte.shape[0], CHUNK)).to(tl.float32)


@triton.jit
def _store_codes(ptr, row_base, first, valid, codes, BITS: tl.constexpr, CHUNK: tl.constexpr, FULL: tl.constexpr):
    """Store a chunk's int32 codes [GROUP, CHUNK]: int8, or int4 packed as ``pack_int4`` does."""
    if BITS == 8:
        offset = first[:, None] + tl.arange(0, CHUNK)[None, :]
        tl.store(ptr + row_base[:, None] + offset, codes.to(tl.int8), mask=lane_mask(valid, 1, CHUNK, FULL))
    else:
        offset = first[:, None] // 2 + tl.arange(0, CHUNK // 2)[None, :]
        low, high = tl.split(tl.reshape(codes, (codes.shape[0], CHUNK // 2, 2)))
        byte = ((low & 0xF) | ((high & 0xF) << 4)).to(tl.uint8)
        # A thread holds 4 consecutive fp32 values, so 2 bytes: stores of 2-byte runs write them from
        # where they are (left alone, Triton widens the store and regroups the bytes through shared memory).
        offset = tl.max_contiguous(offset, [1, 2])
        tl.store(ptr + row_base[:, None] + offset, byte, mask=lane_mask(valid, 2, CHUNK, FULL))


@triton.jit
def sum_sources(
    ptr, row_base, source_stride, scales_ptr, scale_offset, scales_source_stride, first, valid,
    SOURCES: tl.constexpr, BITS: tl.constexpr, CHUNK: tl.constexpr, FULL: tl.constexpr,
):  # fmt: skip
    """fp32 sum over the sources of a chunk, in source order: ((x0 + x1) + x2) + ..."""
    scale = tl.load(scales_ptr + scale_offset, mask=valid > 0, other=0)
    total = _load_codes(ptr, row_base, first, valid, BITS, CHUNK, FULL) * scale[:, None]
    for source in tl.static_range(1, SOURCES):
        scale = tl.load(scales_ptr + source * scales_source_stride + scale_offset, mask=valid > 0, other=0)
        total += _load_codes(ptr + source * source_stride, row_base, first, valid, BITS, CHUNK, FULL) * scale[:, None]
    return total


@triton.jit
def _values(
    ptr, row_base, source_stride, scales_ptr, scale_offset, scales_source_stride, first, valid,
    SOURCES: tl.constexpr, FROM_CODES: tl.constexpr, SOURCE_BITS: tl.constexpr, CHUNK: tl.constexpr,
    FULL: tl.constexpr,
):  # fmt: skip
    """A chunk's fp32 values to quantize, 0 where masked: the rows at `ptr`, or (FROM_CODES) the sum
    of the quantized sources there."""
    mask = lane_mask(valid, 1, CHUNK, FULL)
    if FROM_CODES:
        total = sum_sources(
            ptr, row_base, source_stride, scales_ptr, scale_offset, scales_source_stride, first, valid,
            SOURCES, SOURCE_BITS, CHUNK, FULL,
        )  # fmt: skip
        if FULL:  # only units past the end are masked, and their codes and scales load as 0
            return total
        return tl.where(mask, total, 0.0)  # the masked tail of a block holds 0 * scale: NaN for an inf scale
    else:
        return _load_fp32(ptr + row_base[:, None] + first[:, None] + tl.arange(0, CHUNK)[None, :], mask)


@triton.jit
def _divide(x, d):
    """``tl.div_rn(x, d[:, None])`` for finite d > 0 and finite x: one IEEE division a row (a reciprocal),
    then two multiplications and two Markstein corrections an element.

    x and d are first scaled by p = 2**-exponent(d): d then lies in [1, 2) ([2**-23, 1) when subnormal),
    y = 1 / d rounded is within half an ulp of it, and nothing below overflows or loses bits to
    underflow unless |x / d| < 2**-80 (where the result is as tiny, and the code 0 either way).
    q = x * y is within 1.5 ulps of x / d; q + (x - d * q) * y, each fma rounding once, is within one
    ulp; and a second such correction gives x / d correctly rounded (Markstein's theorem: y within half
    an ulp of 1 / d, q within one ulp of x / d)."""
    if not _EXACT_FMA:  # the interpreter's fma rounds twice
        return tl.div_rn(x, d[:, None])
    p = ((254 - tl.maximum(d.to(tl.int32, bitcast=True) >> 23, 1)) << 23).to(tl.float32, bitcast=True)
    d = d * p
    y = tl.div_rn(1.0, d)[:, None]
    d = d[:, None]
    x = x * p[:, None]
    q = x * y
    q = tl.fma(tl.fma(-d, q, x), y, q)
    return tl.fma(tl.fma(-d, q, x), y, q)


@triton.jit
def _codes(x, scale, QMAX: tl.constexpr):
    """The rounding rule: clamp(round_half_even(x / scale)), 0 where the scale is 0 or not finite."""
    usable = (scale > 0) & (scale < _INF)
    y = _divide(x, tl.where(usable, scale, 1.0))
    q = (y + _ROUND).to(tl.int32, bitcast=True) - _ROUND_BITS  # the add rounds half to even; the bits hold it
    return tl.where(usable[:, None], tl.minimum(tl.maximum(q, -QMAX), QMAX), 0)


@triton.jit
def program_units(GROUP: tl.constexpr, blocks, blocks_magic, blocks_shift, block, units):
    """This program's units: their row (int64), block index in the row, first element, and whether they exist.

    ``unit // blocks`` is the high word of ``2 * unit * blocks_magic`` shifted by ``blocks_shift`` (see
    ``Geometry.scalars``): a multiply and a shift, where an integer division by a runtime value takes
    some twenty instructions."""
    unit = tl.program_id(0) * GROUP + tl.arange(0, GROUP)
    row = (tl.umulhi(2 * unit.to(tl.uint32), blocks_magic.to(tl.uint32)) >> blocks_shift).to(tl.int32)
    index = unit - row * blocks
    return row.to(tl.int64), index, index * block, unit < units


@triton.jit
def valid_lanes(start, units_ok, k, n, block, CHUNK: tl.constexpr):
    """Elements of chunk `k` of each unit inside its block and row (0 for units past the end)."""
    return tl.where(units_ok, tl.minimum(block - k * CHUNK, n - start - k * CHUNK), 0)


# -- kernels -------------------------------------------------------------------------------------


@triton.jit
def _quantize_kernel(
    in_ptr, in_row_stride, in_source_stride, in_scales_ptr, in_scales_row_stride, in_scales_source_stride,
    order_ptr, data_ptr, data_row_stride, scales_ptr, scales_row_stride,
    n, block, blocks, blocks_magic, blocks_shift, units,
    QMAX: tl.constexpr, BITS: tl.constexpr, SOURCES: tl.constexpr, FROM_CODES: tl.constexpr,
    SOURCE_BITS: tl.constexpr, REORDER: tl.constexpr,
    GROUP: tl.constexpr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr, FULL: tl.constexpr,
):  # fmt: skip
    """Quantize GROUP units a program. The input rows are fp values (row r read from row order[r] when
    REORDER), or with FROM_CODES SOURCES quantized copies of them to sum first (intra-node qgZ hop)."""
    row, index, start, units_ok = program_units(GROUP, blocks, blocks_magic, blocks_shift, block, units)
    in_row = tl.load(order_ptr + row, mask=units_ok, other=0) if REORDER else row
    in_row_base = in_row * in_row_stride
    in_scale_offset = row * in_scales_row_stride + index
    data_row_base = row * data_row_stride
    if CHUNKS == 1:
        valid = valid_lanes(start, units_ok, 0, n, block, CHUNK)
        x = _values(
            in_ptr, in_row_base, in_source_stride, in_scales_ptr, in_scale_offset, in_scales_source_stride,
            start, valid, SOURCES, FROM_CODES, SOURCE_BITS, CHUNK, FULL,
        )  # fmt: skip
        scale = tl.div_rn(tl.reduce(tl.abs(x), 1, _max_nan), QMAX)
        _store_codes(data_ptr, data_row_base, start, valid, _codes(x, scale, QMAX), BITS, CHUNK, FULL)
    else:  # two passes over the block: absmax, then codes
        absmax = tl.full((GROUP,), 0.0, tl.float32)
        for k in range(CHUNKS):
            x = _values(
                in_ptr, in_row_base, in_source_stride, in_scales_ptr, in_scale_offset, in_scales_source_stride,
                start + k * CHUNK, valid_lanes(start, units_ok, k, n, block, CHUNK),
                SOURCES, FROM_CODES, SOURCE_BITS, CHUNK, FULL,
            )  # fmt: skip
            absmax = _max_nan(absmax, tl.reduce(tl.abs(x), 1, _max_nan))
        scale = tl.div_rn(absmax, QMAX)
        for k in range(CHUNKS):
            first, valid = start + k * CHUNK, valid_lanes(start, units_ok, k, n, block, CHUNK)
            x = _values(
                in_ptr, in_row_base, in_source_stride, in_scales_ptr, in_scale_offset, in_scales_source_stride,
                first, valid, SOURCES, FROM_CODES, SOURCE_BITS, CHUNK, FULL,
            )  # fmt: skip
            _store_codes(data_ptr, data_row_base, first, valid, _codes(x, scale, QMAX), BITS, CHUNK, FULL)
    tl.store(scales_ptr + row * scales_row_stride + index, scale, mask=units_ok)


@triton.jit
def _dequantize_kernel(
    in_ptr, in_row_stride, in_source_stride, in_scales_ptr, in_scales_row_stride, in_scales_source_stride,
    out_ptr, out_row_stride, divisor,
    n, block, blocks, blocks_magic, blocks_shift, units,
    BITS: tl.constexpr, SOURCES: tl.constexpr, DIVIDE: tl.constexpr,
    GROUP: tl.constexpr, CHUNK: tl.constexpr, FULL: tl.constexpr,
):  # fmt: skip
    """Chunk program_id(1) of GROUP units: the sum over SOURCES of the dequantized values (one source
    for a plain dequantize), divided by `divisor` when DIVIDE, cast to the output's dtype."""
    row, index, start, units_ok = program_units(GROUP, blocks, blocks_magic, blocks_shift, block, units)
    k = tl.program_id(1)
    first, valid = start + k * CHUNK, valid_lanes(start, units_ok, k, n, block, CHUNK)
    total = sum_sources(
        in_ptr, row * in_row_stride, in_source_stride, in_scales_ptr, row * in_scales_row_stride + index,
        in_scales_source_stride, first, valid, SOURCES, BITS, CHUNK, FULL,
    )  # fmt: skip
    if DIVIDE:
        total = tl.div_rn(total, divisor)
    out = out_ptr + row[:, None] * out_row_stride + first[:, None] + tl.arange(0, CHUNK)[None, :]
    tl.store(out, _from_fp32(total, out_ptr.dtype.element_ty), mask=lane_mask(valid, 1, CHUNK, FULL))


# -- host side -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Geometry:
    """How `rows` rows of `n` elements cut into units, chunks and programs of `tile` elements under a spec."""

    rows: int
    n: int
    block: int
    blocks: int
    chunk: int  # elements of a unit a program holds at once (a power of two, >= 2 for int4 pairs)
    chunks: int  # chunks per block
    group: int  # units per program

    @classmethod
    def of(cls, spec: QuantSpec, rows: int, n: int, tile: int) -> Geometry:
        block, blocks = spec.block(n), spec.blocks(n)
        chunk = max(2, min(triton.next_power_of_2(block), tile))
        chunks = math.ceil(block / chunk)
        group = 1 if chunks > 1 else min(tile // chunk, triton.next_power_of_2(rows * blocks))
        return cls(rows, n, block, blocks, chunk, chunks, group)

    @property
    def programs(self) -> int:
        return triton.cdiv(self.rows * self.blocks, self.group)

    def scalars(self) -> tuple[int, ...]:
        """n, block, blocks, blocks_magic, blocks_shift, units.

        For 0 <= u < 2**31, ``u // blocks == (2 * u * magic >> 32) >> s`` with s = ceil(log2(blocks)) and
        magic = 2**(31 + s) // blocks + 1 < 2**32 (Granlund and Montgomery's round-up method)."""
        s = (self.blocks - 1).bit_length()
        magic = (1 << (31 + s)) // self.blocks + 1
        return self.n, self.block, self.blocks, magic, s, self.rows * self.blocks

    def constexprs(self) -> dict[str, int | bool]:
        full = self.n % self.block == 0 and self.block % self.chunk == 0  # no partial chunk anywhere
        return dict(GROUP=self.group, CHUNK=self.chunk, FULL=full)


def _straddles(spec: QuantSpec, n: int) -> bool:
    """Whether int4 bytes straddle two blocks (odd block_size, several blocks a row).

    The kernels then read and write int8 codes, packed or unpacked in torch around them.
    """
    return spec.bits == 4 and spec.blocks(n) > 1 and spec.block(n) % 2 == 1


def _view_rows(t: torch.Tensor, width: int, lead: int = 0) -> torch.Tensor | None:
    """`t` as [*t.shape[:lead], rows, width] without a copy, last dim contiguous; None if impossible."""
    try:
        view = t.view(*t.shape[:lead], -1, width)
    except RuntimeError:
        return None
    return view if view.stride(-1) == 1 or width == 1 else None


def _read_rows(t: torch.Tensor, width: int, lead: int = 0) -> torch.Tensor:
    """`t` as rows of `width` to read: a view when there is one, else a contiguous copy."""
    view = _view_rows(t, width, lead)
    return view if view is not None else _view_rows(t.contiguous(), width, lead)


def read_codes(q: Quantized, lead: int) -> tuple[tuple, int]:
    """The kernels' six input arguments for the codes and scales of `q` as [sources, rows, ...]
    (`lead` 1: q has a source dim; 0: it is the one source), and the bits of those codes."""
    n, spec = q.n, q.spec
    straddles = _straddles(spec, n)
    data = _read_rows(unpack_int4(q.data, n) if straddles else q.data, n if straddles else spec.row_bytes(n), lead)
    scales = _read_rows(q.scales, spec.blocks(n), lead)
    if lead == 0:
        data, scales = data.unsqueeze(0), scales.unsqueeze(0)
    args = (data, data.stride(1), data.stride(0), scales, scales.stride(1), scales.stride(0))
    return args, 8 if straddles else spec.bits


def launch(kernel, grid: tuple[int, ...], *args, **constexprs) -> None:
    kernel[grid](*args, **constexprs, num_warps=NUM_WARPS, enable_fp_fusion=False)


def _quantize(
    in_args: tuple, sources: int, source_bits: int | None, order: torch.Tensor | None,
    spec: QuantSpec, lead: tuple[int, ...], n: int, device: torch.device, out: Quantized | None,
) -> Quantized:  # fmt: skip
    """Run the quantize kernel on `in_args` (fp rows when `source_bits` is None, else quantized
    sources) into `out` (in place where the kernel can write it) or a new Quantized."""
    straddles = _straddles(spec, n)
    data_dtype, width = (torch.int8, n) if straddles else (spec.data_dtype, spec.row_bytes(n))
    if (
        out is not None
        and (out.data.dtype, out.scales.dtype) == (data_dtype, torch.float32)
        and _view_rows(out.data, width) is not None
        and _view_rows(out.scales, spec.blocks(n)) is not None
    ):
        result = out
    else:
        data = torch.empty(*lead, width, dtype=data_dtype, device=device)
        result = Quantized(data, torch.empty(*lead, spec.blocks(n), device=device), n, spec)
    bits = 8 if straddles else spec.bits
    geometry = Geometry.of(spec, math.prod(lead), n, 2 * TILE if bits == 4 else TILE)
    if geometry.rows > 0:
        data, scales = _view_rows(result.data, width), _view_rows(result.scales, geometry.blocks)
        launch(
            _quantize_kernel, (geometry.programs,),
            *in_args, order, data, data.stride(0), scales, scales.stride(0), *geometry.scalars(),
            QMAX=spec.qmax, BITS=bits, SOURCES=sources, FROM_CODES=source_bits is not None,
            SOURCE_BITS=source_bits or 8, REORDER=order is not None, CHUNKS=geometry.chunks,
            **geometry.constexprs(),
        )  # fmt: skip
    if straddles:
        result = Quantized(pack_int4(result.data), result.scales, n, spec)
    return result if out is None or result is out else out.copy_(result)


def quantize(
    x: torch.Tensor, spec: QuantSpec, *, row_order: torch.Tensor | None = None, out: Quantized | None = None
) -> Quantized:
    """``QuantKernels.quantize``; `row_order` must hold indices in ``[0, rows)``: the kernel reads
    through it without a bounds check."""
    n = x.shape[-1]
    if n == 0:  # nothing to compute
        return reference.quantize(x, spec, row_order=row_order, out=out)
    rows = _read_rows(x, n)
    lead = (row_order.numel(),) if row_order is not None else tuple(x.shape[:-1])
    order = None if row_order is None else row_order.to(device=x.device, dtype=torch.int64).contiguous()
    in_args = (rows, rows.stride(0), 0, rows, 0, 0)  # fp rows: no scales
    return _quantize(in_args, 1, None, order, spec, lead, n, x.device, out)


def dequantize_reduce_quantize(q: Quantized, spec: QuantSpec) -> Quantized:
    """``QuantKernels.dequantize_reduce_quantize``: one fused kernel when `spec` cuts rows into the
    blocks of ``q.spec``; else the fp32 sum goes through memory."""
    if q.n == 0:
        return reference.dequantize_reduce_quantize(q, spec)
    if spec.block(q.n) != q.spec.block(q.n):
        return quantize(dequantize_reduce(q, torch.float32), spec)
    in_args, bits = read_codes(q, lead=1)
    lead = tuple(q.data.shape[1:-1])
    return _quantize(in_args, q.data.shape[0], bits, None, spec, lead, q.n, q.data.device, None)


def _dequantize_sum(q: Quantized, dtype: torch.dtype, out: torch.Tensor | None, lead: int, divisor: int):
    """Body of dequantize (`lead` 0) and of dequantize_reduce (`lead` 1: `q` [sources, ..., bytes])."""
    n = q.n
    in_args, bits = read_codes(q, lead)
    shape = (*q.data.shape[lead:-1], n)
    direct = out is not None and out.dtype == dtype and _view_rows(out, n) is not None
    result = out if direct else torch.empty(shape, dtype=dtype, device=q.data.device)
    target = _view_rows(result, n)
    geometry = Geometry.of(q.spec, math.prod(shape[:-1]), n, TILE)
    if geometry.rows > 0:
        launch(
            _dequantize_kernel, (geometry.programs, geometry.chunks),
            *in_args, target, target.stride(0), float(divisor), *geometry.scalars(),
            BITS=bits, SOURCES=in_args[0].shape[0], DIVIDE=divisor != 1, **geometry.constexprs(),
        )  # fmt: skip
    if out is None or direct:
        return result
    return out.copy_(result)


def dequantize(q: Quantized, dtype: torch.dtype, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``QuantKernels.dequantize``."""
    if q.n == 0:
        return reference.dequantize(q, dtype, out=out)
    return _dequantize_sum(q, dtype, out, lead=0, divisor=1)


def dequantize_reduce(
    q: Quantized, dtype: torch.dtype, *, divisor: int = 1, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``QuantKernels.dequantize_reduce``."""
    if q.n == 0:
        return reference.dequantize_reduce(q, dtype, divisor=divisor, out=out)
    return _dequantize_sum(q, dtype, out, lead=1, divisor=divisor)
