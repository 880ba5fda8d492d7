#!/usr/bin/env bash
# Poll a detached chain from a device call: every 15 s, tar /tmp/runs into $OUT (one file, so a call cut by
# the device budget still returns its latest state), until the chain's log says CHAIN DONE or WAIT seconds pass.
# Usage (on the device): WAIT=540 bash docs/lease/pollloop.sh
set -u
WAIT=${WAIT:-540}
# A machine without the chain is a fresh one (the warm one went back): waiting would only spend device time.
[[ -f /tmp/runs/chain.log ]] || { echo "no chain on this machine: it was given back; start over (grid.sh)"; exit 3; }
end=$((SECONDS + WAIT))
while :; do
  # the store's record count over time: the grid's cell rate
  echo "$(date +%T) $(wc -l 2>/dev/null < /tmp/runs/quality-gemma3-270m-vllm.jsonl || echo 0)" >> /tmp/runs/progress.log
  tar -C /tmp -czf "$OUT/runs.tgz.tmp" runs 2>/dev/null && mv "$OUT/runs.tgz.tmp" "$OUT/runs.tgz"
  if grep -q "CHAIN DONE" /tmp/runs/chain.log 2>/dev/null; then echo "chain done"; break; fi
  (( SECONDS >= end )) && { echo "still running after ${WAIT}s"; break; }
  sleep 15
done
tail -n 25 /tmp/runs/chain.log 2>/dev/null
nvidia-smi --query-gpu=utilization.gpu,memory.used,clocks.sm --format=csv,noheader 2>/dev/null
