#!/usr/bin/env bash
# One kernel-only call (no vLLM): the score probe (`harness/lab/score_probe.py`) over CONTEXTS x BATCH and CELLS, then
# the score kernel under Nsight Compute (full set, source counters) at NCU_CELLS (context:batch[:variant]).
#   bash docs/lease/score-probe.sh          (carry harness/build_info.json: `make stamp`)
# TREE: the package folders whose kernels run (the checkout, or an export from `make tree`, carried).
set -u
CONTEXTS=${CONTEXTS:-256k,512k,1m} BATCH=${BATCH:-1} CELLS=${CELLS:-32k:16,512k:4} NCU_CELLS=${NCU_CELLS:-524288:1}
R=$PWD T=${TREE:-.}
K="bash $R/docs/lease/kernels.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
(cd "$T" && $K python3 -m locks_toolkit.harness.lab.score_probe --contexts "$CONTEXTS" --batch "$BATCH" --cells "$CELLS" \
  --out "$OUT/score-probe.jsonl" > "$OUT/score-probe.md" 2> "$OUT/score-probe-err.txt") || echo "probe rc $?"
cat "$OUT/score-probe.md"
P="ncu --profile-from-start off --clock-control none --set full --import-source yes --warp-sampling-interval 0"
for cell in $NCU_CELLS; do
  IFS=: read -r context batch variant <<< "$cell"
  tag=score-${context}x${batch}${variant:+-$variant}
  (cd "$T" && $K $P -o "$OUT/$tag" -f python3 "$R/docs/lease/score_ncu.py" $context $batch $variant > "$OUT/$tag.log" 2>&1)
  ncu -i "$OUT/$tag.ncu-rep" --page details > "$OUT/$tag-details.txt" 2>&1
  ncu -i "$OUT/$tag.ncu-rep" --page source --csv --print-source sass > "$OUT/$tag-sass.csv" 2>&1
  grep -m1 Duration "$OUT/$tag-details.txt"
done
tar -C "$OUT" -czf /tmp/score-probe.tgz . && mv /tmp/score-probe.tgz "$OUT/all.tgz"  # one file: a call returns at most 8
