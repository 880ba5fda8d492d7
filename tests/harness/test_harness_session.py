"""End to end against the real vLLM 0.24 engine on the CPU (tiny dummy-weight Llama, CPU_ATTN).

The CLI path runs the engine in a spawned process exactly as on the GPU; a rerun must resume from
the stored records without booting an engine. The lockstep guard is shown firing on a step log
recorded from the real engine while the batch shrinks.
"""

import json

import pytest
from locks_toolkit.harness import guards, runner
from locks_toolkit.harness.plan import default_plan_path, load_plan
from locks_toolkit.harness.presets import ModelGeometry, build_config
from locks_toolkit.harness.store import read_records
from locks_toolkit.locks_cli.main import app
from typer.testing import CliRunner

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

SMOKE = str(default_plan_path().parent / "smoke-cpu.yaml")


def test_cli_runs_the_cpu_engine_then_resumes(tmp_path, monkeypatch):
    out = tmp_path / "bench.jsonl"
    args = ["bench", "decode", SMOKE, "--contexts", "256", "--batch", "1,2", "--out", str(out), "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    records = json.loads(result.stdout)
    # the live view's first line: cells done of the total, the cell and phase now, elapsed, time left
    assert "2/2 cells | cpu @ 256 tokens: window (batch 2, 2 of 2)" in result.stderr and "left" in result.stderr
    # vLLM's own logs went to the engine's log file, which the records name
    log_file = records[0]["engine_log"]
    assert log_file == records[1]["engine_log"] and log_file.startswith(str(out) + ".run/engines/")
    assert "Initializing a V1 LLM engine (v0.24.0)" in open(log_file).read()
    assert [(r["cell"]["batch_size"], r["status"]) for r in records] == [(1, "ok"), (2, "ok")], records
    plan = load_plan(SMOKE)
    for record in records:
        batch = record["cell"]["batch_size"]
        assert record["schema"] == "locks.bench.decode/2" and record["cell"]["workload"] == f"{batch}q1s256"
        assert record["sparse"] is False  # the cpu arm reads every page
        assert len(record["windows"]) == plan.windows
        for window in record["windows"]:
            assert len(window["step_ms"]) == plan.steps_per_window
            assert window["step_tokens"] == [batch] * plan.steps_per_window  # counted from engine outputs
            assert window["lockstep_ok"] and window["clean"]
            assert window["throttle"]["available"] is False  # no NVML here: recorded, not passed
        assert record["guards"]["throttle"] == "unavailable" and record["guards"]["lockstep"] == "pass"
        assert record["tpot_ms"]["n"] == plan.windows * plan.steps_per_window
        assert record["tpot_ms"]["mean"] > 0 and record["tpot_ms"]["p99"] >= record["tpot_ms"]["p50"]
        assert record["engine"]["backend_in_use"] == "CPU_ATTN"
        assert record["engine"]["engine_kwargs"]["enable_prefix_caching"] is False
        assert record["engine"]["env"]["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
        assert record["engine"]["warmup"]["ramp_steps"] == plan.ramp_min_steps
        assert record["cell"]["dummy_weights"] is True
        assert record["provenance"]["versions"]["vllm"].startswith("0.24")
        live = 256 + plan.settle_steps + plan.windows * plan.steps_per_window // 2
        geometry = ModelGeometry.from_config(build_config("tiny-llama", None, 1024)[0])
        assert record["bytes_per_step"]["dense"] == batch * live * geometry.kv_bytes_per_token
        used, formula = record["engine"]["weights"], record["engine"]["weights_config"]
        if "engine_parameters" in used:  # vLLM's CPU linear layers repacked outside named_parameters() (AVX-512 hosts)
            assert used["engine_parameters"] < formula["parameters"] and used["parameters"] == formula["parameters"]
        else:  # the engine exposes every parameter: its own count, which agrees with the formula
            assert used["source"] == "engine model parameters"
            assert abs(used["parameters"] - formula["parameters"]) <= 0.01 * formula["parameters"]
        assert record["bytes_per_step"]["weights"] == used["read_per_step"]
    ttft = records[0]["ttft_ms"]
    assert ttft["n"] == plan.ttft_repeats and len(ttft["steady"]) == plan.ttft_repeats
    assert ttft["first_after_decode"] > 0 and records[1]["ttft_ms"] is None  # TTFT once per engine
    assert len(read_records(out)) == 2

    def no_engine(*_args, **_kwargs):
        raise AssertionError("a resumed run must not boot an engine")

    monkeypatch.setattr(runner, "_run_job", no_engine)
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0, again.output
    assert "resumed: 2 cell(s)" in again.stderr
    assert json.loads(again.stdout) == records
    assert len(read_records(out)) == 2  # nothing recomputed, nothing appended


def _run_smoke(out, *flags: str) -> list[dict]:
    """The records of `locks bench decode` on the CPU smoke plan at 256 tokens with `flags` (the run must succeed)."""
    result = CliRunner().invoke(app, ["bench", "decode", SMOKE, "--contexts", "256", *flags, "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_batch_prefill_once_measures_every_batch_on_one_prefill_of_the_real_engine(tmp_path):
    """The real scheduler drops requests aborted without draining before the survivors' windows: every
    window step emits exactly `batch` tokens from the survivors, and only the largest batch was prefilled."""
    records = _run_smoke(tmp_path / "once.jsonl", "--batch", "1,2,4", "--batch-prefill", "once")
    plan = load_plan(SMOKE, {"batch_prefill": "once"})
    assert [(r["cell"]["batch_size"], r["status"]) for r in records] == [(4, "ok"), (2, "ok"), (1, "ok")], records
    assert [r["prefills"]["count"] for r in records] == [1, 0, 0]
    assert [r["decoded_before_tokens"] for r in records] == [0, plan.cell_decode_steps, 2 * plan.cell_decode_steps]
    for record in records:
        batch = record["cell"]["batch_size"]
        assert record["cell"]["batch_prefill"] == "once" and record["guards"]["lockstep"] == "pass"
        assert all(w["step_tokens"] == [batch] * plan.steps_per_window for w in record["windows"])
    assert records[0]["prefill"]["batch_size"] == 4 and records[0]["prefill"]["ttft_ms"] > 0
    assert records[2]["ttft_ms"]["n"] == plan.ttft_repeats  # batch-1 repeats once nothing else is live


def test_lockstep_fires_on_a_real_shrinking_batch(monkeypatch):
    from locks_toolkit.harness.presets import materialize_model
    from locks_toolkit.harness.worker import EngineJob, job_environment

    plan = load_plan(SMOKE, {"contexts": "128", "batch_sizes": "3"})
    config, _ = build_config("tiny-llama", None, plan.effective_max_model_len)
    model_dir = str(materialize_model(config))
    job = EngineJob(plan, "cpu", 128, None, (3,), model_dir, True, ModelGeometry.from_config(config), 1024, False)
    for key, value in job_environment(job).items():
        monkeypatch.setenv(key, value)
    from locks_toolkit.harness.session import EngineSession

    session = EngineSession(plan, "cpu", model_dir, True, None, vocab_size=1024)
    try:
        pre = session.prefill(3, 128, "shrink")
        steady = session.decode(pre.request_ids, 3)
        session.engine.abort_request([pre.request_ids[0]])  # one request leaves the batch mid-window
        shrunk = session.decode(pre.request_ids, 3)
        session.abort(pre.request_ids)
    finally:
        session.close()
    assert guards.check_lockstep(steady.step_tokens, steady.step_requests, 3).status == guards.PASS
    result = guards.check_lockstep(steady.step_tokens + shrunk.step_tokens,
                                   steady.step_requests + shrunk.step_requests, 3)
    assert result.status == guards.FAIL and "step 3 emitted 2 tokens from 2 of 3 requests" in result.reason


def test_an_engine_that_overrides_the_plans_scheduling_is_refused_with_the_fix(monkeypatch):
    """vLLM's CPU platform turns async scheduling off whatever is asked: the session must not record
    sync steps under an async plan."""
    from locks_toolkit.harness.presets import materialize_model
    from locks_toolkit.harness.worker import EngineJob, job_environment
    from locks_toolkit.kernels.config import ConfigError

    with pytest.raises(ConfigError, match="always schedules synchronously; drop --async-scheduling"):
        load_plan(SMOKE, {"async_scheduling": True})  # the plan refuses it for CPU arms up front
    plan = load_plan(SMOKE, {"contexts": "128", "batch_sizes": "1"})
    object.__setattr__(plan, "async_scheduling", True)  # past the plan's check: the engine-side one is tested
    config, _ = build_config("tiny-llama", None, plan.effective_max_model_len)
    model_dir = str(materialize_model(config))
    job = EngineJob(plan, "cpu", 128, None, (1,), model_dir, True, ModelGeometry.from_config(config), 1024, False)
    for key, value in job_environment(job).items():
        monkeypatch.setenv(key, value)
    from locks_toolkit.harness.session import EngineSession

    with pytest.raises(ConfigError, match=r"ran async scheduling off on this platform \(cpu\).*async_scheduling: false"):
        EngineSession(plan, "cpu", model_dir, True, None, vocab_size=1024)


@pytest.mark.slow
def test_locks_cpu_arm_is_verified_by_the_backend_counters(tmp_path):
    """The real Locks CPU backend: budget 128 < 256 tokens runs sparse (ok); budget 512 covers every
    page, so the backend counts dense-fallback rows and the cell is refused."""
    out = tmp_path / "bench.jsonl"
    args = ["bench", "decode", SMOKE, "--arms", "locks-cpu", "--contexts", "256", "--batch", "1",
            "--budget", "128,512", "--out", str(out), "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    sparse, dense = json.loads(result.stdout)
    plan = load_plan(SMOKE)
    assert (sparse["cell"]["budget_tokens"], sparse["status"]) == (128, "ok"), sparse["reason"]
    assert sparse["path_check"]["status"] == "pass" and sparse["guards"]["deployed"] == "pass"
    layers = 2
    assert sparse["path_check"]["counters"]["sparse_decode_rows"] == plan.windows * plan.steps_per_window * layers
    assert sparse["path_check"]["counters"]["dense_fallback_rows"] == 0
    assert sparse["bytes_per_step"]["locks"] < sparse["bytes_per_step"]["dense"]
    assert sparse["engine"]["env"]["LOCKS_VLLM_CPU"] == "1"
    assert sparse["engine"]["env"]["VLLM_PLUGINS"] == "locks_toolkit"  # the allowlist still loads our plugin
    assert sparse["engine"]["engine_kwargs"]["additional_config"] == {
        "locks": {"budget": 128, "format": "r8i4", "scorer": "locks", "combine": "share_average"}}
    assert (dense["cell"]["budget_tokens"], dense["status"]) == (512, "refused")
    assert dense["reason"].startswith("deployed path, window 0:") and "dense fallback rows" in dense["reason"]


def test_an_engine_that_raises_at_boot_is_one_short_error_record_and_a_hint(tmp_path):
    """vLLM rejects the model while booting (an architecture it lacks): the cell is an `error` record whose
    reason names the stage and vLLM's complaint on one line (vLLM appends hundreds of supported names; the
    record's traceback keeps them), the run exits 1 and says where the engine's log is."""
    from locks_toolkit.harness.presets import load_preset_config, materialize_model

    model = tmp_path / "model"
    model.mkdir()
    config = json.loads((materialize_model(load_preset_config("tiny-llama"), tmp_path / "cache") / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchModelForCausalLM"]}))
    store = tmp_path / "bench.jsonl"
    result = CliRunner().invoke(app, ["bench", "decode", SMOKE, "--model", str(model), "--contexts", "128",
                                      "--batch", "1", "--out", str(store)])
    assert result.exit_code == 1, result.output
    (record,) = read_records(store)
    assert record["status"] == "error" and record["reason"].startswith("engine boot failed: ValidationError")
    assert "NoSuchModelForCausalLM" in record["reason"] and "\n" not in record["reason"]
    assert len(record["reason"]) <= 450 and record["reason"].endswith("(the record's traceback has the rest)")
    assert "LlamaForCausalLM" in record["traceback"]  # vLLM's full list of what it supports
    said = " ".join(result.stderr.split())
    assert "1 cell(s) failed" in said and "rerun the same command" in said and "engine's log" in said


def test_prefill_attention_skip_fills_the_cache_of_the_real_engine_without_prefill_attention(tmp_path, monkeypatch):
    """The CPU engine with the prefill's attention skipped still decodes every window in lockstep; the cell is
    its own (no TTFT), and a skip that does not reach the engine's backend stops the cell with the reason."""
    records = _run_smoke(tmp_path / "skip.jsonl", "--batch", "1,2", "--prefill-attention", "skip")
    assert [(r["cell"]["batch_size"], r["status"]) for r in records] == [(1, "ok"), (2, "ok")], records
    for record in records:
        assert record["cell"]["prefill_attention"] == "skip" and record["guards"]["lockstep"] == "pass"
        assert record["ttft_ms"] is None and "prefill_attention skip" in record["build_method"]
        assert "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl" in record["engine"]["prefill_attention"]["wrapped"]

    from locks_toolkit.harness.presets import materialize_model
    from locks_toolkit.harness.worker import EngineJob, job_environment, run_job
    from locks_toolkit.kernels.vllm_backend import prefill_attention

    plan = load_plan(SMOKE, {"contexts": "128", "batch_sizes": "1", "prefill_attention": "skip"})
    config, _ = build_config("tiny-llama", None, plan.effective_max_model_len)
    job = EngineJob(plan, "cpu", 128, None, (1,), str(materialize_model(config)), True,
                    ModelGeometry.from_config(config), 1024, False)
    for key, value in job_environment(job).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(prefill_attention, "configure", lambda mode: None)  # as if no backend were wrapped
    messages = []
    run_job(job, messages.append)
    cells = [m for m in messages if m["type"] == "cell"]
    assert [c["status"] for c in cells] == ["error"], messages
    assert "prefill_attention skip: the prefill ran its attention (CPU_ATTN is not among" in cells[0]["reason"]
