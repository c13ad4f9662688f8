"""What is allocated at the step's peak of ``zeropp bench gpu``'s stage c (CUDA), by the zeropp line that allocated it.

Runs stage c's model (stage 3, bf16, activation checkpointing) at world 1 (nccl) and world 2 (gloo,
two ranks on one device) under the CUDA allocator's history; rank 0 replays its alloc/free events,
finds the largest total live, and prints the live blocks there grouped by the innermost zeropp frame.

    PYTHONPATH=src python dev/memory_peak.py [--worlds 1 2]
"""

from __future__ import annotations

import argparse
import collections

import torch

from zeropp.tools.bench.gpu.measures import Sizes, memory_rank
from zeropp.tools.bench.gpu.ranks import launch


def _where(frames: list[dict]) -> str:
    for f in frames:
        name = f.get("filename", "")
        if "zeropp" in name and "bench" not in name:
            return f"{name.split('zeropp/')[-1]}:{f.get('line')} {f.get('name')}"
    top = frames[0] if frames else {}
    return f"{top.get('filename', '?').split('/')[-1]}:{top.get('line')} {top.get('name')}"


def peak_rank(topology, config, batch) -> dict:
    torch.cuda.memory._record_memory_history(max_entries=400_000, stacks="python")
    result = memory_rank(topology, config, batch)
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    if topology.rank != 0:
        return result
    events = [e for trace in snapshot["device_traces"] for e in trace]
    summary = {}
    for freed_on in ("free_requested", "free_completed"):
        live, total, best, best_live = {}, 0, 0, {}
        for e in events:
            if e["action"] == "alloc":
                live[e["addr"]] = (e["size"], _where(e.get("frames", [])))
                total += e["size"]
                if total > best:
                    best, best_live = total, dict(live)
            elif e["action"] == freed_on and e["addr"] in live:
                total -= live.pop(e["addr"])[0]
        by_site = collections.Counter()
        for size, site in best_live.values():
            by_site[site] += size
        summary[freed_on] = {"peak_mib": best / 2**20, "by_site_mib": {k: v / 2**20 for k, v in by_site.most_common(14)}}
    result["peak"] = summary
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    sizes = Sizes.pick("cuda", quick=False)
    for world in args.worlds:
        backend = "nccl" if world == 1 else "gloo"
        r = launch(peak_rank, world, backend, "cuda", 120, config=sizes.memory, batch=sizes.memory_batch)[0]
        print(f"== world {world} ({backend}): step peak {r['step_peak_bytes'] / 2**20:.0f} MiB, "
              f"backward peak {r['backward_peak_bytes'] / 2**20:.0f} MiB, formula {r['formula_bytes'] / 2**20:.0f} MiB")
        for freed_on, s in r["peak"].items():
            print(f"  replayed peak ({freed_on}): {s['peak_mib']:.0f} MiB")
            for site, mib in s["by_site_mib"].items():
                print(f"    {mib:9.1f} MiB  {site}")


if __name__ == "__main__":
    main()
