"""End to end: the real vLLM 0.24 CPU engine with CPU_ATTN overridden by the Locks CPU subclass.

The engines run in one fresh subprocess (vLLM loads plugins once per process): first stock
CPU_ATTN, then the Locks override is registered the way the plugin does it with LOCKS_VLLM_CPU=1,
and vLLM's per-process backend selection cache is cleared between engines. A tiny Llama with random weights saved as a checkpoint is used: vLLM's
dummy weights are so small that attention barely moves the logits (near-uniform outputs), which
would let a broken backend pass.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

PROMPT_LENS = (37, 130, 300)  # pages: 3, 9, 19 (partial last pages)
MAX_TOKENS = 24
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "num_hidden_layers": 2,
    "vocab_size": 512, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
}


def _write_checkpoint(model_dir: Path) -> None:
    """Random weights saved as safetensors; q/k projections scaled up so attention is sharp."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "architectures"}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                gain = 6.0 if ("q_proj" in name or "k_proj" in name) else 1.0
                param.normal_(0.0, gain / param.shape[-1] ** 0.5)
            if "embed_tokens" in name:
                param.normal_(0.0, 1.0)
    model.save_pretrained(model_dir, safe_serialization=True)


# One per-request engine (engine budget 4096) serves these settings side by side, each over every prompt.
PER_REQUEST = ({"scorer": "dense"}, {"scorer": "locks", "budget": 32}, None)
# The crossover engine (budget 32) runs a step dense while its rows hold at most CROSSOVER_PAGES pages in all:
# the prompts' 31 pages grow to 35 over the decode, so the first steps run dense and the later ones sparse.
CROSSOVER_PAGES = 32
KV_PAGE_BYTES = TINY_LLAMA["num_key_value_heads"] * 2 * 16 * TINY_LLAMA["head_dim"] * 4  # K+V, every KV head, fp32
CROSSOVER = {"budget": 32, "crossover": CROSSOVER_PAGES * KV_PAGE_BYTES / 2**20}


def _run_engine(model_dir: str, budgets: list[int | str | dict | None]) -> dict:
    """In this (sub)process: one engine per budget (None = stock CPU_ATTN, "per-request" = one Locks engine
    serving PER_REQUEST's settings with prefix caching, a dict = those Locks settings); greedy tokens + counters."""
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", TORCHDYNAMO_DISABLE="1")
    import torch
    from locks_toolkit.kernels.vllm_backend import counters, plugin
    from vllm import LLM, SamplingParams
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import _cached_get_attn_backend

    generator = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 500, (n,), generator=generator).tolist()} for n in PROMPT_LENS]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False)
    from locks_toolkit.kernels.vllm_backend.settings import REQUEST_SETTINGS_PROCESSOR

    results = []
    for budget in budgets:
        per_request = budget == "per-request"
        locks = budget if isinstance(budget, dict) else {"budget": 4096 if per_request else budget}
        extra = {} if budget is None else {"additional_config": {"locks": locks}}
        if per_request:
            extra["logits_processors"] = [REQUEST_SETTINGS_PROCESSOR]
        if budget is None:
            os.environ.pop(plugin.CPU_OPT_IN_ENV, None)
            AttentionBackendEnum.CPU_ATTN.clear_override()
        else:
            os.environ[plugin.CPU_OPT_IN_ENV] = "1"
            plugin.register()
        _cached_get_attn_backend.cache_clear()  # selection is cached per process, not per engine
        llm = LLM(
            model_dir, skip_tokenizer_init=True, enforce_eager=True, block_size=16,
            max_num_batched_tokens=2048, max_num_seqs=16, max_model_len=1024, dtype="float32", seed=0,
            enable_prefix_caching=per_request, **extra,
        )
        counters.reset()
        if per_request:  # every setting over every prompt, in one batch, so rows of all settings share steps
            settings = [p.clone() for p in [params] * len(PER_REQUEST)]
            for setting, sampling in zip(PER_REQUEST, settings):
                sampling.extra_args = None if setting is None else {"locks": setting}
            outputs = llm.generate(prompts * len(PER_REQUEST), [s for s in settings for _ in prompts], use_tqdm=False)
            tokens = [list(o.outputs[0].token_ids) for o in outputs]
            by_setting = [tokens[i * len(prompts):(i + 1) * len(prompts)] for i in range(len(PER_REQUEST))]
            results.append({"tokens": by_setting, "counters": counters.snapshot()})
            try:
                llm.generate(prompts[:1], SamplingParams(max_tokens=2, extra_args={"locks": {"scorer": "exact"}}))
            except ValueError as error:
                results[-1]["bad_setting_error"] = str(error)
        else:
            outputs = llm.generate(prompts, params, use_tqdm=False)
            results.append({"tokens": [list(o.outputs[0].token_ids) for o in outputs], "counters": counters.snapshot()})
        del llm
    return {"runs": results}


def _engine_subprocess(tmp_path: Path, budgets: list[int | None]) -> tuple[dict, str]:
    model_dir = tmp_path / "tiny-llama"
    if not (model_dir / "config.json").exists():
        _write_checkpoint(model_dir)
    env = {k: v for k, v in os.environ.items() if k != "LOCKS_VLLM_CPU"}
    proc = subprocess.run(
        [sys.executable, __file__, str(model_dir), json.dumps(budgets)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result_line = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")][-1]
    return json.loads(result_line[len("RESULT "):]), proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine")
    result, log = _engine_subprocess(tmp, [None, 4096, 32, "per-request", CROSSOVER])
    stock, dense, sparse, per_request, crossover = result["runs"]
    assert stock["counters"]["prefill_rows"] == 0  # the stock engine really ran without Locks
    return stock, dense, sparse, log, per_request, crossover


def test_locks_banner_and_counters_show_the_locks_decode_path(engine_runs):
    _, dense_run, sparse_run, log, _, _ = engine_runs
    assert "Locks attention backend ACTIVE (cpu/CPU_ATTN" in log and "budget=4096" in log
    layers, decode_rows = TINY_LLAMA["num_hidden_layers"], len(PROMPT_LENS) * (MAX_TOKENS - 1)
    dense_counts, sparse_counts = dense_run["counters"], sparse_run["counters"]
    # budget 4096 >= every context: all decode rows take the Locks path with every page selected.
    assert dense_counts["dense_fallback_rows"] == layers * decode_rows and dense_counts["sparse_decode_rows"] == 0
    # budget 32 (sink + recent page): every prompt here has more pages, so every row is sparse.
    assert sparse_counts["sparse_decode_rows"] > 0 and sparse_counts["stock_decode_rows"] == 0
    assert sparse_counts["stock_layer_calls"] == 0
    assert sparse_counts["sparse_decode_rows"] + sparse_counts["dense_fallback_rows"] == layers * decode_rows
    # Every page that completes is summarized once per layer (prefill pages + decode-time pages).
    final_lens = [n + MAX_TOKENS - 1 for n in PROMPT_LENS]
    assert dense_counts["summaries_built"] == layers * sum(n // 16 for n in final_lens)


def test_locks_with_budget_covering_the_context_matches_stock_cpu_attention(engine_runs):
    stock_run, dense_run, sparse_run, _, _, _ = engine_runs
    assert dense_run["tokens"] == stock_run["tokens"]
    # The comparison can fail: a 2-page budget changes some greedy tokens of the long prompts.
    assert sparse_run["tokens"] != stock_run["tokens"]


def test_one_per_request_engine_gives_each_setting_the_tokens_of_its_own_engine(engine_runs):
    stock_run, dense_run, sparse_run, log, per_request, _ = engine_runs
    exact, locks_32, engine_default = per_request["tokens"]
    assert exact == stock_run["tokens"]  # {"scorer": "dense"}: exact attention, as stock CPU_ATTN
    assert locks_32 == sparse_run["tokens"]  # {"scorer": "locks", "budget": 32}: as an engine with budget 32
    assert engine_default == dense_run["tokens"]  # no setting: the engine's budget (4096)
    counts = per_request["counters"]
    layers, decode_rows = TINY_LLAMA["num_hidden_layers"], len(PROMPT_LENS) * (MAX_TOKENS - 1)
    assert counts["full_kv_rows"] == layers * decode_rows
    assert counts["sparse_decode_rows"] == sparse_run["counters"]["sparse_decode_rows"]
    assert "per-request selection" in log


def test_the_crossover_runs_the_short_steps_dense_and_counts_them_apart_from_fallbacks(engine_runs):
    stock_run, _, _, log, _, crossover = engine_runs
    layers, rows = TINY_LLAMA["num_hidden_layers"], len(PROMPT_LENS)
    # decode step t (1..MAX_TOKENS-1) attends over prompt + t tokens in every row
    step_pages = [sum(-(-(n + t) // 16) for n in PROMPT_LENS) for t in range(1, MAX_TOKENS)]
    dense_steps = sum(pages <= CROSSOVER_PAGES for pages in step_pages)
    assert 0 < dense_steps < MAX_TOKENS - 1  # the rule must pick both ways here, or the test says nothing
    counts = crossover["counters"]
    assert counts["crossover_dense_rows"] == layers * rows * dense_steps
    assert counts["sparse_decode_rows"] == layers * rows * (MAX_TOKENS - 1 - dense_steps)
    assert counts["dense_fallback_rows"] == 0 and counts["stock_decode_rows"] == 0
    # tokens made by the dense steps are stock attention's; the sparse steps after them take the budget's
    first_sparse = 1 + dense_steps  # the prefill's token, then one token a dense step
    assert [t[:first_sparse] for t in crossover["tokens"]] == [t[:first_sparse] for t in stock_run["tokens"]]
    assert f"crossover={CROSSOVER['crossover']:g}MiB" in log


def test_a_bad_per_request_setting_is_refused_with_the_allowed_scorers(engine_runs):
    message = engine_runs[4]["bad_setting_error"]
    assert "'exact' unknown" in message and "dense, locks, oracle" in message


if __name__ == "__main__":
    print("RESULT " + json.dumps(_run_engine(sys.argv[1], json.loads(sys.argv[2]))), flush=True)
