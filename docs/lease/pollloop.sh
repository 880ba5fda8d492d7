#!/usr/bin/env bash
# Poll detached chains from a device call: every 15 s, tar /tmp/runs into $OUT (one file, so a call cut by
# the device budget still returns its latest state), until every chain log says CHAIN DONE or WAIT seconds pass.
# Usage (on the device): WAIT=540 bash docs/lease/pollloop.sh
set -u
WAIT=${WAIT:-540}
shopt -s nullglob
chains=(/tmp/runs/chain*.log)
# A machine without a chain is a fresh one (the warm one went back): waiting would only spend device time.
(( ${#chains[@]} )) || { echo "no chain on this machine: it was given back; start over (grid.sh)"; exit 3; }
end=$((SECONDS + WAIT))
while :; do
  # the stores' record count over time: the grid's cell rate
  echo "$(date +%T) $(cat /tmp/runs/*.jsonl 2>/dev/null | wc -l)" >> /tmp/runs/progress.log
  tar -C /tmp -czf "$OUT/runs.tgz.tmp" runs 2>/dev/null && mv "$OUT/runs.tgz.tmp" "$OUT/runs.tgz"
  running=0
  for log in "${chains[@]}"; do grep -q "CHAIN DONE" "$log" || running=$((running + 1)); done
  (( running == 0 )) && { echo "chains done"; break; }
  (( SECONDS >= end )) && { echo "still running after ${WAIT}s: $running chain(s)"; break; }
  sleep 15
done
for log in "${chains[@]}"; do echo "== $log"; grep -v "^(EngineCore" "$log" | tail -n 6 | cut -c1-300; done
nvidia-smi --query-gpu=utilization.gpu,memory.used,clocks.sm --format=csv,noheader 2>/dev/null
