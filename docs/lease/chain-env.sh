# Sourced by the detached pair chains (long.sh, bars.sh, pairs.sh, short.sh, skip-ladder.sh): the commands they share
# (S: a bs1 rung against FlashInfer with the prefill's attention skipped), and the frontier batches'
# factor f, 2 where the card's KV pool holds ~1M tokens (141 GB), else 1 (80 GB: ~512K).
L="python3 -m locks_toolkit.locks_cli.main bench"
B="$L decode --budget 2048 --async-scheduling --single-prefill-from 128k --batch-prefill once"
S="$B --arms flashinfer,locks --batch 1 --prefill-attention skip"
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1)
if (( mib > 100000 )); then f=2; else f=1; fi
