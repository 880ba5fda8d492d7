#!/usr/bin/env bash
# Install what a lease's vLLM runs need, on the device, from what the earlier calls copied to /tmp:
# the vLLM bundle (/tmp/vllm-parts; the parts carried by this call, `.gpu/q*/part-*`, join them), the FlashInfer
# AOT set if carried (`.gpu/q*/fiaot`), the project wheel, and the optional wheels in /tmp/evalwhl. Source it:
# it exports the environment every later command needs.
set -eu
mkdir -p /tmp/vllm-parts /tmp/runs
cp .gpu/q*/part-* /tmp/vllm-parts/
[[ -d /tmp/site/vllm ]] || NO_TEST=1 bash /tmp/vllm-parts/install-on-gpu.sh /tmp/vllm-parts /tmp/site
for fi in .gpu/q*/fiaot; do [[ -d $fi ]] && NO_TEST=1 bash "$fi/install-on-gpu.sh" "$fi" /tmp/site; done
# PYTHONSAFEPATH: `python3 -m` from the checkout must not import its kernels/ folder as PyPI's `kernels`.
export PYTHONSAFEPATH=1 PYTHONPATH=/tmp/site VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
       PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .gpu/wheel/*.whl $(ls /tmp/evalwhl/*.whl 2>/dev/null)
set +e
