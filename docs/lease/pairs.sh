#!/usr/bin/env bash
# Matched pairs of issue "never slower than dense" in one detached chain (after install.sh in the same call):
# 16K and 32K at batch 1, 4, 16, 32 from one prefill per engine against FlashInfer and FA3. Each store is
# appended cell by cell under /tmp/runs; poll with pollloop.sh.
#   setsid nohup bash docs/lease/pairs.sh > /tmp/runs/chain-pairs.log 2>&1 &
set -u
source "$(dirname "$0")/chain-env.sh"
$B --arms flashinfer,fa3,locks --contexts 16k --batch 1,4,16,32 --out /tmp/runs/pairs-16k.jsonl
$B --arms flashinfer,fa3,locks --contexts 32k --batch 1,4,16,32 --out /tmp/runs/pairs-32k.jsonl
echo "CHAIN DONE"
