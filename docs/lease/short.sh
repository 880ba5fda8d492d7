#!/usr/bin/env bash
# The short-context bar of "never slower than dense" on a 141 GB card (32K x 32 fits no 80 GB one), one detached
# chain after install.sh: 32K, then 16K, at batch 1, 4, 16, 32 from one prefill per engine against FlashInfer and
# FA3; then the 1M bs1 rung with the prefill's attention skipped. Poll with pollloop.sh.
#   mkdir -p /tmp/runs && setsid nohup bash docs/lease/short.sh > /tmp/runs/chain-short.log 2>&1 &
set -u
source "$(dirname "$0")/chain-env.sh"
if (( f != 2 )); then echo "short.sh: 32K x 32 needs a 141 GB card; this one has ${mib} MiB"; exit 2; fi
$B --arms flashinfer,fa3,locks --contexts 32k --batch 1,4,16,32 --out /tmp/runs/pairs-32k.jsonl
$B --arms flashinfer,fa3,locks --contexts 16k --batch 1,4,16,32 --out /tmp/runs/pairs-16k.jsonl
$B --arms flashinfer,locks --batch 1 --prefill-attention skip --contexts 1m --extend-positions \
  --out /tmp/runs/pairs-1m-skip.jsonl
echo "CHAIN DONE"
