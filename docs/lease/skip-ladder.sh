#!/usr/bin/env bash
# The long bs1 rungs with the prefill's attention skipped (`--prefill-attention skip`: a 1M prefill costs its GEMMs,
# not ~11 min of causal attention an engine), in one detached chain after install.sh in the same call, most wanted
# first so that a lease cut short keeps it: 1M on a 141 GB card (86 GB of KV), the check of the skip (the same pair
# at 128K with and without it: the decode step must not care what the cache holds), 512K and 256K, then the kernel
# bench's long cells (and kernel candidates named by AB_ARMS). Poll with pollloop.sh.
#   mkdir -p /tmp/runs && setsid nohup bash docs/lease/skip-ladder.sh > /tmp/runs/chain-skip.log 2>&1 &
set -u
source "$(dirname "$0")/chain-env.sh"
P="$B --arms flashinfer,locks --batch 1"  # the exact-prefill twin of chain-env.sh's S
# A 141 GB card: its 1M rung first (the lease's reason); an 80 GB one: the check first, then its longest rung.
(( f == 2 )) && $S --contexts 1m --extend-positions --out /tmp/runs/pairs-1m-skip.jsonl
$S --contexts 128k --out /tmp/runs/pairs-128k-skip.jsonl
$P --contexts 128k --out /tmp/runs/pairs-128k.jsonl
$S --contexts 512k --out /tmp/runs/pairs-512k-skip.jsonl
$S --contexts 256k --out /tmp/runs/pairs-256k-skip.jsonl
# Kernel candidates, kernel-only, where AB_ARMS names them (select@tree pairs of select-ab.sh, e.g.
# "auto@. auto@.gpu/cand"; carry the trees and harness/build_info.json): their 512K and 1M bs1 cells time the
# checkout's kernels too.
if [ -n "${AB_ARMS:-}" ]; then
  mkdir -p /tmp/runs/ab
  OUT=/tmp/runs/ab CHECKS=none ARMS="$AB_ARMS" CONTEXTS=512k,1m BATCH=1 CELLS="32k:16" \
    bash docs/lease/select-ab.sh > /tmp/runs/ab.log 2>&1 || echo "select-ab: rc $?"
fi
for cell in 1m:1 512k:1 256k:1 256k:4; do
  $L kernel --contexts "${cell%:*}" --batch "${cell#*:}" --out /tmp/runs/kernel-long.jsonl \
    > "/tmp/runs/kernel-${cell/:/x}.md" 2>&1 || echo "kernel $cell: rc $?"
done
echo "CHAIN DONE"
