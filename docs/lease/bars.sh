#!/usr/bin/env bash
# Issue "never slower than dense": the matched pairs whose bars were missed or not yet measured, most wanted first,
# in one detached chain after install.sh: 512K bs1, then the frontier batches 32K x 16, 256K x 2 and 16K x 32 on an
# 80 GB card (x 2 on a 141 GB one), Locks against FlashInfer (the faster dense arm on every cell measured so far).
# Stores append cell by cell under /tmp/runs; poll with pollloop.sh.
#   mkdir -p /tmp/runs && setsid nohup bash docs/lease/bars.sh > /tmp/runs/chain-bars.log 2>&1 &
set -u
source "$(dirname "$0")/chain-env.sh"
echo "GPU memory ${mib} MiB: frontier batches x $f"
$B --arms flashinfer,locks --contexts 512k --batch 1 --out /tmp/runs/pairs-512k.jsonl
$B --arms flashinfer,locks --contexts 32k --batch $((16 * f)) --out /tmp/runs/frontier-32k.jsonl
$B --arms flashinfer,locks --contexts 256k --batch $((2 * f)) --out /tmp/runs/frontier-256k.jsonl
$B --arms flashinfer,locks --contexts 16k --batch $((32 * f)) --out /tmp/runs/frontier-16k.jsonl
echo "CHAIN DONE"
