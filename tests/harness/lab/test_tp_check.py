"""The TP consistency check: the seeded checkpoint, the comparison logic, and the whole check on CPU.

On the CPU the four engines are vLLM's CPU engine (dense CPU_ATTN and the Locks CPU override) at
TP=1 and TP=2 (two CPU worker processes) on a tiny checkpoint in float32.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
from locks_toolkit.harness.lab import tp_check as tc
from locks_toolkit.harness.lab.tp_checkpoint import (
    CheckpointSpec,
    make_tensors,
    write_checkpoint,
)
from locks_toolkit.kernels.config import ConfigError

TINY = CheckpointSpec(num_layers=2, hidden_size=128, num_q_heads=4, num_kv_heads=2, head_dim=32,
                      intermediate_size=96, vocab_size=509, max_position_embeddings=2048, std=0.02, seed=7,
                      dtype="float32")


def test_checkpoint_is_seeded_and_shaped_like_hf_llama(tmp_path):
    from safetensors.torch import load_file

    folder = write_checkpoint(TINY, tmp_path / "a")
    tensors = load_file(str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    assert config["num_attention_heads"] == 4 and config["num_key_value_heads"] == 2 and config["head_dim"] == 32
    assert tensors["model.layers.1.self_attn.k_proj.weight"].shape == (2 * 32, 128)
    assert tensors["model.layers.0.self_attn.o_proj.weight"].shape == (128, 4 * 32)
    assert tensors["lm_head.weight"].shape == (509, 128) and set(tensors) == set(TINY.tensor_shapes())
    assert torch.equal(tensors["model.norm.weight"], torch.ones(128))
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    assert abs(q.std().item() - 0.02) < 0.002 and abs(q.mean().item()) < 0.002
    again = make_tensors(TINY)
    assert all(torch.equal(again[name], tensors[name]) for name in tensors)  # same seed, same weights
    other = make_tensors(CheckpointSpec(**{**TINY.__dict__, "seed": 8}))
    assert not torch.equal(other["lm_head.weight"], tensors["lm_head.weight"])
    # the HF model built from the config accepts the tensors as they are
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"}))
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and all("rotary" in name for name in missing)


def test_bf16_checkpoint_keeps_the_seeded_values():
    spec = CheckpointSpec(**{**TINY.__dict__, "dtype": "bfloat16"})
    bf16, fp32 = make_tensors(spec), make_tensors(TINY)
    name = "model.layers.1.mlp.down_proj.weight"
    assert bf16[name].dtype == torch.bfloat16 and torch.equal(bf16[name], fp32[name].to(torch.bfloat16))


def test_config_rejects_what_cannot_be_compared():
    with pytest.raises(ConfigError, match="does not divide"):
        tc.TPCheckConfig(tensor_parallel_size=8)  # 4 KV heads
    with pytest.raises(ConfigError, match="below the context"):
        tc.TPCheckConfig(context=2048, budget=2048)
    with pytest.raises(ConfigError, match="dense and a sparse arm"):
        tc.TPCheckConfig(dense_arm="locks", sparse_arm="fa3")
    with pytest.raises(ConfigError, match="compares TP>=2"):
        tc.TPCheckConfig(tensor_parallel_size=1)
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        tc.TPCheckConfig(context=70000)


def _run(tokens, logprobs):
    return {"tokens": tokens, "logprobs": [{str(t): lp for t, lp in step.items()} for step in logprobs]}


def test_compare_stops_at_the_first_divergence_and_reads_the_reference_token():
    ref = _run([5, 6, 7, 8], [{5: -0.1, 9: -2.0}, {6: -0.2}, {7: -0.5, 3: -1.0}, {8: -0.3}])
    same = tc.compare_runs(ref, ref)
    assert same["first_divergence"] is None and same["agreement"] == 1.0 and same["max_abs_dlogprob"] == 0.0
    # step 2 diverges: compared through step 2 with the reference token 7 looked up in the other's top-k
    other = _run([5, 6, 3, 8], [{5: -0.12, 9: -2.0}, {6: -0.2}, {3: -0.6, 7: -0.75}, {8: -0.3}])
    cmp = tc.compare_runs(ref, other)
    assert cmp["first_divergence"] == 2 and cmp["compared_steps"] == 3 and cmp["agreeing_steps"] == 3
    assert cmp["abs_dlogprob"] == pytest.approx([0.02, 0.0, 0.25]) and cmp["max_abs_dlogprob"] == pytest.approx(0.25)
    gone = _run([5, 4, 7, 8], [{5: -0.1}, {4: -0.1, 1: -0.2}, {7: -0.5}, {8: -0.3}])  # token 6 left the top-k
    lost = tc.compare_runs(ref, gone)
    assert math.isinf(lost["max_abs_dlogprob"]) and lost["reference_token_lost"] == [1]


def test_judge_passes_within_dense_noise_plus_tolerance_and_needs_the_sparse_path():
    runs = [{"arm": "locks", "tensor_parallel_size": tp, "counters": {"sparse_decode_rows": 64, "dense_fallback_rows": 0}}
            for tp in (1, 2)]
    dense = {"max_abs_dlogprob": 0.05, "first_divergence": None, "steps": 32}
    ok = {"max_abs_dlogprob": 0.12, "first_divergence": None, "steps": 32}
    bad = {"max_abs_dlogprob": 0.4, "first_divergence": 3, "steps": 32}
    assert tc.judge(ok, dense, 0.1, runs)[0]
    passed, why = tc.judge(bad, dense, 0.1, runs)
    assert not passed and why.startswith("FAIL") and "0.4" in why
    fallback = [runs[0], {**runs[1], "counters": {"sparse_decode_rows": 64, "dense_fallback_rows": 2}}]
    assert not tc.judge(ok, dense, 0.1, fallback)[0]
    assert "unverified" in tc.judge(ok, dense, 0.1, [{**runs[0], "counters": None}])[1]


def _capture_runs(generator, tp_heads, context=1000, steps=5, tokens=(4, 5, 6, 7, 8, 9), other_tokens=None,
                  group=2, num_kv_heads=4, k=6, d=3):
    """A TP=1 run and a TP=N run whose rank r holds KV heads tp_heads[r] (the right split: r*H/N ...)."""
    num_pages = -(-(context + steps) // 16)
    per_step = []
    for step in range(steps):
        seq_len = context + step + 1
        selected = [sorted({0, num_pages - 1} | set(generator.sample(range(1, num_pages - 1), k - 2)))
                    for _ in range(num_kv_heads)]
        q = [[generator.uniform(-2, 2) for _ in range(d)] for _ in range(num_kv_heads * group)]
        per_step.append((seq_len, selected, q))

    def rank_result(rank, heads):
        steps_ = [{"index": i, "seq_lens": [n], "selected": [[sel[h] for h in heads]],
                   "q": [[q[h * group + g] for h in heads for g in range(group)]]} for i, (n, sel, q) in enumerate(per_step)]
        return {"rank": rank, "pass": True, "max_abs_error": 1e-3, "steps": steps_}

    def run(tp, heads_per_rank, toks):
        return {"arm": "locks", "tensor_parallel_size": tp, "tokens": list(toks),
                "ranks": [{"rank": r, "num_kv_heads": len(h)} for r, h in enumerate(heads_per_rank)],
                "captures": [rank_result(r, h) for r, h in enumerate(heads_per_rank)]}

    return run(1, [list(range(num_kv_heads))], tokens), run(len(tp_heads), tp_heads, other_tokens or tokens)


def test_capture_comparison_lines_up_rank_heads_and_fails_when_two_ranks_swap():
    import random

    from locks_toolkit.harness.lab import tp_captures

    counters = {"sparse_decode_rows": 10, "dense_fallback_rows": 0}
    ref, other = _capture_runs(random.Random(1), [[0, 1], [2, 3]])
    cross = tp_captures.compare_captures(ref, other, context=1000)
    assert cross["compared_steps"] == [0, 1, 2, 3, 4] and cross["selections"] == 20
    assert cross["mean_page_overlap"] == 1.0 and cross["identical_fraction"] == 1.0 and cross["max_abs_dq"] == 0.0
    runs = [{**ref, "counters": counters}, {**other, "counters": counters}]
    captures = {"locks/tp1": ref["captures"], "locks/tp2": other["captures"]}
    assert tc.judge_captures(runs, captures, cross, 0.95)[0]
    # collective_rpc order does not matter: ranks are ordered by their rank field
    shuffled = {**other, "captures": other["captures"][::-1]}
    assert tp_captures.compare_captures(ref, shuffled, context=1000)["mean_page_overlap"] == 1.0
    # rank 0 holding heads 2,3 and rank 1 heads 0,1: the selections part, the check fails
    _, swapped = _capture_runs(random.Random(1), [[2, 3], [0, 1]])
    bad = tp_captures.compare_captures(ref, swapped, context=1000)
    assert bad["mean_page_overlap"] < 0.8 and bad["identical_fraction"] == 0.0 and bad["max_abs_dq"] > 0.1
    passed, why = tc.judge_captures(runs, captures, bad, 0.95)
    assert not passed and "overlap" in why
    # a warm-up batch captured before the request (seq_len 3, below the prompt) is never compared
    warm = json.loads(json.dumps(other))
    for result in warm["captures"]:
        result["steps"].insert(0, {"index": -1, "seq_lens": [3], "selected": [[[0]] * 2], "q": result["steps"][0]["q"]})
    warm_ref = json.loads(json.dumps(ref))
    warm_ref["captures"][0]["steps"].insert(0, {"index": -1, "seq_lens": [3], "selected": [[[0]] * 4],
                                                "q": warm_ref["captures"][0]["steps"][0]["q"]})
    assert tp_captures.compare_captures(warm_ref, warm, context=1000)["compared_steps"] == [0, 1, 2, 3, 4]
    # one page flipped in one (step, head) selection: 5/6 there, mean just below 1
    flipped = json.loads(json.dumps(other))
    pages = flipped["captures"][1]["steps"][2]["selected"][0][0]
    pages[1] = next(p for p in range(1, 60) if p not in pages)
    near = tp_captures.compare_captures(ref, flipped, context=1000)
    assert near["identical_fraction"] == pytest.approx(19 / 20) and near["mean_page_overlap"] == pytest.approx(1 - 1 / 120)
    assert near["min_page_overlap"] == pytest.approx(5 / 6) and tc.judge_captures(runs, captures, near, 0.95)[0]


def test_capture_comparison_reads_only_shared_prefix_steps_and_needs_every_rank_to_pass():
    import random

    from locks_toolkit.harness.lab import tp_captures

    # tokens part at index 2: decode steps 0 and 1 read tokens 0..1 only; steps 2.. are not comparable
    ref, other = _capture_runs(random.Random(2), [[0, 1], [2, 3]], other_tokens=(4, 5, 1, 1, 1, 1))
    for step in other["captures"][0]["steps"][2:]:
        step["selected"] = [[[0, 1, 2, 3, 4, 5]] * 2]
    cross = tp_captures.compare_captures(ref, other, context=1000)
    assert cross["compared_steps"] == [0, 1] and cross["mean_page_overlap"] == 1.0 and cross["shared_prefix_tokens"] == 2
    counters = {"sparse_decode_rows": 10, "dense_fallback_rows": 0}
    runs = [{**ref, "counters": counters}, {**other, "counters": counters}]
    failing = [other["captures"][0], {**other["captures"][1], "pass": False, "faults": ["sink page 0 missing"]}]
    passed, why = tc.judge_captures(runs, {"locks/tp1": ref["captures"], "locks/tp2": failing}, cross, 0.95)
    assert not passed and "locks/tp2 rank 1" in why and "sink" in why
    # no shared step at all (the prefill token differs): nothing decides, so it fails
    _, apart = _capture_runs(random.Random(2), [[0, 1], [2, 3]], other_tokens=(9, 9, 9, 9, 9, 9))
    none = tp_captures.compare_captures(ref, apart, context=1000)
    assert none["compared_steps"] == [] and not tc.judge_captures(runs, {"x": ref["captures"]}, none, 0.95)[0]
    # rank facts that disagree with the captured heads void the comparison
    wrong_facts = {**other, "ranks": [{"rank": 0, "num_kv_heads": 1}, {"rank": 1, "num_kv_heads": 1}]}
    assert "KV heads" in tp_captures.compare_captures(ref, wrong_facts, context=1000)["error"]
    # the stored record drops the queries
    assert all("q" not in s and "selected" in s for r in tp_captures.without_queries(other["captures"]) for s in r["steps"])


def test_capture_config_and_cli_parsing():
    assert tc.parse_capture_layers("0,2") == (0, 2) and tc.parse_capture_layers("none") == () == tc.parse_capture_layers("")
    with pytest.raises(ConfigError, match="comma-separated"):
        tc.parse_capture_layers("0;1")
    with pytest.raises(ConfigError, match="must include 0"):
        tc.TPCheckConfig(capture_layers=(1,))
    with pytest.raises(ConfigError, match="lie in 0..3"):
        tc.TPCheckConfig(capture_layers=(0, 4))
    with pytest.raises(ConfigError, match="records no captures"):
        tc.TPCheckConfig(sparse_arm="locks-kv")
    assert tc.TPCheckConfig(sparse_arm="locks-kv", capture_layers=()).capture_layers == ()
    config = tc.TPCheckConfig(capture_layers=(0, 2))
    assert tc._config_from_dict(json.loads(json.dumps(tc._config_dict(config)))) == config


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_whole_check_on_the_cpu_engines_tp1_vs_tp2(tmp_path):
    config = tc.TPCheckConfig(tensor_parallel_size=2, dense_arm="cpu", sparse_arm="locks-cpu", context=520,
                              steps=6, budget=128, logprobs=3, graph_mode="eager", checkpoint=TINY)
    out = tmp_path / "tp-check.jsonl"
    record = tc.run_tp_check(config, out, engine_timeout_s=280)
    assert record["status"] == "ok", record["reason"] + json.dumps(record["runs"])[:3000]
    for key in ("locks-cpu/tp1", "locks-cpu/tp2", "cpu/tp1", "cpu/tp2"):
        assert len(record["runs"][key]["tokens"]) == 6
    facts = record["runs"]["locks-cpu/tp2"]["ranks"]
    assert [(f["rank"], f["num_kv_heads"]) for f in facts] == [(0, 1), (1, 1)]
    # float32 on one CPU: TP only reorders sums, so both arms match their TP=1 runs closely
    assert record["comparisons"]["locks-cpu"]["max_abs_dlogprob"] < 1e-3
    assert json.loads(out.read_text().splitlines()[-1])["passed"] is True
    # captures (default: layer 0, eager sparse engines): every rank of both runs checked and passing
    assert record["decided_by"] == "captures" and record["runs"]["locks-cpu/tp2"]["graph_mode"] == "eager"
    assert record["runs"]["locks-cpu/tp2"]["warmup_captures_dropped"] == [0, 0]  # the CPU engine warms up no decode
    assert record["runs"]["cpu/tp2"]["graph_mode"] == "eager"  # the dense arm keeps the config's mode
    for key, ranks in (("locks-cpu/tp1", [0]), ("locks-cpu/tp2", [0, 1])):
        results = record["captures"][key]
        assert [r["rank"] for r in results] == ranks and all(r["pass"] for r in results), results
        assert all(r["captures"] == 5 and r["max_abs_error"] < 1e-5 for r in results)  # 5 decode steps of layer 0
        assert all(len(s["selected"][0]) == 2 // len(ranks) and "q" not in s for r in results for s in r["steps"])
    cross = record["capture_comparison"]
    assert cross["compared_steps"] == [0, 1, 2, 3, 4] and cross["selections"] == 10
    assert cross["mean_page_overlap"] == 1.0 and cross["identical_fraction"] == 1.0 and cross["max_abs_dq"] < 1e-4


def test_qk_std_scales_only_the_query_and_key_projections():
    from locks_toolkit.harness.lab.tp_checkpoint import CheckpointSpec, make_tensors

    base = CheckpointSpec(num_layers=1, hidden_size=64, num_q_heads=4, num_kv_heads=2, head_dim=16,
                          intermediate_size=32, vocab_size=50, dtype="float32")
    plain, peaked = make_tensors(base), make_tensors(replace(base, qk_std=0.2))
    for name in plain:
        ratio = float(peaked[name].float().std() / plain[name].float().std()) if plain[name].dim() > 1 else 1.0
        assert abs(ratio - (10.0 if name.endswith(("q_proj.weight", "k_proj.weight")) else 1.0)) < 1e-5, name
