#!/usr/bin/env bash
# Matched pairs of issue "never slower than dense" in one detached chain (after install.sh in the same call):
# 32K and 16K at batch 1, 4, 16, 32 from one prefill per engine, 256K at batch 1, then the kernel bench with
# FA3 and FlashInfer beside it. Each store is appended cell by cell under /tmp/runs; poll with pollloop.sh.
#   setsid nohup bash docs/lease/pairs.sh > /tmp/runs/chain-pairs.log 2>&1 &
set -u
B="python3 -m locks_toolkit.locks_cli.main bench decode --budget 2048 --async-scheduling --single-prefill-from 128k"
$B --arms fa3,flashinfer,locks --contexts 32k --batch 1,4,16,32 --batch-prefill once --out /tmp/runs/pairs-32k.jsonl
$B --arms flashinfer,locks --contexts 256k --batch 1 --out /tmp/runs/pairs-256k.jsonl
$B --arms flashinfer,fa3,locks --contexts 16k --batch 1,4,16,32 --batch-prefill once --out /tmp/runs/pairs-16k.jsonl
python3 -m locks_toolkit.locks_cli.main bench kernel --contexts 256k,512k,1m --batch 1,4 --out /tmp/runs/kernel-floor.jsonl
echo "CHAIN DONE"
