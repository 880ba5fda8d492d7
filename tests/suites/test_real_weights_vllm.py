"""Gemma-3-270M's real weights in the real vLLM 0.24 CPU engine with the Locks backend, on needle prompts.

FullKV (stock CPU_ATTN) must give the transformers engine's greedy tokens and answer every needle. Locks
with a budget that can hold the needle's pages must give FullKV's answers; Locks with only the sink and the
recent page (the needle's pages cannot be selected) must lose them, so the test can fail both ways.
Gemma-3's sliding-window layers run stock (counted); its 3 global layers (d = 256, G = 4, one KV head) run
the Locks path. The needle sits > 1000 tokens before the question, outside the 512-token sliding window,
so only the global layers can read it. Each arm runs in a subprocess of its own (vLLM loads plugins once
per process), configured by the harness's own arms; the two Locks budgets are two engines of one process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(1200)]

CONTEXT, DEPTH, SEEDS, NEW_TOKENS = 1536, 0.2, (0, 1, 2), 10
WIDE, SINK_AND_RECENT = 512, 32  # tokens: 32 pages (the needle's 2 fit), 2 pages (only sink + recent)


def _generate(model_dir: str, arm_name: str, budgets: list[int | None], prompts: list[list[int]]) -> list[dict]:
    """In this (fresh) process: one engine of `arm_name` per budget, one after another; greedy tokens for
    every prompt + the Locks counters of each."""
    import gc

    from locks_toolkit.harness.arms import SparseKnobs, get_arm

    arm = get_arm(arm_name)
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", TORCHDYNAMO_DISABLE="1",
                      **arm.environment(None if budgets[0] is None else SparseKnobs(budgets[0]), None))
    from locks_toolkit.kernels.vllm_backend import counters
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    results = []
    for budget in budgets:
        knobs = None if budget is None else SparseKnobs(budget)
        llm = LLM(model_dir, dtype="float32", max_model_len=2048, max_num_batched_tokens=2048, enforce_eager=True,
                  enable_prefix_caching=False, seed=0, **arm.engine_kwargs(knobs))
        counters.reset()
        outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts],
                               SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS), use_tqdm=False)
        results.append({"tokens": [list(o.outputs[0].token_ids) for o in outputs],
                        "text": [o.outputs[0].text for o in outputs], "counters": counters.snapshot()})
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return results


def _engines(model_dir, arm_name, budgets, prompts) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "LOCKS_VLLM_CPU"}
    proc = subprocess.run([sys.executable, __file__, model_dir, arm_name, json.dumps(budgets), json.dumps(prompts)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import torch
    from locks_toolkit.suites.model_source import gguf_file, load_gemma3_270m, resolve_model_source, vllm_model_dir
    from locks_toolkit.suites.niah import build_niah_prompt

    loaded = load_gemma3_270m(torch.float32)
    # `--model <file>.gguf`'s path: the package's GGUF as a local file, converted once into the folder vLLM loads
    # (the folder the load above keeps, so it is not written twice)
    gguf = resolve_model_source(str(gguf_file(resolve_model_source("gemma3-270m"))))
    assert gguf.kind == "gguf"
    model_dir = str(vllm_model_dir(gguf, loaded=loaded))
    needles = [build_niah_prompt(loaded.tokenizer, CONTEXT, seed, depth=DEPTH) for seed in SEEDS]
    prompts = [list(p.token_ids) for p in needles]
    reference = []
    with torch.no_grad():
        for ids in prompts:
            out = loaded.model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
            reference.append(out[0, len(ids):].tolist())
    del loaded
    return {
        "needles": needles,
        "transformers": reference,
        "fullkv": _engines(model_dir, "cpu", [None], prompts)[0],
        **dict(zip(("wide", "narrow"), _engines(model_dir, "locks-cpu", [WIDE, SINK_AND_RECENT], prompts))),
    }


def test_fullkv_in_vllm_gives_the_transformers_greedy_tokens_and_answers_every_needle(runs):
    assert runs["fullkv"]["tokens"] == runs["transformers"]  # the same fp32 weights through two engines
    assert all(n.is_correct(text) for n, text in zip(runs["needles"], runs["fullkv"]["text"])), runs["fullkv"]["text"]
    assert runs["fullkv"]["counters"]["sparse_decode_rows"] == 0  # stock CPU_ATTN: no Locks row ran


def test_locks_with_room_for_the_needle_answers_as_fullkv_does(runs):
    wide, needles = runs["wide"], runs["needles"]
    assert [n.is_correct(t) for n, t in zip(needles, wide["text"])] == [True] * len(needles), wide["text"]
    counts = wide["counters"]
    # 3 global layers x 3 prompts x 9 decode steps ran the sparse path (96 pages > 32); sliding layers ran stock
    assert counts["sparse_decode_rows"] == 3 * len(needles) * (NEW_TOKENS - 1) and counts["dense_fallback_rows"] == 0
    assert counts["sliding_window_calls"] > 0 and counts["summaries_built"] >= 3 * len(needles) * (CONTEXT // 16)
    assert all(n.carrier_pages()[-1] < CONTEXT // 16 - 32 for n in needles)  # outside the sliding window


def test_locks_without_room_for_the_needle_loses_the_answers(runs):
    narrow = runs["narrow"]
    assert narrow["counters"]["sparse_decode_rows"] == runs["wide"]["counters"]["sparse_decode_rows"]
    assert not any(n.is_correct(t) for n, t in zip(runs["needles"], narrow["text"])), narrow["text"]


if __name__ == "__main__":
    model, arm, budgets, prompt_ids = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
    print("RESULT " + json.dumps(_generate(model, arm, budgets, prompt_ids)))
