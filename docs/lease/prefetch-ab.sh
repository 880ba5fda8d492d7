#!/usr/bin/env bash
# The output-projection prefetch (settings `prefetch`), one detached chain after install.sh: the kernel-only probe
# (harness/lab/prefetch_probe.py: a layer with its projection, with and without the prefetch), then matched pairs
# of `locks` against `locks[prefetch=inline]`, `locks[prefetch=side]` and FlashInfer at 512K bs1 (prefill attention
# skipped) and 32K x 16; last, the score probe's kernel variants.
# Poll with pollloop.sh.
#   mkdir -p /tmp/runs && setsid nohup bash docs/lease/prefetch-ab.sh > /tmp/runs/chain-prefetch.log 2>&1 &
set -u
source "$(dirname "$0")/chain-env.sh"
python3 -m locks_toolkit.harness.lab.prefetch_probe --contexts 512k,32k --batch 1 --out /tmp/runs/prefetch-probe.jsonl \
  > /tmp/runs/prefetch-probe.txt 2>&1 || echo "probe: rc $?"
A="flashinfer,locks,locks[prefetch=inline],locks[prefetch=side]"
$B --arms "$A" --batch 1 --prefill-attention skip --contexts 512k --out /tmp/runs/prefetch-512k.jsonl
$B --arms "$A" --contexts 32k --batch 16 --out /tmp/runs/prefetch-32k.jsonl
# The score kernel's variants (coef_i2fp among them), kernel-only, at the cells the bars miss.
python3 -m locks_toolkit.harness.lab.score_probe --contexts 512k --batch 1 --cells 32k:16 \
  --out /tmp/runs/score-probe.jsonl > /tmp/runs/score-probe.md 2>&1 || echo "score probe: rc $?"
echo "CHAIN DONE"
