"""``zeropp bench kernels``: the Triton quantization kernels against a device copy and the torch reference (CUDA).

For each kernel and buffer size (the bytes of the fp32 input, 1 MiB to 1 GiB): the median device
time of several calls, each after a 256 MiB write that evicts the L2 cache and a GPU-side sleep
that lets the host queue the call (so the host's launch overhead stays out of the number); GB/s
counting the bytes the call must read plus write; that rate as a percentage of a copy
(``torch.clone``, read + write) of the fp32 buffer timed the same way; and the speedup over
``zeropp.quant.reference`` timed the same way.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from zeropp.quant import reference
from zeropp.quant.spec import Quantized, QuantKernels, QuantSpec
from zeropp.tools.bench.runs import output_file

SIZES_MIB = (1, 4, 16, 64, 256, 1024)
ROW = 4096  # elements a row of the benchmarked buffers
BLOCK = 256
SOURCES = 4  # sources of the two fused reductions
NODES = 8  # rows of the [W, S] gradient view that the fused reorder reads a column slice of
FUSED = ("reorder+quantize", "dequantize_reduce_quantize", "dequantize_reduce")
SLEEP_CYCLES = 2_000_000  # about 1 ms of GPU clock: longer than the host takes to launch any timed call


@dataclass
class Case:
    kernel: str
    moved: int  # bytes one call reads plus writes
    fast: Callable[[], object]
    ref: Callable[[], object]


@dataclass
class Row:
    kernel: str
    mib: int
    ms: float
    gbps: float
    pct_copy: float
    ref_ms: float
    speedup: float


def _codes(spec: QuantSpec, lead: tuple[int, ...], n: int, device: torch.device) -> Quantized:
    """Random quantized rows: any byte is a valid int4 pair; int8 codes in [-127, 127]."""
    shape = (*lead, spec.row_bytes(n))
    data = torch.randint(-127, 128, shape, dtype=torch.int8, device=device)
    scales = torch.rand(*lead, spec.blocks(n), device=device) + 0.5
    return Quantized(data if spec.bits == 8 else data.view(torch.uint8), scales, n, spec)


def _quantize(fast: QuantKernels, bits: int, elements: int, device: torch.device) -> Case:
    spec, x = QuantSpec(bits, BLOCK), torch.randn(elements // ROW, ROW, device=device)
    written = spec.row_bytes(ROW) * (elements // ROW) + 4 * elements // BLOCK
    return Case(f"quantize int{bits}", 4 * elements + written, lambda: fast.quantize(x, spec),
                lambda: reference.quantize(x, spec))  # fmt: skip


def _dequantize(fast: QuantKernels, bits: int, elements: int, device: torch.device) -> Case:
    spec = QuantSpec(bits, BLOCK)
    q = _codes(spec, (elements // ROW,), ROW, device)
    return Case(f"dequantize int{bits}", q.nbytes + 4 * elements, lambda: fast.dequantize(q, torch.float32),
                lambda: reference.dequantize(q, torch.float32))  # fmt: skip


def _reorder_quantize(fast: QuantKernels, elements: int, device: torch.device) -> Case:
    """qgZ's first hop: a column slice of the [W, S] gradient view, its rows quantized in another order."""
    spec, full = QuantSpec(8, BLOCK), torch.randn(NODES, 2 * elements // NODES, device=device)
    x, order = full[:, : elements // NODES], torch.randperm(NODES, device=device)
    return Case("reorder+quantize", 5 * elements + 4 * elements // BLOCK,
                lambda: fast.quantize(x, spec, row_order=order),
                lambda: reference.quantize(x, spec, row_order=order))  # fmt: skip


def _reduce_quantize(fast: QuantKernels, elements: int, device: torch.device) -> Case:
    spec = QuantSpec(8, BLOCK)
    q = _codes(spec, (SOURCES, elements // ROW), ROW, device)
    return Case("dequantize_reduce_quantize", q.nbytes + q[0].nbytes,
                lambda: fast.dequantize_reduce_quantize(q, spec),
                lambda: reference.dequantize_reduce_quantize(q, spec))  # fmt: skip


def _reduce(fast: QuantKernels, elements: int, device: torch.device) -> Case:
    q = _codes(QuantSpec(8, BLOCK), (SOURCES, elements // ROW), ROW, device)
    return Case("dequantize_reduce", q.nbytes + 4 * elements,
                lambda: fast.dequantize_reduce(q, torch.float32, divisor=SOURCES),
                lambda: reference.dequantize_reduce(q, torch.float32, divisor=SOURCES))  # fmt: skip


def _cases(fast: QuantKernels, elements: int, device: torch.device) -> Iterator[Case]:
    """The benchmarked calls on buffers of `elements` fp32 values, built one at a time to bound memory."""
    for bits in (8, 4):
        yield _quantize(fast, bits, elements, device)
        yield _dequantize(fast, bits, elements, device)
    yield _reorder_quantize(fast, elements, device)
    yield _reduce_quantize(fast, elements, device)
    yield _reduce(fast, elements, device)


def median_ms(
    fn: Callable[[], object], flush: torch.Tensor, budget_s: float = 0.3, reps: tuple[int, int] = (5, 50)
) -> float:
    """Median device time of `fn` in ms over a number of calls that fits `budget_s`, each with a cold L2."""
    fn()  # warm-up: compilation, allocator
    torch.cuda.synchronize()
    began = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    count = min(max(int(budget_s / max(time.perf_counter() - began, 1e-6)), reps[0]), reps[1])
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(count)]
    for start, end in events:
        flush.zero_()
        torch.cuda._sleep(SLEEP_CYCLES)
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def run(fast: QuantKernels, sizes_mib: Sequence[int], device: torch.device) -> tuple[dict[int, float], list[Row]]:
    """Copy bandwidth (GB/s) by size, and a row per kernel and size for the kernels module `fast`."""
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    copy_gbps, rows = {}, []
    for mib in sizes_mib:
        elements = (mib << 20) // 4
        x = torch.randn(elements, device=device)
        copy_gbps[mib] = 2 * 4 * elements / median_ms(x.clone, flush) / 1e6
        del x
        for case in _cases(fast, elements, device):
            ms, ref_ms = median_ms(case.fast, flush), median_ms(case.ref, flush)
            gbps = case.moved / ms / 1e6
            rows.append(Row(case.kernel, mib, ms, gbps, 100 * gbps / copy_gbps[mib], ref_ms, ref_ms / ms))
            torch.cuda.empty_cache()
    return copy_gbps, rows


def _table(device_name: str, copy_gbps: dict[int, float], rows: list[Row]) -> Table:
    table = Table(title=f"quantization kernels on {device_name}")
    for column in ("kernel", "MiB", "µs", "GB/s", "% copy", "ref µs", "speedup"):
        table.add_column(column, justify="left" if column == "kernel" else "right")
    for mib, gbps in copy_gbps.items():
        table.add_row("copy (torch clone)", str(mib), "", f"{gbps:,.0f}", "100", "", "")
    for r in rows:
        table.add_row(r.kernel, str(r.mib), f"{1e3 * r.ms:,.1f}", f"{r.gbps:,.0f}", f"{r.pct_copy:.0f}",
                      f"{1e3 * r.ref_ms:,.1f}", f"{r.speedup:.1f}x")  # fmt: skip
    return table


def _verdict(rows: list[Row]) -> list[str]:
    """The issue's targets over the buffers of 64 MiB and more."""
    large = [r for r in rows if r.mib >= 64]
    if not large:
        return []
    plain = min((r for r in large if r.kernel not in FUSED), key=lambda r: r.pct_copy)
    fused = min((r for r in large if r.kernel in FUSED), key=lambda r: r.pct_copy)
    slowest = min(large, key=lambda r: r.speedup)
    return [
        f"quantize/dequantize >= 64 MiB: lowest {plain.pct_copy:.0f}% of copy ({plain.kernel}, {plain.mib} MiB; target 85%)",
        f"fused kernels >= 64 MiB: lowest {fused.pct_copy:.0f}% of copy ({fused.kernel}, {fused.mib} MiB; target 80%)",
        f"speedup over the reference >= 64 MiB: lowest {slowest.speedup:.1f}x ({slowest.kernel}, {slowest.mib} MiB; target 2.5x)",
    ]  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zeropp bench kernels", description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES_MIB), metavar="MIB",
                        help="fp32 buffer sizes in MiB (default: %(default)s)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("results/bench_kernels.json"), help="JSON results path")
    args = parser.parse_args(argv)
    args.out = output_file(parser, args.out, "bench_kernels.json")
    console = Console()
    if not torch.cuda.is_available():
        console.print("zeropp bench kernels: needs a CUDA GPU (the kernels are Triton)")
        return 1
    try:
        import triton

        from zeropp.quant.triton import kernels as triton_kernels
    except ImportError:
        console.print("zeropp bench kernels: needs the triton package")
        return 1
    device = torch.device("cuda")
    torch.manual_seed(0)
    copy_gbps, rows = run(triton_kernels, args.sizes, device)
    name = torch.cuda.get_device_name(device)
    console.print(_table(name, copy_gbps, rows))
    verdict = _verdict(rows)
    for line in verdict:
        console.print(line)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = dict(
        device=name, torch=torch.__version__, triton=triton.__version__, block=BLOCK, row=ROW, sources=SOURCES,
        copy_gbps=copy_gbps, results=[asdict(r) for r in rows], verdict=verdict,
    )  # fmt: skip
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
