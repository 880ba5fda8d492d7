#!/usr/bin/env bash
# Start the GGUF's one-time conversion to the HF folder vLLM loads, detached, as soon as the model's parts are on
# the device (the call that copies .gpu/g5, .gpu/evalwhl, .gpu/tok and .gpu/wheel): it then overlaps the vLLM
# bundle's transfer and install instead of delaying the grid. grid.sh waits for it. Log: /tmp/runs/convert.log.
set -eu
mkdir -p /tmp/gemma /tmp/runs /tmp/site
[[ -f /tmp/gemma/gemma-3-270m-q4_k_m.gguf ]] || cat /tmp/gemma-parts/gemma.part-* > /tmp/gemma/gemma-3-270m-q4_k_m.gguf
(cd /tmp/gemma && sha256sum -c /tmp/gemma-parts/GGUF.sha256) || { echo "GGUF checksum mismatch"; exit 1; }
# The tokenizer converted on the CPU machine (transformers >= 5.24) beside the GGUF: the device's transformers
# 5.17 converts Gemma-3's GGUF tokenizer wrongly, and a tokenizer.json beside the file wins over converting.
gunzip -c /tmp/gemma-tok/tokenizer.json.gz > /tmp/gemma/tokenizer.json && cp /tmp/gemma-tok/tokenizer_config.json /tmp/gemma/
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .gpu/wheel/*.whl /tmp/evalwhl/*.whl
setsid nohup bash -c "PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 python3 -c '
from locks_toolkit.suites.model_source import resolve_model_source, vllm_model_dir
print(vllm_model_dir(resolve_model_source(\"/tmp/gemma/gemma-3-270m-q4_k_m.gguf\")))' \
  && echo CONVERT DONE || echo CONVERT FAILED" > /tmp/runs/convert.log 2>&1 < /dev/null &
echo "conversion started"
