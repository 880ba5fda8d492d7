#!/usr/bin/env bash
# One kernel-only call (no vLLM): the GPU checks of a selection change, then `locks bench kernel` over every
# (tree, select) arm in turn, RUNS times, so the ratios come from one call; then, if asked, the graph toggle
# probe and the CUDA checks. Every output lands in $OUT as it is made (a call cut short returns what finished).
#   bash docs/lease/select-ab.sh           (carry harness/build_info.json: `make stamp`)
# Env: ARMS ("auto@. merge@."): select@tree pairs, a tree being the checkout (.) or an export of another commit
#      (`git archive C kernels harness suites reports locks_cli | tar -x -C base-C`, its own harness/build_info.json,
#      carried); CONTEXTS (16k,32k,128k,256k,512k,1m), BATCH (1,4), CELLS (context:batch cells timed after
#      those, e.g. "16k:32 32k:16"; none), RUNS (2), PROBE (0), CUDA_CHECKS (0), CHECKS (first; "after": only the
#      long selection checks, after the timings, for a call short of device time), CHECK_TREE (.: the tree whose
#      kernels the checks run, e.g. the candidate's export from `make tree`)
set -u
ARMS=${ARMS:-auto@. merge@.} CONTEXTS=${CONTEXTS:-16k,32k,128k,256k,512k,1m} BATCH=${BATCH:-1,4} RUNS=${RUNS:-2}
CELLS=${CELLS:-} CHECKS=${CHECKS:-first} CHECK_TREE=${CHECK_TREE:-.}
R=$PWD
K="bash $R/docs/lease/kernels.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
long_checks() {
  (cd "$CHECK_TREE" && $K python3 -m locks_toolkit.harness.lab.kernel_checks --select merge --scorer cuda --long) 2>&1 \
    | tail -n 10 > "$OUT/checks-select-long.txt"
  tail -n 1 "$OUT/checks-select-long.txt"
}
if [ "$CHECKS" != after ]; then
  (cd "$CHECK_TREE" && $K python3 -m locks_toolkit.harness.lab.kernel_checks --select merge --scorer cuda) 2>&1 \
    | tail -n 40 > "$OUT/checks-select.txt"
  tail -n 1 "$OUT/checks-select.txt"
  long_checks
fi
for run in $(seq 1 "$RUNS"); do
  for arm in $ARMS; do
    sel=${arm%@*} tree=${arm#*@} tag=$(basename "$(cd "${arm#*@}" && pwd)")-${arm%@*}
    (cd "$tree" && $K python3 -m locks_toolkit.harness.lab.kernel_bench --contexts "$CONTEXTS" --batch "$BATCH" \
      --select "$sel" --out "$OUT/bench-$tag.jsonl" > "$OUT/bench-$tag-$run.md" 2>> "$OUT/bench-err.txt") || echo "bench $tag $run: rc $?"
    for cell in $CELLS; do
      (cd "$tree" && $K python3 -m locks_toolkit.harness.lab.kernel_bench --contexts "${cell%:*}" --batch "${cell#*:}" \
        --select "$sel" --out "$OUT/bench-$tag.jsonl" >> "$OUT/bench-$tag-$run.md" 2>> "$OUT/bench-err.txt") || echo "bench $tag $cell $run: rc $?"
    done
    echo "bench $tag run $run done at $(date +%T)"
  done
done
[ "$CHECKS" = after ] && long_checks
if [ "${PROBE:-0}" = 1 ]; then
  for flags in "" "--no-upload" "--foreign"; do
    $K python3 -m locks_toolkit.harness.lab.graph_toggle_probe --layers 40 $flags --out "$OUT/toggle.jsonl" 2>&1 | tail -n 14
  done
fi
if [ "${CUDA_CHECKS:-0}" = 1 ]; then
  $K python3 -m locks_toolkit.harness.lab.kernel_checks --cuda 2>&1 | tail -n 40 > "$OUT/checks-cuda.txt"
  tail -n 1 "$OUT/checks-cuda.txt"
fi
tar -C "$OUT" -czf /tmp/select-ab.tgz . && mv /tmp/select-ab.tgz "$OUT/all.tgz"  # one file: a call returns at most 8
