#!/bin/bash
# The disk tier's footprint in a memory cgroup (v1, root): `dev/dio_measure.sh SRC LABEL` trains a 57M-parameter
# GPT 3 steps on one rank with the optimizer and the parameters on disk (bf16), zeropp imported from SRC
# (a checkout's src/, to compare two versions), inside a fresh cgroup, and prints the wall time and the
# cgroup's peak usage (memory.max_usage_in_bytes: what a memory limit would hold the run to, page cache included).
set -u
SRC=$1; LABEL=$2; CG=/sys/fs/cgroup/memory/zeropp_dio_$LABEL; SCRATCH=$(mktemp -d)
rmdir "$CG" 2>/dev/null; mkdir "$CG"
start=$(date +%s.%N)
bash -c "echo \$\$ > $CG/cgroup.procs; cd $SCRATCH; PYTHONPATH=$SRC exec python -m zeropp.cli train --preset medium \
  --n-layer 8 --d-model 768 --n-head 12 --steps 3 --eval-batches 1 --nproc-per-node 1 --precision bf16 \
  --offload-optimizer nvme --offload-params nvme --offload-path $SCRATCH > $SCRATCH/log 2>&1"
rc=$?
end=$(date +%s.%N)
peak=$(awk '{printf "%.0f", $1 / 1048576}' "$CG/memory.max_usage_in_bytes")
echo "$LABEL rc=$rc wall_s=$(echo "$end - $start" | bc) peak_MiB=$peak"
rmdir "$CG" 2>/dev/null; rm -rf "$SCRATCH"
