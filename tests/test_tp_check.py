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
from locks_toolkit.harness import tp_check as tc
from locks_toolkit.harness.tp_checkpoint import (
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


def test_qk_std_scales_only_the_query_and_key_projections():
    from locks_toolkit.harness.tp_checkpoint import CheckpointSpec, make_tensors

    base = CheckpointSpec(num_layers=1, hidden_size=64, num_q_heads=4, num_kv_heads=2, head_dim=16,
                          intermediate_size=32, vocab_size=50, dtype="float32")
    plain, peaked = make_tensors(base), make_tensors(replace(base, qk_std=0.2))
    for name in plain:
        ratio = float(peaked[name].float().std() / plain[name].float().std()) if plain[name].dim() > 1 else 1.0
        assert abs(ratio - (10.0 if name.endswith(("q_proj.weight", "k_proj.weight")) else 1.0)) < 1e-5, name
