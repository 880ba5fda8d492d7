#!/usr/bin/env bash
# The RULER quality grid with Gemma-3-270M's real weights through per-request vLLM engines (issue 23), started
# detached, then polled. Needs /tmp/gemma-parts (the calls of .gpu/gN), /tmp/gemma-tok (.gpu/tok) and
# /tmp/evalwhl; convert.sh started with the last of them (else it starts here).
# The grid runs in shards, one engine per context length, side by side on the one GPU: a decode step of this
# small model costs its engine's host time (100-190 ms a step whatever the length), so engines beside each other
# add up while the GPU idles. Each shard keeps its own store and chain log (/tmp/runs/grid-<len>.jsonl,
# chain-<len>.log), seeded with its length's stored cells; the stores concatenate into one grid afterwards.
# Env: SHARDS ("LENGTH:GPU_SHARE ...", shares summing to <= 0.85; the engines start one after another, each once
# the one before holds its KV cache, so none profiles memory while another allocates), PASSES ("ARMS:SAMPLES"
# runs per shard, in order; "micro" = the 32K engine microscope, with one shard only: it takes 0.85 of the GPU),
# TASKS (default every task), ROUND (instances per (task, length) a round), WAIT (seconds to poll).
source docs/lease/install.sh
# The model's folder: converted by convert.sh (started with the model's last part); wait for it here.
[[ -f /tmp/runs/convert.log ]] || bash docs/lease/convert.sh
M=/tmp/gemma/gemma-3-270m-q4_k_m.gguf
L="python3 -m locks_toolkit.locks_cli.main"
MICRO="$L eval microscope --engine vllm --model $M --prompts 4 --context-tokens 32704 --steps 8 \
   --budgets 256,512,1024,2048 --out /tmp/runs/micro-vllm-h200.jsonl"
AFTER_CONVERT="until grep -q 'CONVERT DONE' /tmp/runs/convert.log; do grep -q 'CONVERT FAILED' /tmp/runs/convert.log \
  && { echo 'the conversion failed: /tmp/runs/convert.log'; echo CHAIN DONE; exit 1; }; sleep 2; done; "
ALL=fullkv,locks:r8i4,oracle,quest,centroid  # every arm; in rounds of ROUND instances, so a cut run stays balanced
previous=""
for shard in ${SHARDS:-4k:0.15 8k:0.2 16k:0.2 32k:0.3}; do
  len=${shard%:*} share=${shard##*:}
  S=/tmp/runs/grid-$len.jsonl
  # Resume from the grid stored in docs/results (tracked, so it travels with every call): its cells are skipped.
  [[ -f $S ]] || zcat docs/results/quality-gemma3-270m-vllm-h200*.jsonl.gz | python3 -c "
import json, sys
from locks_toolkit.harness.workload import parse_size
length = parse_size('$len')
sys.stdout.writelines(line for line in sys.stdin if json.loads(line)['cell']['context_tokens'] == length)" > $S
  E="$L eval run --engine vllm --model $M --suite ruler --lengths $len ${TASKS:+--tasks $TASKS} --skip-unfit \
     --budgets 64,128,256,512,1024,2048 --round-size ${ROUND:-10} --gpu-memory $share --out $S"
  CHAIN=$AFTER_CONVERT
  [[ -n $previous ]] && CHAIN+="until grep -q 'init engine' $previous || grep -q 'CHAIN DONE' $previous; do sleep 2; done; "
  for pass in ${PASSES:-$ALL:50}; do
    if [[ $pass == micro ]]; then CHAIN+="date; $MICRO; "; else CHAIN+="date; $E --arms ${pass%:*} --samples ${pass##*:}; "; fi
  done
  previous=/tmp/runs/chain-$len.log
  setsid nohup bash -c "$CHAIN date; echo CHAIN DONE" > $previous 2>&1 < /dev/null &
done
sleep 5
bash docs/lease/pollloop.sh
