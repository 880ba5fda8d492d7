#!/usr/bin/env bash
# One kernel-only call (no vLLM): the GPU checks of a selection change, then `locks bench kernel` with the deployed
# settings and with SELECT (default merge) alternately, twice each, so the ratios come from one call; then the
# graph toggle probe. Every output lands in $OUT as it is made (a call cut short still returns what finished).
#   bash docs/lease/select-ab.sh                  (carry harness/build_info.json: `make stamp`)
# Env: SELECT (merge), CONTEXTS (16k,32k,128k,256k,512k,1m), BATCH (1,4), RUNS (2), PROBE (1), CUDA_CHECKS (1)
set -u
SELECT=${SELECT:-merge} CONTEXTS=${CONTEXTS:-16k,32k,128k,256k,512k,1m} BATCH=${BATCH:-1,4} RUNS=${RUNS:-2}
K="bash docs/lease/kernels.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
$K python3 -m locks_toolkit.harness.lab.kernel_checks --select "$SELECT" --scorer cuda 2>&1 | tail -n 40 > "$OUT/checks-select.txt"
tail -n 1 "$OUT/checks-select.txt"
for run in $(seq 1 "$RUNS"); do
  for sel in auto "$SELECT"; do
    $K python3 -m locks_toolkit.harness.lab.kernel_bench --contexts "$CONTEXTS" --batch "$BATCH" --select "$sel" \
      --out "$OUT/bench-$sel.jsonl" > "$OUT/bench-$sel-$run.md" 2> "$OUT/bench-err.txt" || echo "bench $sel $run: rc $?"
    echo "bench $sel run $run done at $(date +%T)"
  done
done
if [ "${PROBE:-1}" = 1 ]; then
  for flags in "" "--no-upload" "--foreign"; do
    $K python3 -m locks_toolkit.harness.lab.graph_toggle_probe --layers 40 $flags --out "$OUT/toggle.jsonl" 2>&1 | tail -n 14
  done
fi
if [ "${CUDA_CHECKS:-1}" = 1 ]; then
  $K python3 -m locks_toolkit.harness.lab.kernel_checks --cuda 2>&1 | tail -n 40 > "$OUT/checks-cuda.txt"
  tail -n 1 "$OUT/checks-cuda.txt"
fi
