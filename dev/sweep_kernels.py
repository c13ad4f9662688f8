"""Sweep the Triton kernels' TILE and warps on the lent card: % of a copy at 64 / 256 MiB.

The same grid as docs/kernels.md's H100 sweep; configurations interleaved, two passes, the median of
the passes. Not part of any test or benchmark; its table goes to docs/kernels.md.

    PYTHONPATH=src python dev/sweep_kernels.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from zeropp.quant.triton import kernels
from zeropp.tools.bench.gpu import kernels as bench

GRID = ((512, 2), (512, 4), (1024, 2), (1024, 4), (2048, 2), (2048, 4), (2048, 8), (1024, 8), (4096, 8))
KERNELS = ("quantize int8", "quantize int4", "dequantize_reduce_quantize", "dequantize_reduce")
SIZES_MIB = (64, 256)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--passes", type=int, default=2)
    args = parser.parse_args()
    device = torch.device("cuda")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    copy = {}
    for mib in SIZES_MIB:
        x = torch.randn((mib << 20) // 4, device=device)
        copy[mib] = 8 * x.numel() / bench.median_ms(x.clone, flush) / 1e6
        del x
    pct: dict[tuple, list[float]] = {}
    for _ in range(args.passes):
        for mib in SIZES_MIB:
            for case in bench._cases(kernels, (mib << 20) // 4, device):
                if case.kernel not in KERNELS:
                    continue
                for tile, warps in GRID:
                    kernels.TILE, kernels.NUM_WARPS = tile, warps
                    gbps = case.moved / bench.median_ms(case.fast, flush, budget_s=0.15) / 1e6
                    pct.setdefault((tile, warps, case.kernel, mib), []).append(100 * gbps / copy[mib])
                del case
                torch.cuda.empty_cache()
    rows = [{"tile": t, "warps": w, "kernel": k, "mib": m, "pct_copy": statistics.median(v)}
            for (t, w, k, m), v in pct.items()]
    print(torch.cuda.get_device_name(), "copy GB/s", {m: round(g) for m, g in copy.items()})
    print("| TILE, warps | " + " | ".join(KERNELS) + " |")
    for tile, warps in GRID:
        cells = []
        for k in KERNELS:
            cells.append(" / ".join(f"{statistics.median(pct[(tile, warps, k, m)]):.1f}" for m in SIZES_MIB))
        print(f"| {tile}, {warps} | " + " | ".join(cells) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_gbps": copy, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
