#!/usr/bin/env bash
# Matched pairs of issue "never slower than dense" in one detached chain (after install.sh in the same call), most
# wanted first. A 141 GB card (asked for by what an 80 GB one cannot hold: 32K x 32 and 1M): 32K at batch 1, 4, 16,
# 32 from one prefill per engine against FlashInfer and FA3 (~5 min), then the 1M bs1 rung with the prefill's
# attention skipped. An 80 GB card (where 16K and 32K to batch 16 are measured): the 32K x 16 frontier cell. Then
# both: the 512K and 256K bs1 rungs with the skip, the kernel bench's long cells, and on the 141 GB card the 16K
# ladder last. Each store is appended cell by cell under /tmp/runs; poll with pollloop.sh.
#   mkdir -p /tmp/runs && setsid nohup bash docs/lease/pairs.sh > /tmp/runs/chain-pairs.log 2>&1 &
set -u
source "$(dirname "$0")/chain-env.sh"
if (( f == 2 )); then
  $B --arms flashinfer,fa3,locks --contexts 32k --batch 1,4,16,32 --out /tmp/runs/pairs-32k.jsonl
  $S --contexts 1m --extend-positions --out /tmp/runs/pairs-1m-skip.jsonl
else
  $B --arms flashinfer,locks --contexts 32k --batch 16 --out /tmp/runs/frontier-32k.jsonl
fi
$S --contexts 512k --out /tmp/runs/pairs-512k-skip.jsonl
$S --contexts 256k --out /tmp/runs/pairs-256k-skip.jsonl
for cell in 512k:1 256k:1 256k:4; do
  $L kernel --contexts "${cell%:*}" --batch "${cell#*:}" --out /tmp/runs/kernel-long.jsonl \
    > "/tmp/runs/kernel-${cell/:/x}.md" 2>&1 || echo "kernel $cell: rc $?"
done
(( f == 2 )) && $B --arms flashinfer,fa3,locks --contexts 16k --batch 1,4,16,32 --out /tmp/runs/pairs-16k.jsonl
echo "CHAIN DONE"
