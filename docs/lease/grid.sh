#!/usr/bin/env bash
# The RULER quality grid with Gemma-3-270M's real weights through one per-request vLLM engine per pass
# (issue 23), started detached, then polled. Needs /tmp/gemma-parts (the calls of .gpu/gN), /tmp/gemma-tok
# (.gpu/tok) and /tmp/evalwhl; convert.sh started with the last of them (else it starts here).
# Env: PASSES (space-separated "ARMS:SAMPLES" runs into one store, in order; "micro" = the 32K engine
# microscope), LENGTHS, TASKS (default every task), ROUND (instances per (task, length) a round), WAIT (seconds
# to poll).
source docs/lease/install.sh
# The model's folder: converted by convert.sh (started with the model's last part); wait for it here.
[[ -f /tmp/runs/convert.log ]] || bash docs/lease/convert.sh
# Resume from the grid stored in docs/results (tracked, so it travels with every call): its cells are skipped.
S=/tmp/runs/quality-gemma3-270m-vllm.jsonl
[[ -f $S ]] || zcat docs/results/quality-gemma3-270m-vllm-h200*.jsonl.gz > $S
M=/tmp/gemma/gemma-3-270m-q4_k_m.gguf
L="python3 -m locks_toolkit.locks_cli.main"
E="$L eval run --engine vllm --model $M --suite ruler --lengths ${LENGTHS:-4k,8k,16k,32k} ${TASKS:+--tasks $TASKS} --skip-unfit \
   --budgets 64,128,256,512,1024,2048 --round-size ${ROUND:-10} --out $S"
MICRO="$L eval microscope --engine vllm --model $M --prompts 4 --context-tokens 32704 --steps 8 \
   --budgets 256,512,1024,2048 --out /tmp/runs/micro-vllm-h200.jsonl"
CHAIN="until grep -q 'CONVERT DONE' /tmp/runs/convert.log; do grep -q 'CONVERT FAILED' /tmp/runs/convert.log \
  && { echo 'the conversion failed: /tmp/runs/convert.log'; echo CHAIN DONE; exit 1; }; sleep 2; done; "
ALL=fullkv,locks:r8i4,oracle,quest,centroid  # every arm; in rounds of ROUND instances, so a cut run stays balanced
for pass in ${PASSES:-micro $ALL:50}; do
  if [[ $pass == micro ]]; then CHAIN+="date; $MICRO; "; else CHAIN+="date; $E --arms ${pass%:*} --samples ${pass##*:}; "; fi
done
setsid nohup bash -c "$CHAIN date; echo CHAIN DONE" > /tmp/runs/chain.log 2>&1 < /dev/null &
sleep 5
bash docs/lease/pollloop.sh
