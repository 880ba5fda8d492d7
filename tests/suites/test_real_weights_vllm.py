"""Gemma-3-270M's real weights in the real vLLM 0.24 CPU engine with the Locks backend, on needle prompts.

One engine of the eval path (`suites.engine_vllm.VllmEngine`: per-request selection, prefix caching) serves
three settings over the same prompts: FullKV (`{"scorer": "dense"}`) must give the transformers engine's
greedy tokens and answer every needle; Locks with a budget that can hold the needle's pages must give
FullKV's answers; Locks with only the sink and the recent page (the needle's pages cannot be selected) must
lose them, so the test can fail both ways. Gemma-3's sliding-window layers run stock (counted); its 3 global
layers (d = 256, G = 4, one KV head) run the Locks path. The needle sits > 1000 tokens before the question,
outside the 512-token sliding window, so only the global layers can read it. The engine runs in a fresh
subprocess (vLLM loads plugins once per process), in-process there so that the backend's counters are read.
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


def _generate(model_dir: str, prompts: list[list[int]]) -> dict:
    """In this (fresh) process: one per-request engine; greedy tokens and text of every (setting, prompt) and
    the Locks counters of the whole run."""
    from types import SimpleNamespace

    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0")
    from locks_toolkit.kernels.vllm_backend import counters
    from locks_toolkit.suites.arms import parse_arm
    from locks_toolkit.suites.engine_hf import StopRule
    from locks_toolkit.suites.engine_vllm import VllmEngine
    from locks_toolkit.suites.eval_runner import Request

    engine = VllmEngine(model_dir, device="cpu")
    settings = {"fullkv": Request(parse_arm("fullkv"), None), "wide": Request(parse_arm("locks:r8i4"), WIDE),
                "narrow": Request(parse_arm("locks:r8i4"), SINK_AND_RECENT)}  # fmt: skip
    instances = [SimpleNamespace(instance_id=str(n), prompt="", token_ids=ids) for n, ids in enumerate(prompts)]
    counters.reset()
    results: dict = {name: {"tokens": [None] * len(prompts), "text": [None] * len(prompts)} for name in settings}
    names = {request: name for name, request in settings.items()}
    pending = {i.instance_id: list(settings.values()) for i in instances}
    for instance, request, generation, _ in engine.run(instances, pending, StopRule(NEW_TOKENS, newline=False)):
        row = int(instance.instance_id)
        results[names[request]]["tokens"][row] = generation.token_ids
        results[names[request]]["text"][row] = generation.text
    results["counters"] = counters.snapshot()
    # The engine sends token ids (never text) to vLLM: they must be what vLLM's own tokenizer makes of the text.
    llm_tokenizer = engine._llm[2].get_tokenizer()
    texts = [engine.tokenizer.decode(ids[1:]) for ids in prompts]  # without the BOS the encoders add
    results["same_ids"] = [llm_tokenizer.encode(t) == engine.tokenizer.encode(t) for t in texts]
    results["bos_added"] = [engine.tokenizer.encode(t)[0] == ids[0] for t, ids in zip(texts, prompts)]
    return results


def _engine(model_dir, prompts) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "LOCKS_VLLM_CPU"}
    proc = subprocess.run([sys.executable, __file__, model_dir, json.dumps(prompts)],
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
        **_engine(model_dir, prompts),
    }


def test_fullkv_in_vllm_gives_the_transformers_greedy_tokens_and_answers_every_needle(runs):
    assert runs["fullkv"]["tokens"] == runs["transformers"]  # the same fp32 weights through two engines
    assert all(n.is_correct(text) for n, text in zip(runs["needles"], runs["fullkv"]["text"])), runs["fullkv"]["text"]


def test_locks_with_room_for_the_needle_answers_as_fullkv_does(runs):
    wide, needles = runs["wide"], runs["needles"]
    assert [n.is_correct(t) for n, t in zip(needles, wide["text"])] == [True] * len(needles), wide["text"]
    assert all(n.carrier_pages()[-1] < CONTEXT // 16 - 32 for n in needles)  # outside the sliding window


def test_locks_without_room_for_the_needle_loses_the_answers(runs):
    narrow = runs["narrow"]
    assert not any(n.is_correct(t) for n, t in zip(runs["needles"], narrow["text"])), narrow["text"]


def test_the_engine_tokenizer_gives_the_ids_vllm_would_make_of_the_text(runs):
    assert runs["same_ids"] == [True] * len(runs["needles"]) and all(runs["bos_added"])


def test_each_setting_ran_its_own_path_in_the_one_engine(runs):
    counts, rows = runs["counters"], 3 * len(runs["needles"]) * (NEW_TOKENS - 1)  # global layers x prompts x steps
    # FullKV's rows ran exact attention; both Locks budgets ran sparse (96 pages > 32 > 2); sliding layers ran stock
    assert counts["full_kv_rows"] == rows and counts["sparse_decode_rows"] == 2 * rows
    assert counts["dense_fallback_rows"] == 0 and counts["sliding_window_calls"] > 0
    # every prompt was prefilled once for the three settings: a page is summarized at most once per global
    # layer (pages the prompts share are cached and summarized once for all of them)
    pages = 3 * len(runs["needles"]) * (CONTEXT // 16)
    assert 3 * (CONTEXT // 16) <= counts["summaries_built"] <= pages


if __name__ == "__main__":
    model, prompt_ids = sys.argv[1], json.loads(sys.argv[2])
    print("RESULT " + json.dumps(_generate(model, prompt_ids)))
