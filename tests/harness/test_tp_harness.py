"""Tensor parallelism in the decode harness: the plan knob, rank sums, NVML on every GPU of the engine.

The GPU-only paths run here with stand-ins: a scripted session whose two "ranks" count separately
and fake NVML samples for two GPUs. The real vLLM CPU engine (TP = 1) checks that the rank RPC reads
the same counters as the in-process module, i.e. that vLLM 0.24 accepts the callable form.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from locks_toolkit.harness import guards as g
from locks_toolkit.harness import nvml, ranks, runner
from locks_toolkit.harness import session as session_module
from locks_toolkit.harness.bandwidth import FROM_PLAN
from locks_toolkit.harness.plan import load_plan
from locks_toolkit.harness.presets import ModelGeometry, load_preset_config
from locks_toolkit.harness.session import DecodeLog, PrefillLog
from locks_toolkit.harness.weights import weights_from_config
from locks_toolkit.harness.worker import EngineJob, run_job
from locks_toolkit.kernels.config import ConfigError
from locks_toolkit.locks_cli.main import app
from typer.testing import CliRunner

GLM = "glm-4-9b-chat-1m"  # 32 query heads, 4 KV heads


# -- plan and CLI ------------------------------------------------------------------------------------
def test_tp_must_divide_the_heads_of_the_model():
    assert load_plan(None, {"model": GLM, "tensor_parallel_size": 4}).tensor_parallel_size == 4
    with pytest.raises(ConfigError, match=r"does not divide the 4 KV heads .* use one of 1, 2, 4"):
        load_plan(None, {"model": GLM, "tensor_parallel_size": 8})  # divides 32 query heads, not 4 KV heads
    with pytest.raises(ConfigError, match="does not divide the 32 query heads"):
        load_plan(None, {"model": GLM, "tensor_parallel_size": 3})
    with pytest.raises(ConfigError, match="at least 1"):
        load_plan(None, {"model": GLM, "tensor_parallel_size": 0})
    with pytest.raises(ConfigError, match="2 KV heads"):  # tiny-llama: 4 query, 2 KV heads
        load_plan(None, {"model": "tiny-llama", "tensor_parallel_size": 4})


def test_cli_tp_reaches_the_cells_and_only_tp_cells_carry_it(tmp_path):
    args = ["bench", "decode", "--model", GLM, "--arms", "fa3,locks", "--contexts", "32k,64k", "--budget", "2048",
            "--layers", "40", "--out", str(tmp_path / "b.jsonl"), "--dry-run", "--json"]
    tp2 = json.loads(CliRunner().invoke(app, args + ["--tp", "2"]).stdout)["cells"]
    tp1 = json.loads(CliRunner().invoke(app, args).stdout)["cells"]
    assert len(tp2) == 4 and all(c["tensor_parallel_size"] == 2 for c in tp2)
    assert all("tensor_parallel_size" not in c for c in tp1)  # older stored cells keep their identity
    bad = CliRunner().invoke(app, args + ["--tensor-parallel-size", "3"])
    assert bad.exit_code != 0 and "does not divide" in bad.output


def test_async_scheduling_reaches_the_cells_and_only_async_cells_carry_it(tmp_path):
    args = ["bench", "decode", "--model", GLM, "--arms", "fa3,locks", "--contexts", "32k", "--budget", "2048",
            "--layers", "40", "--out", str(tmp_path / "b.jsonl"), "--dry-run", "--json"]
    on = json.loads(CliRunner().invoke(app, args + ["--async-scheduling"]).stdout)["cells"]
    off = json.loads(CliRunner().invoke(app, args + ["--sync-scheduling"]).stdout)["cells"]
    default = json.loads(CliRunner().invoke(app, args).stdout)["cells"]
    assert len(on) == 2 and all(c["async_scheduling"] is True for c in on)
    assert off == default and all("async_scheduling" not in c for c in default)  # stored cells keep their identity
    assert load_plan(None, {"async_scheduling": True}).async_scheduling is True
    with pytest.raises(ConfigError, match="async_scheduling = 'yes' is not a bool"):
        load_plan(None, {"async_scheduling": "yes"})


def test_preflight_refuses_more_ranks_than_visible_gpus(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    plan = load_plan(None, {"model": GLM, "arms": "fa3", "tensor_parallel_size": 2})
    with pytest.raises(runner.HarnessError, match="--tp 2 needs 2 GPUs and 1 are visible") as info:
        runner.preflight(plan)
    assert "--tp 1" in info.value.hint
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    runner.preflight(plan)


# -- sums over ranks ---------------------------------------------------------------------------------
def test_counters_sum_over_ranks_and_a_blind_rank_voids_the_sum():
    a = {"sparse_decode_rows": 40, "dense_fallback_rows": 0, "build_ms": 1.5}
    b = {"sparse_decode_rows": 40, "dense_fallback_rows": 3, "build_ms": 2.0}
    assert ranks.sum_counters([a, b]) == {"sparse_decode_rows": 80, "dense_fallback_rows": 3, "build_ms": 3.5}
    assert ranks.sum_counters([a]) == a
    assert ranks.sum_counters([a, None]) is None and ranks.sum_counters([]) is None


def test_weights_record_per_gpu_and_total():
    shard = [{"read_per_step": 900, "total": 1000, "parameters": 500, "tied_embeddings": False, "source": "engine"},
             {"read_per_step": 910, "total": 1010, "parameters": 505, "tied_embeddings": False, "source": "engine"}]
    combined = ranks.combine_weights(shard)
    assert (combined["read_per_step"], combined["total"], combined["parameters"]) == (1810, 2010, 1005)
    assert combined["per_gpu_read_per_step"] == 910 and combined["tensor_parallel_size"] == 2
    assert ranks.per_gpu_weights(combined, 2) == 910
    assert ranks.per_gpu_weights({"read_per_step": 1811}, 2) == 906  # config formula: even split, rounded up
    assert ranks.combine_weights([shard[0], None]) is None


# -- NVML on every GPU -------------------------------------------------------------------------------
def test_engine_devices_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert nvml.engine_devices(2) == [0, 1]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5, 3,1")
    assert nvml.engine_devices(2) == [5, 3] and nvml.engine_devices(1) == [5]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa,GPU-bbbb")
    assert nvml.engine_devices(2) == ["GPU-aaaa", "GPU-bbbb"]


def _fake_nvml(monkeypatch, throttled: set[str], sm_mhz: dict[str, int] | None = None):
    """NVML with GPUs named by CUDA_VISIBLE_DEVICES; `throttled` GPUs report HW slowdown."""
    def fake_sample(device=None):
        key = str(device)
        reasons = g.SW_POWER_CAP | (g.HW_SLOWDOWN if key in throttled else 0)
        return {"t": time.monotonic(), "reasons": reasons, "sm_mhz": (sm_mhz or {}).get(key, 1980),
                "mem_mhz": 3201, "temp_c": 50, "power_w": 600.0}

    def fake_info(device=None):
        return {"index": device, "name": "NVIDIA H200", "sm_clock_max_mhz": 1980}

    monkeypatch.setattr(nvml, "sample", fake_sample)
    monkeypatch.setattr(nvml, "gpu_info", fake_info)


def test_one_throttled_gpu_fails_the_window_and_is_named(monkeypatch):
    _fake_nvml(monkeypatch, throttled={"1"})
    with nvml.ThrottleSampler(interval_s=0.002, devices=[0, 1]) as sampler:
        time.sleep(0.02)
    assert set(sampler.by_device) == {"0", "1"} and all(len(s) >= 2 for s in sampler.by_device.values())
    assert sampler.samples is sampler.by_device["0"]
    result = g.check_throttle_devices(sampler.by_device, {"0": 1980, "1": 1980}, 0.25)
    assert result.rejects and result.reason.startswith("GPU 1: clock-event reasons hw_slowdown")
    assert result.detail["devices"]["0"]["status"] == g.PASS and result.detail["devices"]["1"]["status"] == g.FAIL
    assert g.check_throttle(sampler.samples, 1980, 0.25).status == g.PASS  # device 0 alone looks clean


def test_device_level_outcomes_combine():
    clean = [{"reasons": g.SW_POWER_CAP, "sm_mhz": 1980}] * 3
    sagged = [{"reasons": 0, "sm_mhz": 1100}] * 3
    assert g.check_throttle_devices({"0": clean, "1": clean}, {"0": 1980, "1": 1980}, 0.25).status == g.PASS
    blind = g.check_throttle_devices({"0": clean, "1": None}, {"0": 1980}, 0.25)
    assert blind.status == g.UNAVAILABLE and blind.reason.startswith("GPU 1:")
    sag = g.check_throttle_devices({"0": clean, "1": sagged}, {"0": 1980, "1": 1980}, 0.25)
    assert sag.rejects and "GPU 1: SM clock sagged to 1100" in sag.reason and sag.detail["sm_mhz_min"] == 1100
    single = g.check_throttle_devices({"0": sagged}, {"0": 1980}, 0.25)
    assert single == g.check_throttle(sagged, 1980, 0.25)  # one device: exactly the single-GPU guard
    assert g.check_throttle_devices(None, {}, 0.25).status == g.UNAVAILABLE


class TwoRankSession:
    """A scripted TP=2 engine: each rank counts its own sparse rows; read_counters sums them."""

    num_kv_blocks, block_size = 100_000, 16

    def __init__(self, plan, arm, model_dir, dummy, knobs, vocab_size, max_model_len=None):
        self.plan, self.boot_s, self.engine_kwargs = plan, 0.01, {"model": model_dir}
        self.rank_counts = [{"sparse_decode_rows": 0, "dense_fallback_rows": 0, "stock_decode_rows": 0}
                            for _ in range(plan.tensor_parallel_size)]

    def backend_in_use(self):
        return "CUSTOM"

    def rank_facts(self):
        return [{"rank": r, "num_q_heads": 16, "num_kv_heads": 2} for r in range(len(self.rank_counts))]

    def model_weights(self, tied):
        return None

    def read_counters(self):
        return ranks.sum_counters([dict(c) for c in self.rank_counts])

    def blocks_needed(self, batch, context):
        return 1

    def prefill(self, batch, context, tag):
        return PrefillLog([f"{tag}-{i}" for i in range(batch)], ttft_ms=10.0, step_ms=[10.0])

    def decode(self, request_ids, steps, on_step=None):
        log = DecodeLog()
        for index in range(steps):
            for counts in self.rank_counts:
                counts["sparse_decode_rows"] += len(request_ids)
            log.step_ms.append(2.0)
            log.step_tokens.append(len(request_ids))
            log.step_requests.append(len(request_ids))
            if on_step is not None and on_step(index):
                break
        return log

    def abort(self, request_ids):
        pass

    def close(self):
        self.closed = True


def _tp2_job(context=65536):
    plan = load_plan(None, {"model": GLM, "arms": "fa3,locks", "contexts": context, "batch_sizes": "1",
                            "windows": 2, "steps_per_window": 4, "ramp_min_steps": 2, "ramp_max_steps": 3,
                            "ttft_repeats": 2, "tensor_parallel_size": 2, "require_nvml": True,
                            "hbm_bytes_per_s": 3.0e12})  # pinned: no GPU here to measure
    config = load_preset_config(GLM)
    return EngineJob(plan, "locks", context, 2048, (1,), "/nowhere", True, ModelGeometry.from_config(config),
                     151552, True, weights=weights_from_config(config))


def test_tp2_job_samples_both_gpus_and_one_throttling_gpu_refuses_the_cell(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,7")
    monkeypatch.setattr(session_module, "EngineSession", TwoRankSession)
    _fake_nvml(monkeypatch, throttled={"7"})
    messages = []
    run_job(_tp2_job(), lambda message: message["type"] != "phase" and messages.append(message))
    engine, cell = messages[0]["info"], messages[1]
    assert set(engine["gpus_at_boot"]) == {"2", "7"} and engine["tensor_parallel_size"] == 2
    assert cell["status"] == "refused" and "no clean window" in cell["reason"]
    for window in cell["windows"]:
        assert not window["clean"] and "GPU 7: clock-event reasons hw_slowdown" in window["discard_reason"]
        assert set(window["nvml_samples_by_device"]) == {"2", "7"}
        assert window["throttle"]["devices"]["2"]["status"] == g.PASS
    # the deployed path is judged on the rank sum: 2 ranks x 4 steps x 1 request per window
    assert cell["path_check"]["counters"]["sparse_decode_rows"] == 2 * 2 * 4 and cell["guards"]["deployed"] == g.PASS


def test_tp2_job_with_clean_gpus_is_ok_and_floors_use_one_gpus_bytes(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(session_module, "EngineSession", TwoRankSession)
    _fake_nvml(monkeypatch, throttled=set())
    messages = []
    job = _tp2_job()
    run_job(job, lambda message: message["type"] != "phase" and messages.append(message))
    cell = messages[1]
    assert cell["status"] == "ok" and cell["guards"]["throttle"] == g.PASS, cell["reason"]
    traffic = cell["bytes_per_step"]
    assert traffic["tensor_parallel_size"] == 2 and traffic["per_gpu"]["attention"] * 2 == traffic["locks"]
    assert traffic["per_gpu"]["weights"] == -(-traffic["weights"] // 2)
    per_gpu = traffic["per_gpu"]["attention"] + traffic["per_gpu"]["weights"]
    assert cell["step_floor_ms"] == pytest.approx(per_gpu / 3.0e12 * 1e3)
    assert traffic["bandwidth_source"] == FROM_PLAN
    assert traffic["step_bytes"] == traffic["locks"] + traffic["weights"]  # totals stay totals


# -- the real vLLM CPU engine, TP = 1 ----------------------------------------------------------------
_ENGINE_SCRIPT = r"""
import json, os, sys
from locks_toolkit.harness.plan import load_plan
from locks_toolkit.harness.presets import build_config, materialize_model
from locks_toolkit.harness.worker import EngineJob, job_environment
from locks_toolkit.harness.presets import ModelGeometry
plan = load_plan(sys.argv[1], {"arms": "locks-cpu", "contexts": "300", "batch_sizes": "1", "budgets": "128"})
config, _ = build_config("tiny-llama", None, plan.effective_max_model_len)
model_dir = str(materialize_model(config))
job = EngineJob(plan, "locks-cpu", 300, 128, (1,), model_dir, True, ModelGeometry.from_config(config), 1024, False)
os.environ.update(job_environment(job))
from locks_toolkit.harness import ranks
from locks_toolkit.harness.session import EngineSession
from locks_toolkit.kernels.vllm_backend import counters
session = EngineSession(plan, "locks-cpu", model_dir, True, job.knobs, 1024)
before = session.read_counters()
pre = session.prefill(1, 300, "t")
session.decode(pre.request_ids, 3)
print("RESULT " + json.dumps({
    "before": before, "rpc": session.read_counters(), "local": counters.snapshot(),
    "per_rank": session.llm.collective_rpc(ranks.rank_counters, args=(session.arm.counters,)),
    "backend": session.backend_in_use(), "facts": session.rank_facts(),
    "weights": session.model_weights(False),
}))
"""


@pytest.mark.vllm
@pytest.mark.timeout(300)
def test_rank_rpc_reads_the_real_engine_at_tp1():
    from locks_toolkit.harness.plan import default_plan_path

    smoke = str(default_plan_path().parent / "smoke-cpu.yaml")
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = subprocess.run([sys.executable, "-c", _ENGINE_SCRIPT, smoke], capture_output=True, text=True,
                          timeout=280, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["rpc"] == result["local"]  # one rank, in this process: the RPC sees the module's counters
    assert len(result["per_rank"]) == 1 and result["per_rank"][0] == result["local"]
    # 300 tokens = 19 pages > 8-page budget: the 2 layers decode sparsely on every step after prefill
    assert result["rpc"]["sparse_decode_rows"] - result["before"]["sparse_decode_rows"] >= 2 * 3
    assert result["backend"] == "CPU_ATTN"  # the Locks CPU subclass keeps the enum name it overrides
    assert result["facts"] == [{"rank": 0, "local_rank": 0, "device": result["facts"][0]["device"],
                                "num_q_heads": 4, "num_kv_heads": 2}]
    weights = result["weights"]
    assert weights["tensor_parallel_size"] == 1 and weights["per_gpu_read_per_step"] == weights["read_per_step"] > 0


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_cli_tp2_on_the_cpu_engine_sums_the_locks_counters_of_both_ranks(tmp_path, monkeypatch):
    """Two CPU worker processes (vLLM's mp executor), one KV head each: the deployed-path counters of
    both ranks are summed (2 ranks x 2 layers per decode step), per-rank heads are half the model's."""
    from locks_toolkit.harness.plan import default_plan_path

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)  # the harness sets nobind for CPU TP
    smoke = str(default_plan_path().parent / "smoke-cpu.yaml")
    out = tmp_path / "tp2.jsonl"
    args = ["bench", "decode", smoke, "--arms", "locks-cpu", "--contexts", "256", "--batch", "1", "--budget", "128",
            "--tp", "2", "--windows", "1", "--steps", "4", "--ttft-repeats", "1", "--out", str(out), "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    (record,) = json.loads(result.stdout)
    assert record["status"] == "ok", record["reason"]
    assert record["cell"]["tensor_parallel_size"] == 2
    engine = record["engine"]
    assert engine["engine_kwargs"]["distributed_executor_backend"] == "mp"
    assert engine["env"]["NCCL_NVLS_ENABLE"] == "0" and engine["env"]["VLLM_ALLREDUCE_USE_SYMM_MEM"] == "0"
    assert [(r["rank"], r["num_q_heads"], r["num_kv_heads"]) for r in engine["ranks"]] == [(0, 2, 1), (1, 2, 1)]
    assert record["path_check"]["counters"]["sparse_decode_rows"] == 2 * 2 * 4
    assert record["bytes_per_step"]["per_gpu"]["attention"] * 2 == record["bytes_per_step"]["locks"]
