#!/usr/bin/env bash
# The 1M bs1 bar of issue "never slower than dense" in one detached chain (after install.sh in the same call): the
# FlashInfer + Locks pair at 1M (two ~11-minute prefills: a lease of its own, on a 141 GB card), then the kernel
# bench's long bs1 cells if the lease has time left. Poll with pollloop.sh.
#   mkdir -p /tmp/runs && setsid nohup bash docs/lease/one-m.sh > /tmp/runs/chain-1m.log 2>&1 &
set -u
source "$(dirname "$0")/chain-env.sh"
(( f == 2 )) || { echo "1M x 1 needs a 141 GB card (${mib} MiB here)"; echo "CHAIN DONE"; exit 1; }
$B --arms flashinfer,locks --contexts 1m --batch 1 --out /tmp/runs/pairs-1m.jsonl
for cell in 1m:1 512k:1 256k:1 256k:4; do
  $L kernel --contexts "${cell%:*}" --batch "${cell#*:}" --out /tmp/runs/kernel-long.jsonl \
    > "/tmp/runs/kernel-${cell/:/x}.md" 2>&1 || echo "kernel $cell: rc $?"
done
echo "CHAIN DONE"
