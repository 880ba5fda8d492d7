#!/usr/bin/env bash
# One kernel-only call (no vLLM): the GPU checks of a selection change, then `locks bench kernel` over every
# (tree, select) arm in turn, RUNS times, so the ratios come from one call; then, if asked, the graph toggle
# probe and the CUDA checks. Every output lands in $OUT as it is made (a call cut short returns what finished).
#   bash docs/lease/select-ab.sh           (carry harness/build_info.json: `make stamp`)
# Env: ARMS ("auto@. merge@."): select@tree pairs, a tree being the checkout (.) or an export of another commit
#      (`make tree REF=C DEST=.gpu/C`: its package folders with their own harness/build_info.json, carried);
#      CONTEXTS (16k,32k,128k,256k,512k,1m), BATCH (1,4), CELLS (context:batch cells timed after those, e.g.
#      "16k:32 32k:16"; none), RUNS (2), PROBE (0), CUDA_CHECKS (0), CHECKS (first; "after": only the long selection
#      checks, after the timings, for a call short of device time; "none": a call after one that ran them),
#      CHECK_TREE (.: the tree whose kernels the checks run, e.g. the candidate's export)
set -u
ARMS=${ARMS:-auto@. merge@.} CONTEXTS=${CONTEXTS:-16k,32k,128k,256k,512k,1m} BATCH=${BATCH:-1,4} RUNS=${RUNS:-2}
CELLS=${CELLS:-} CHECKS=${CHECKS:-first} CHECK_TREE=${CHECK_TREE:-.}
R=$PWD
K="bash $R/docs/lease/kernels.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
checks() {  # file tail-lines [--long]: the merge selection's GPU checks, run on CHECK_TREE's kernels
  (cd "$CHECK_TREE" && $K python3 -m locks_toolkit.harness.lab.kernel_checks --select merge --scorer cuda ${3:-}) 2>&1 \
    | tail -n "$2" > "$OUT/$1"
  tail -n 1 "$OUT/$1"
}
bench() {  # tree select tag contexts batch run
  (cd "$1" && $K python3 -m locks_toolkit.harness.lab.kernel_bench --contexts "$4" --batch "$5" --select "$2" \
    --out "$OUT/bench-$3.jsonl" >> "$OUT/bench-$3-$6.md" 2>> "$OUT/bench-err.txt") || echo "bench $3 $4 x $5 run $6: rc $?"
}
if [ "$CHECKS" = first ]; then
  checks checks-select.txt 40
  checks checks-select-long.txt 10 --long
fi
for run in $(seq 1 "$RUNS"); do
  for arm in $ARMS; do
    sel=${arm%@*} tree=${arm#*@} tag=$(basename "$(cd "${arm#*@}" && pwd)")-${arm%@*}
    bench "$tree" "$sel" "$tag" "$CONTEXTS" "$BATCH" "$run"
    for cell in $CELLS; do bench "$tree" "$sel" "$tag" "${cell%:*}" "${cell#*:}" "$run"; done
    echo "bench $tag run $run done at $(date +%T)"
  done
done
[ "$CHECKS" = after ] && checks checks-select-long.txt 10 --long
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
