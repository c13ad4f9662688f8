"""Re-score stored ``zeropp bench cluster`` results with the estimator's current time model.

Rows written before the model existed lack the estimator's per-phase bytes; they are rebuilt from
each row's configuration (the benchmark's names: ZeRO-3, ZeRO++ and its unquantized intra-node hop,
on the `small` GPT in fp32, as they were before `qgz_pipeline_min_chunk`: two qgZ chunks) and
checked against the bytes the row already holds, then the bound and the prediction are computed
again (``zeropp.tools.bench.cluster.bound.add_bounds``) and the file rewritten. Prints each shaped point's prediction and error.

    PYTHONPATH=src python dev/rescore_cluster.py docs/results/bench_cluster_nodes.json ...
"""

from __future__ import annotations

import json
import sys

from zeropp.config.model import ModelConfig
from zeropp.config.sections import ZEROPP_SWITCHES, Config, ZeroConfig
from zeropp.tools.bench.cluster.bound import add_bounds, estimator_fields
from zeropp.tools.bench.runs import ZEROPP_OFF

BEFORE_MIN_CHUNK = {"qgz_pipeline_min_chunk": 1}  # the rows it re-scores were run with qgZ chunks of any size
SWITCHES = {
    "zeropp ZeRO-3": ZEROPP_OFF,
    "zeropp ZeRO++": {**ZEROPP_SWITCHES, **BEFORE_MIN_CHUNK},
    "zeropp ZeRO++ unquantized intra-node hop": {**ZEROPP_SWITCHES, **BEFORE_MIN_CHUNK, "gradient_intra_node_bits": 0},
}


def rescore(rows: list[dict], goodput: dict[str, float]) -> None:
    for row in rows:
        if row["name"] in SWITCHES and "error" not in row:
            config = Config(zero=ZeroConfig(stage=3, **SWITCHES[row["name"]]), model=ModelConfig(preset="small"))
            config = config.to_dict()
            config["topology"]["nodes"] = row["nodes"]
            fields = estimator_fields(config, row["nodes"], row["ranks_per_node"])
            assert fields["estimated_node_inter_bytes"] == row["estimated_node_inter_bytes"], row["name"]
            row.update(fields)
    add_bounds(rows, goodput)
    for row in rows:
        if "predicted_s" in row:
            print(f"{row['nodes']} {row['bandwidth']:8s} {row['name']:45s} step {row['median_step_time_s']:.3f} "
                  f"predicted {row['predicted_s']:.3f} ({row['estimator_error']:+.1%})")  # fmt: skip


def main(paths: list[str]) -> None:
    for path in paths:
        print(path)
        with open(path) as f:
            data = json.load(f)
        if "runs" in data:  # paired runs: one list of rows per run, the goodput of each run's probe unknown
            for rows in data["runs"]:
                goodput = {r["bandwidth"]: r["node_inter_bytes"] * 8 / r["wire_s"] for r in rows if "wire_s" in r}
                rescore(rows, goodput)
        else:
            rescore(data["rows"], data["goodput_bps"])
        with open(path, "w") as f:
            json.dump(data, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
