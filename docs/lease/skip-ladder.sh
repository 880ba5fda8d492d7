#!/usr/bin/env bash
# The long bs1 rungs with the prefill's attention skipped (`--prefill-attention skip`: a 1M prefill costs its GEMMs,
# not ~11 min of causal attention an engine), in one detached chain after install.sh in the same call, most wanted
# first so that a lease cut short keeps it: the longest rung the card holds (1M on a 141 GB card, 86 GB of KV; else
# 512K), then the check of the skip: the same pair at 128K with and without it (the decode step must not care what
# the cache holds), then the other long rungs and the kernel bench's long cells. Poll with pollloop.sh.
#   mkdir -p /tmp/runs && setsid nohup bash docs/lease/skip-ladder.sh > /tmp/runs/chain-skip.log 2>&1 &
set -u
source "$(dirname "$0")/chain-env.sh"
P="$B --arms flashinfer,locks --batch 1"
S="$P --prefill-attention skip"
if (( f == 2 )); then $S --contexts 1m --extend-positions --out /tmp/runs/pairs-1m-skip.jsonl
else $S --contexts 512k --out /tmp/runs/pairs-512k-skip.jsonl; fi
$S --contexts 128k --out /tmp/runs/pairs-128k-skip.jsonl
$P --contexts 128k --out /tmp/runs/pairs-128k.jsonl
if (( f == 2 )); then $S --contexts 512k --out /tmp/runs/pairs-512k-skip.jsonl; fi
$S --contexts 256k --out /tmp/runs/pairs-256k-skip.jsonl
for cell in 1m:1 512k:1 256k:1 256k:4; do
  $L kernel --contexts "${cell%:*}" --batch "${cell#*:}" --out /tmp/runs/kernel-long.jsonl \
    > "/tmp/runs/kernel-${cell/:/x}.md" 2>&1 || echo "kernel $cell: rc $?"
done
echo "CHAIN DONE"
