#!/usr/bin/env bash
# The RULER quality grid with Gemma-3-270M's real weights through one per-request vLLM engine per pass
# (issue 23), started detached, then polled. Needs /tmp/gemma-parts (the calls of .gpu/gN), /tmp/gemma-tok
# (.gpu/tok) and /tmp/evalwhl.
# Env: PASSES (space-separated "ARMS:SAMPLES" runs into one store, in order; "micro" = the 32K engine
# microscope), LENGTHS, TASKS (default every task), WAIT (seconds to poll).
source docs/lease/install.sh
mkdir -p /tmp/gemma
[[ -f /tmp/gemma/gemma-3-270m-q4_k_m.gguf ]] || cat /tmp/gemma-parts/gemma.part-* > /tmp/gemma/gemma-3-270m-q4_k_m.gguf
(cd /tmp/gemma && sha256sum -c /tmp/gemma-parts/GGUF.sha256) || { echo "GGUF checksum mismatch"; exit 1; }
# The tokenizer converted on the CPU machine (transformers >= 5.24) beside the GGUF: the device's transformers
# 5.17 converts Gemma-3's GGUF tokenizer wrongly, and a tokenizer.json beside the file wins over converting.
[[ -f /tmp/gemma-tok/tokenizer.json.gz ]] || { echo "no /tmp/gemma-tok: copy .gpu/tok with the last GGUF part"; exit 1; }
gunzip -c /tmp/gemma-tok/tokenizer.json.gz > /tmp/gemma/tokenizer.json && cp /tmp/gemma-tok/tokenizer_config.json /tmp/gemma/
M=/tmp/gemma/gemma-3-270m-q4_k_m.gguf
L="python3 -m locks_toolkit.locks_cli.main"
E="$L eval run --engine vllm --model $M --suite ruler --lengths ${LENGTHS:-4k,8k,16k,32k} ${TASKS:+--tasks $TASKS} --skip-unfit \
   --budgets 64,128,256,512,1024,2048 --out /tmp/runs/quality-gemma3-270m-vllm.jsonl"
MICRO="$L eval microscope --engine vllm --model $M --prompts 4 --context-tokens 32704 --steps 8 \
   --out /tmp/runs/micro-vllm-h200.jsonl"
CHAIN=""
for pass in ${PASSES:-fullkv,locks:r8i4:50 fullkv,oracle,quest,centroid:10 micro fullkv,oracle,quest,centroid:50}; do
  if [[ $pass == micro ]]; then CHAIN+="date; $MICRO; "; else CHAIN+="date; $E --arms ${pass%:*} --samples ${pass##*:}; "; fi
done
setsid nohup bash -c "$CHAIN date; echo CHAIN DONE" > /tmp/runs/chain.log 2>&1 < /dev/null &
sleep 5
bash docs/lease/pollloop.sh
