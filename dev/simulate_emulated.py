"""Every stored ``zeropp bench cluster`` step against ``zeropp simulate --gpu cpu-gloo``: the host's calibration
on the unshaped steps, then one Markdown row per shaped step (docs/simulate.md, "Against the emulated cluster").

    PYTHONPATH=src python dev/simulate_emulated.py docs/results/bench_cluster*.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from zeropp.tools.simulate.emulated import calibrate_host, compare, stored_rows, summary


def main(paths: list[str]) -> None:
    files = {Path(p).name: list(stored_rows(json.loads(Path(p).read_text()))) for p in paths}
    before = [r for name, rows in files.items() if name != "bench_cluster_plan.json" for r in rows]
    flops, moved = calibrate_host(before)  # the planner's check measured the profile as fixed
    print(f"calibrated: host {flops / 1e9:.3g} GFLOP/s, kernels {moved / 1e9:.3g} GB/s\n")
    print(
        "| file | configuration | nodes | link | measured (s) | simulated (s) | ratio | same-day host | bound.py (s) | ratio |"
    )
    print("| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    everything, same_day = [], []
    for name, rows in files.items():
        host = calibrate_host(rows) if any(r["bandwidth"] == "none" for r in rows) else None
        for c, d in zip(compare(rows), compare(rows, host), strict=True):
            everything.append(c)
            same_day.append(d)
            bound = (
                f"{c['bound_predicted_s']:.3f} | {c['bound_predicted_s'] / c['measured_s']:.2f}"
                if "bound_predicted_s" in c
                else "|"
            )
            print(
                f"| {name.removeprefix('bench_cluster_').removesuffix('.json')} | {c['name'].removeprefix('zeropp ')} | "
                f"{c['nodes']} | {c['bandwidth']} | {c['measured_s']:.3f} | {c['simulated_s']:.3f} | {c['ratio']:.2f} | {d['ratio']:.2f} | {bound} |"
            )
    print(f"\n{summary(everything)}")
    print(f"bound.py's rows: {summary([c for c in everything if 'bound_predicted_s' in c])}")
    print(f"same-day host: {summary(same_day)}")
    print(f"same-day host, bound.py's rows: {summary([c for c in same_day if 'bound_predicted_s' in c])}")
    bound = [dict(c, ratio=c["bound_predicted_s"] / c["measured_s"]) for c in everything if "bound_predicted_s" in c]
    print(f"bound.py itself: {summary(bound)}")


if __name__ == "__main__":
    main(sys.argv[1:])
