#!/usr/bin/env bash
# The long bs1 rungs with the prefill's attention skipped (`--prefill-attention skip`: a 1M prefill costs its GEMMs,
# not ~11 min of causal attention an engine), in one detached chain after install.sh in the same call. The skip is
# checked against an exact prefill at 256K in the same chain (the same pair both ways): the decode step must not care
# what the cache holds. 1M only on a 141 GB card (86 GB of KV); then the kernel bench's long cells. Poll with pollloop.sh.
#   mkdir -p /tmp/runs && setsid nohup bash docs/lease/skip-ladder.sh > /tmp/runs/chain-skip.log 2>&1 &
set -u
source "$(dirname "$0")/chain-env.sh"
S="$B --arms flashinfer,locks --batch 1 --prefill-attention skip"
$S --contexts 256k --out /tmp/runs/pairs-256k-skip.jsonl
if (( f == 2 )); then $S --contexts 1m --extend-positions --out /tmp/runs/pairs-1m-skip.jsonl; fi
$B --arms flashinfer,locks --batch 1 --contexts 256k --out /tmp/runs/pairs-256k.jsonl
$S --contexts 512k --out /tmp/runs/pairs-512k-skip.jsonl
for cell in 1m:1 512k:1 256k:1 256k:4; do
  $L kernel --contexts "${cell%:*}" --batch "${cell#*:}" --out /tmp/runs/kernel-long.jsonl \
    > "/tmp/runs/kernel-${cell/:/x}.md" 2>&1 || echo "kernel $cell: rc $?"
done
echo "CHAIN DONE"
