#!/usr/bin/env bash
# Issue "never slower than dense", one detached chain after install.sh in the same call, most wanted first: matched
# pairs at 512K and 256K bs1, the kernel bench at each frontier cell and the long bs1 rungs (FA3 and FlashInfer
# columns: vLLM is installed), then matched pairs at the frontier batches. The frontier is what the card's KV pool fits:
# ~512K tokens on an 80 GB card (128K x 4, 64K x 8, 256K x 2), ~1M on a 141 GB one (128K x 8, 64K x 16, 256K x 4).
# Stores append cell by cell under /tmp/runs; poll with pollloop.sh.
#   mkdir -p /tmp/runs && setsid nohup bash docs/lease/long.sh > /tmp/runs/chain-long.log 2>&1 &
set -u
source "$(dirname "$0")/chain-env.sh"
echo "GPU memory ${mib} MiB: frontier 128k x $((4 * f)), 64k x $((8 * f)), 256k x $((2 * f))"
$B --arms flashinfer,locks --contexts 512k --batch 1 --out /tmp/runs/pairs-512k.jsonl
$B --arms flashinfer,fa3,locks --contexts 256k --batch 1 --out /tmp/runs/pairs-256k.jsonl
for cell in 16k:$((32 * f)) 32k:$((16 * f)) 64k:$((8 * f)) 128k:$((4 * f)) 256k:1 512k:1; do
  $L kernel --contexts "${cell%:*}" --batch "${cell#*:}" --out /tmp/runs/kernel-frontier.jsonl \
    > "/tmp/runs/kernel-${cell/:/x}.md" 2>&1 || echo "kernel $cell: rc $?"
  echo "kernel $cell done at $(date +%T)"
done
$B --arms flashinfer,locks --contexts 128k --batch $((4 * f)) --out /tmp/runs/frontier-128k.jsonl
$B --arms flashinfer,locks --contexts 64k --batch $((8 * f)) --out /tmp/runs/frontier-64k.jsonl
$B --arms flashinfer,locks --contexts 256k --batch $((2 * f)) --out /tmp/runs/frontier-256k.jsonl
echo "CHAIN DONE"
