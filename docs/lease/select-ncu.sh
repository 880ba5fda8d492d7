#!/usr/bin/env bash
# One merge-selection launch under Nsight Compute (full set, source counters, densest warp sampling) at kernel-bench
# cells, run on a tree's kernels: its report, details page and per-SASS-instruction samples land in $OUT.
#   bash docs/lease/select-ncu.sh          (TREE=. CELLS="524288:1": context tokens:batch[:flat], flat = zero queries)
# Read the SASS csv by phase: instructions executed by every program (the chunk phase) against those executed only
# by each pair's last program (the merge tail); samples per SM give each phase's share of the launch.
set -u
TREE=${TREE:-.} CELLS=${CELLS:-524288:1}
R=$PWD
P="ncu --profile-from-start off --clock-control none --set full --import-source yes --warp-sampling-interval 0"
for cell in $CELLS; do
  IFS=: read -r context batch queries <<< "$cell"
  tag=select-$(basename "$(cd "$TREE" && pwd)")-${context}x${batch}${queries:+-$queries}
  (cd "$TREE" && bash "$R/docs/lease/kernels.sh" $P -o "$OUT/$tag" -f python3 "$R/docs/lease/select_ncu.py" $context $batch $queries) \
    > "$OUT/$tag.log" 2>&1
  ncu -i "$OUT/$tag.ncu-rep" --page details > "$OUT/$tag-details.txt" 2>&1
  ncu -i "$OUT/$tag.ncu-rep" --page source --csv --print-source sass > "$OUT/$tag-sass.csv" 2>&1
  grep -m1 Duration "$OUT/$tag-details.txt"
done
tar -C "$OUT" -czf /tmp/select-ncu.tgz . && mv /tmp/select-ncu.tgz "$OUT/all.tgz"  # one file: a call returns at most 8
