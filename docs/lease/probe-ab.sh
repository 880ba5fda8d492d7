#!/usr/bin/env bash
# One kernel-only call (no vLLM, ~4 min with a machine's start): the score probe on the checkout (its instruments
# price candidates before they are timed), the GPU checks of a candidate tree, then `locks bench kernel` of the
# checkout against that tree, two runs alternating (select-ab.sh).
#   make stamp && make candidate PATCH=docs/lease/candidates/score-scale-order.patch DEST=.gpu/cand
#   bash docs/lease/probe-ab.sh      (carry harness/build_info.json and .gpu/cand)
# Env: CAND (.gpu/cand), CONTEXTS (512k,1m), CELLS (32k:16).
set -u
R=$PWD CAND=${CAND:-.gpu/cand}
[ -d "$CAND/kernels" ] || { echo "no candidate tree at $CAND: make candidate PATCH=<patch> DEST=$CAND, and carry it"; exit 2; }
bash docs/lease/kernels.sh python3 -m locks_toolkit.harness.lab.score_probe --contexts 512k --batch 1 --cells 32k:16 \
  --out "$OUT/score-probe.jsonl" > "$OUT/score-probe.md" 2>&1
grep -E "^\| (512k|32k)" "$OUT/score-probe.md" | cut -d'|' -f2-6
(cd "$CAND" && bash "$R/docs/lease/kernels.sh" checks) > "$OUT/checks-cand.txt" 2>&1
tail -n 3 "$OUT/checks-cand.txt"
CHECKS=none ARMS="merge@. merge@$CAND" CONTEXTS=${CONTEXTS:-512k,1m} BATCH=1 CELLS=${CELLS:-32k:16} RUNS=2 \
  bash docs/lease/select-ab.sh 2>&1 | tail -n 6
