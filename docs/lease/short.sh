#!/usr/bin/env bash
# The short-context bar of "never slower than dense", one detached chain after install.sh: 16K, then 32K, at batch
# 1, 4, 16, 32 from one prefill per engine against FlashInfer and FA3 (~5 min each); on a 141 GB card (32K x 32 fits
# no 80 GB one) then the 1M bs1 rung with the prefill's attention skipped (ONE_M=0: not run). Poll with pollloop.sh.
#   mkdir -p /tmp/runs && setsid nohup bash docs/lease/short.sh > /tmp/runs/chain-short.log 2>&1 &
set -u
source "$(dirname "$0")/chain-env.sh"
$B --arms flashinfer,fa3,locks --contexts 16k --batch 1,4,16,32 --out /tmp/runs/pairs-16k.jsonl
if (( f == 2 )); then batches=1,4,16,32; else batches=1,4,16; fi
$B --arms flashinfer,fa3,locks --contexts 32k --batch "$batches" --out /tmp/runs/pairs-32k.jsonl
(( f == 2 )) && [ "${ONE_M:-1}" = 1 ] && $S --contexts 1m --extend-positions --out /tmp/runs/pairs-1m-skip.jsonl
echo "CHAIN DONE"
