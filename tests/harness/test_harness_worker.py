"""The engine-job protocol with a scripted engine: OOM frontier, deployed-path refusal, failures.

The real engine is exercised in test_harness_session.py; here a stand-in session lets the GPU-only
paths (a sparse arm's counters, KV limits, CUDA OOM) run on the CPU with inputs that make them fire.
"""

import sys
import types

import pytest
from locks_toolkit.harness import nvml
from locks_toolkit.harness import session as session_module
from locks_toolkit.harness.bandwidth import MEASURED
from locks_toolkit.harness.arms import ARMS, Arm
from locks_toolkit.harness.plan import load_plan
from locks_toolkit.harness.presets import ModelGeometry, load_preset_config
from locks_toolkit.harness.session import DecodeLog, EngineStall, PrefillLog
from locks_toolkit.harness.ttft import BUILD_SD_MULTIPLE, build_estimate
from locks_toolkit.harness.weights import weights_from_config
from locks_toolkit.harness.worker import EngineJob, run_job

COUNTS = {"sparse_decode_rows": 0, "dense_fallback_rows": 0, "stock_decode_rows": 0, "summaries_built": 0}


class ScriptedSession:
    """Stands in for EngineSession: every request emits one token per step unless scripted otherwise."""

    num_kv_blocks = 100_000
    fallback_at_step: int | None = None  # global decode step at which the sparse arm falls back
    shrink_at_step: int | None = None
    boot_error: Exception | None = None
    measure_error: Exception | None = None
    ttft_script: list[float] | None = None  # TTFTs of the "ttft-first" then "ttft" prefills, in order
    first_step_ms: float | None = None  # the first step of every decode() call (async: collects a finished step)

    def __init__(self, plan, arm, model_dir, dummy, knobs, vocab_size, max_model_len=None):
        if self.boot_error is not None:
            raise self.boot_error
        self.plan, self.boot_s, self.block_size, self.engine_kwargs = plan, 0.01, 16, {"model": model_dir}
        self.arm = arm
        self.steps = 0
        self.live: list[str] = []
        self.aborted: list[tuple[int, bool]] = []  # (requests, drain) of every abort, in order
        self.aborted_ids: list[list[str]] = []  # the ids of every abort, in order
        self.ttfts = list(self.ttft_script or [])
        self.prefills: list[tuple[str, int]] = []  # (tag, batch) of every prefill, in order
        ScriptedSession.last = self

    def model_weights(self, tied_embeddings):
        return None  # as when the engine's model is out of reach: the worker falls back to the config count

    def backend_in_use(self):
        return "SCRIPTED"

    def rank_facts(self):
        return None

    def read_counters(self):  # one rank, in this process
        return ARMS[self.arm].read_counters()

    def blocks_needed(self, batch, context, decoded=None):
        decoded = self.plan.decode_tokens_for(context) if decoded is None else decoded
        return batch * -(-(context + decoded) // self.block_size)

    def prefill(self, batch, context, tag):
        if tag == "measure" and self.measure_error is not None:
            raise self.measure_error
        self.live = [f"{tag}-{len(self.prefills)}-{i}" for i in range(batch)]
        self.prefills.append((tag, batch))
        COUNTS["summaries_built"] += batch * (context // 16)  # as our backend: every prefill builds its pages
        if tag.startswith("ttft") and self.ttfts:
            ttft = self.ttfts.pop(0)
        else:
            ttft = 10.0 + (5.0 if tag == "ttft-first" else 0.0)
        return PrefillLog(list(self.live), ttft_ms=ttft, step_ms=[10.0])

    def decode(self, request_ids, steps, on_step=None):
        log = DecodeLog()
        for index in range(steps):
            self.steps += 1
            live = sum(request_id in self.live for request_id in request_ids)  # an aborted request emits nothing
            running = live - (1 if self.shrink_at_step and self.steps >= self.shrink_at_step else 0)
            fallback = self.fallback_at_step is not None and self.steps >= self.fallback_at_step
            COUNTS["dense_fallback_rows" if fallback else "sparse_decode_rows"] += running
            short = index == 0 and self.first_step_ms is not None
            log.step_ms.append(self.first_step_ms if short else 2.0 + 0.01 * (index % 3))
            log.step_tokens.append(running)
            log.step_requests.append(running)
            if on_step is not None and on_step(index):
                break
        return log

    def abort(self, request_ids, drain=True):
        self.aborted.append((len(request_ids), drain))
        self.aborted_ids.append(list(request_ids))
        self.live = [request_id for request_id in self.live if request_id not in set(request_ids)]


@pytest.fixture
def scripted(monkeypatch):
    for key in COUNTS:
        COUNTS[key] = 0
    fake_counters = types.ModuleType("fake_locks_counters")
    fake_counters.snapshot = lambda: dict(COUNTS)
    monkeypatch.setitem(sys.modules, "fake_locks_counters", fake_counters)
    monkeypatch.setitem(ARMS, "fake-locks", Arm("fake-locks", "CUSTOM", device="cpu", sparse=True,
                                                counters="fake_locks_counters:snapshot"))
    monkeypatch.setattr(session_module, "EngineSession", ScriptedSession)
    monkeypatch.setattr(nvml, "sample", lambda: None)  # as on a machine without NVML, GPU or not
    monkeypatch.setattr(nvml, "gpu_info", lambda: None)
    for name in ("fallback_at_step", "shrink_at_step", "boot_error", "measure_error", "ttft_script", "first_step_ms"):
        monkeypatch.setattr(ScriptedSession, name, None)
    return ScriptedSession


def _job(arm, batches, budget=None, context=4096, async_scheduling=False, single_prefill_from=None,
         batch_prefill="per_batch"):
    plan = load_plan(None, {"single_prefill_from": single_prefill_from, "batch_prefill": batch_prefill,
                            "model": "glm-4-9b-chat-1m", "arms": "fa3" if async_scheduling else "cpu", "contexts": context,
                            "batch_sizes": batches, "windows": 3, "steps_per_window": 8, "ramp_min_steps": 2,
                            "ramp_max_steps": 4, "ttft_repeats": 3, "async_scheduling": async_scheduling})
    config = load_preset_config("glm-4-9b-chat-1m")
    return EngineJob(plan, arm, context, budget, tuple(batches), "/nowhere", True, ModelGeometry.from_config(config),
                     151552, True, weights=weights_from_config(config))


def _run(job, phases=None):
    """The job's messages without its live-progress ones (collected into `phases` when given)."""
    messages = []
    run_job(job, messages.append)
    if phases is not None:
        phases.extend(m for m in messages if m["type"] == "phase")
    return [m for m in messages if m["type"] != "phase"]


def test_dense_cells_and_the_oom_frontier(scripted, monkeypatch):
    # 4096 prompt + 28 decode tokens (max(ramp 4, settle 2 + 3 x 8) + 2) = 258 blocks per request
    monkeypatch.setattr(scripted, "num_kv_blocks", 3 * 258)
    messages = _run(_job("cpu", [1, 2, 4, 8]))
    assert [m["type"] for m in messages] == ["engine", "cell", "cell", "cell", "cell", "done"]
    cells = {m["batch"]: m for m in messages if m["type"] == "cell"}
    assert cells[1]["status"] == "ok" and cells[2]["status"] == "ok"
    assert cells[4]["status"] == "oom" and cells[4]["reason"] == "needs 1032 KV blocks, the engine has 774"
    assert cells[8]["status"] == "oom" and "frontier" in cells[8]["reason"]
    assert cells[1]["tpot_ms"]["n"] == 24 and cells[1]["ttft_ms"]["n"] == 3
    assert cells[2]["ttft_ms"] is None and cells[1]["build_ms"] is None  # dense arm: no summary build
    assert cells[1]["build_method"] == "dense arm: no summaries to build"
    assert cells[1]["ttft_ms"]["build_counters"] is None  # the dense arm exposes no counters
    assert cells[1]["path_check"] == {"required": False, "ok": True, "status": "not_applicable", "counters": None}
    assert messages[0]["info"]["backend_in_use"] == "SCRIPTED"


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_async_windows_leave_out_the_step_that_collects_a_finished_one(scripted, monkeypatch, async_scheduling):
    """Under async scheduling the first step() of a window returns a step the GPU finished during the
    pause between windows (on the H200: 3.7 ms against ~8.9); the window times the steps after it. Sync
    windows have no such step and keep every one."""
    monkeypatch.setattr(scripted, "first_step_ms", 0.5)
    job = _job("cpu", [1], async_scheduling=async_scheduling)
    (engine, cell, done) = _run(job)
    timed = [ms for w in cell["windows"] for ms in w["step_ms"]]
    assert len(timed) == 3 * 8 and cell["tpot_ms"]["n"] == 24
    assert (0.5 in timed) != async_scheduling
    assert job.plan.decode_tokens_per_request == max(4, 2 + 3 * (8 + async_scheduling)) + 2


def test_sparse_arm_verified_by_its_counters(scripted):
    (engine, cell, done) = _run(_job("fake-locks", [2], budget=2048, context=131072))
    assert cell["status"] == "ok", cell["reason"]
    assert cell["path_check"]["ok"] and cell["path_check"]["counters"]["sparse_decode_rows"] == 2 * 3 * 8
    assert cell["bytes_per_step"]["locks"] < cell["bytes_per_step"]["dense"] / 5
    assert cell["build_ms"] == pytest.approx(5.0)  # first prefill after decode minus the steady mean (sd 0)
    assert cell["build_method"].startswith("first prefill after decode minus steady mean (5.0 ms) exceeds")


def test_a_build_within_the_noise_of_steady_ttft_is_not_published(scripted, monkeypatch):
    # Our backend's shape: the first prefill after decode is no slower than the steady ones (-11 ms on the H200).
    monkeypatch.setattr(scripted, "ttft_script", [1544.7, 1557.1, 1552.9, 1557.5])
    (engine, cell, done) = _run(_job("fake-locks", [1], budget=2048, context=32768))
    ttft = cell["ttft_ms"]
    assert ttft["first_after_decode"] == 1544.7 and ttft["steady"] == [1557.1, 1552.9, 1557.5]
    assert ttft["first_minus_steady_ms"] == pytest.approx(1544.7 - (1557.1 + 1552.9 + 1557.5) / 3)
    assert cell["build_ms"] is None and cell["build_method"].startswith("not significant: ")
    # the counters read around one steady prefill hold that prefill's summary work: 2048 pages
    assert ttft["build_counters"]["summaries_built"] == 32768 // 16
    assert ttft["build_counters"]["sparse_decode_rows"] == 0


def test_build_estimate_threshold_is_sd_multiple_of_the_steady_samples():
    steady = [100.0, 104.0, 96.0]  # mean 100, sd 4
    ttft = {"steady": steady, "steady_mean": 100.0, "steady_sd": 4.0}
    just_over = 100.0 + BUILD_SD_MULTIPLE * 4.0 + 0.5
    assert build_estimate({**ttft, "first_after_decode": just_over}, sparse=True)[0] == pytest.approx(just_over - 100.0)
    assert build_estimate({**ttft, "first_after_decode": just_over - 1.0}, sparse=True)[0] is None
    assert build_estimate({**ttft, "first_after_decode": 250.0}, sparse=False) == (None, "dense arm: no summaries to build")
    one = build_estimate({"steady": [100.0], "steady_mean": 100.0, "steady_sd": 0.0, "first_after_decode": 900.0}, True)
    assert one[0] is None and "at least 2" in one[1]


def test_step_floor_adds_the_weights_the_step_reads(scripted):
    (engine, cell, done) = _run(_job("fake-locks", [1], budget=2048, context=32768))
    traffic = cell["bytes_per_step"]
    config_weights = weights_from_config(load_preset_config("glm-4-9b-chat-1m"))
    assert engine["info"]["weights"] == config_weights  # no engine model here: the config count is used
    assert traffic["weights"] == config_weights["read_per_step"] and traffic["weights_source"].startswith("config")
    assert traffic["step_bytes"] == traffic["weights"] + traffic["locks"]
    assert cell["step_floor_ms"] == pytest.approx(traffic["step_bytes"] / traffic["bandwidth_bytes_per_s"] * 1e3)
    assert cell["floor_ms"] == pytest.approx(traffic["locks"] / traffic["bandwidth_bytes_per_s"] * 1e3)  # attention only
    assert cell["step_floor_basis"] == "recorded" and "step_floor_why" not in cell
    # no rate pinned in the plan: the engine measured its device (here the CPU) at boot, and every floor uses it
    assert engine["info"]["bandwidth_source"] == traffic["bandwidth_source"] == MEASURED
    assert traffic["bandwidth_bytes_per_s"] == engine["info"]["copy_bandwidth_bytes_per_s"] > 1e8


def test_a_model_of_unknown_weight_bytes_records_the_attention_floor_and_why(scripted, monkeypatch):
    from locks_toolkit.harness import worker

    monkeypatch.setattr(worker, "choose_weights", lambda engine_count, config_count: None)
    (engine, cell, done) = _run(_job("fake-locks", [1], budget=2048, context=32768))
    assert cell["bytes_per_step"]["weights"] is None
    assert cell["step_floor_basis"] == "kv_only" and cell["step_floor_ms"] == cell["floor_ms"]
    assert "weight bytes" in cell["step_floor_why"]


def test_dense_fallback_in_a_timed_window_refuses_the_cell(scripted, monkeypatch):
    # ramp 2 steps (no NVML), settle 2, windows of 8: step 2 + 2 + 8 + 3 lies in window 1.
    monkeypatch.setattr(scripted, "fallback_at_step", 2 + 2 + 8 + 3)
    (engine, cell, done) = _run(_job("fake-locks", [1], budget=2048, context=131072))
    assert cell["status"] == "refused"
    assert cell["reason"].startswith("deployed path, window 1:") and "dense fallback rows" in cell["reason"]
    assert cell["path_check"]["ok"] is False


def test_a_window_that_loses_a_request_is_discarded(scripted, monkeypatch):
    # ramp stops at ramp_min_steps = 2 without NVML, then settle 2; window 2 starts at step 21
    monkeypatch.setattr(scripted, "shrink_at_step", 2 + 2 + 2 * 8 + 1)
    (engine, cell, done) = _run(_job("cpu", [4]))
    assert cell["status"] == "ok" and cell["reason"] == "1 of 3 windows discarded"
    assert [w["clean"] for w in cell["windows"]] == [True, True, False]
    assert cell["windows"][2]["discard_reason"].startswith("lockstep: step 0 emitted 3 tokens from 3 of 4")
    assert cell["tpot_ms"]["n"] == 16  # statistics come from the clean windows only


def test_shrinking_every_window_refuses_the_cell(scripted, monkeypatch):
    monkeypatch.setattr(scripted, "shrink_at_step", 1)
    (engine, cell, done) = _run(_job("cpu", [4]))
    assert cell["status"] == "refused" and cell["reason"].startswith("no clean window")


@pytest.mark.parametrize("error,status", [
    (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), "oom"),
    (ValueError("To serve at least one request ... KV cache is needed, which is larger than the available KV cache memory"), "oom"),
    (RuntimeError("FlashInfer JIT failed"), "error"),
])
def test_boot_failures(scripted, monkeypatch, error, status):
    monkeypatch.setattr(scripted, "boot_error", error)
    (fatal,) = _run(_job("cpu", [1, 2]))
    assert fatal["type"] == "fatal" and fatal["status"] == status and "engine boot failed" in fatal["reason"]


def test_measurement_failures(scripted, monkeypatch):
    monkeypatch.setattr(scripted, "measure_error", EngineStall("2 of 4 requests got no first token"))
    messages = _run(_job("cpu", [4, 8]))
    assert [(m.get("batch"), m.get("status")) for m in messages[1:]] == [(4, "oom"), (8, "oom"), (None, None)]
    monkeypatch.setattr(scripted, "measure_error", RuntimeError("illegal memory access"))
    messages = _run(_job("cpu", [4, 8]))
    assert [m["type"] for m in messages] == ["engine", "cell"]  # no "done": the engine state is unknown
    assert messages[1]["status"] == "error" and "illegal memory access" in messages[1]["reason"]


def test_a_silent_engine_process_is_killed_and_its_cells_become_errors():
    from locks_toolkit.harness import runner

    job = _job("cpu", [1, 2])
    job = EngineJob(load_plan(None, {"arms": "cpu", "contexts": 4096, "batch_sizes": "1,2",
                                     "silence_timeout_s": 0.5, "ramp_max_steps": 4, "ramp_min_steps": 2}),
                    *[getattr(job, f) for f in ("arm", "context", "budget", "batch_sizes", "model_dir",
                                                "dummy_weights", "geometry", "vocab_size", "measure_ttft")])
    written = []
    runner._run_job(job, {1: {"batch_size": 1}, 2: {"batch_size": 2}},
                    lambda cell, status, reason, engine, measurement: written.append((cell, status, reason)))
    assert [(cell["batch_size"], status) for cell, status, _ in written] == [(1, "error"), (2, "error")]
    assert "(hung?) and was killed" in written[0][2] and written[0][2] == written[1][2]


def test_a_long_context_cell_pays_one_prefill_and_says_so(scripted):
    """At a single-prefill context the engine has no warm-up prefill and no TTFT repeats: the clock ramp
    decodes on the first cell's measured requests, and TTFT is that prefill (the engine's first)."""
    phases = []
    job = _job("fake-locks", [1, 2], budget=2048, context=8192, single_prefill_from=8192)
    engine, one, two, done = _run(job, phases)
    assert ScriptedSession.last.prefills == [("measure", 1), ("measure", 2)]  # nothing else was prefilled
    assert engine["info"]["warmup"]["mode"].startswith("single prefill")
    assert one["prefills"]["mode"] == "single" and one["prefills"]["count"] == 1
    assert one["ramp"]["ramp_steps"] == job.plan.ramp_min_steps and two["ramp"] is None
    assert one["ttft_ms"]["method"] == "single" and one["ttft_ms"]["first_of_engine"] == 10.0
    assert one["ttft_ms"]["n"] == 0 and one["ttft_ms"]["steady_mean"] is None and two["ttft_ms"] is None
    assert one["ttft_ms"]["build_counters"]["summaries_built"] == 8192 // 16  # that prefill's own summary work
    assert one["build_ms"] is None and one["build_method"].startswith("not estimated: a single-prefill context")
    # the same requests carry the ramp and the windows: the engine is sized for both
    assert job.plan.decode_tokens_for(8192) == 4 + 2 + 3 * 8 + 2 > job.plan.decode_tokens_per_request
    assert job.plan.max_model_len_for(8192) == 8192 + 32
    assert [(p["phase"], p.get("batch"), p.get("index")) for p in phases] == [
        ("boot", None, None), ("prefill", 1, None), ("clock ramp", 1, None),
        ("window", 1, 1), ("window", 1, 2), ("window", 1, 3),
        ("prefill", 2, None), ("window", 2, 1), ("window", 2, 2), ("window", 2, 3)]


def test_below_the_single_prefill_context_the_full_protocol_runs(scripted):
    phases = []
    (engine, cell, done) = _run(_job("fake-locks", [1], budget=2048, context=4096, single_prefill_from=8192), phases)
    assert ScriptedSession.last.prefills == [("warm", 1), ("measure", 1), ("ttft-first", 1)] + [("ttft", 1)] * 3
    assert cell["prefills"] == {"mode": "full", "count": 5, "from_context": 8192, "why": cell["prefills"]["why"]}
    assert cell["ttft_ms"]["method"] == "repeats" and len(cell["ttft_ms"]["build_counters_each"]) == 3
    assert [p["phase"] for p in phases][:3] == ["boot", "warm-up prefill", "clock ramp"]
    assert [p.get("index") for p in phases if p["phase"] == "ttft"] == [0, 1, 2, 3]


def test_batch_prefill_once_prefills_the_largest_fitting_batch_and_measures_the_rest_on_its_requests(scripted, monkeypatch):
    """One prefill per engine: batch 8 does not fit, 4 is prefilled and measured, then 2 and 1 keep the last
    requests of that prefill (the others aborted without draining), largest first; each cell says how many
    tokens its requests had decoded before it, and its bytes are counted at that longer length."""
    plan = _job("cpu", [1, 2, 4, 8], batch_prefill="once").plan
    per_cell = plan.cell_decode_steps  # settle 2 + 3 windows x 8
    # 4 requests at 4096 + one cell's decode fit; 8 would not
    monkeypatch.setattr(scripted, "num_kv_blocks", 4 * -(-(4096 + per_cell + 2) // 16))
    messages = _run(_job("cpu", [1, 2, 4, 8], batch_prefill="once"))
    session = ScriptedSession.last
    assert session.prefills == [("warm", 1), ("measure", 4), ("ttft-first", 1)] + [("ttft", 1)] * 3
    cells = [m for m in messages if m["type"] == "cell"]
    assert [(c["batch"], c["status"]) for c in cells] == [(8, "oom"), (4, "ok"), (2, "ok"), (1, "ok")]
    assert cells[0]["reason"] == f"needs {8 * 258} KV blocks, the engine has {4 * 258}"
    by_batch = {c["batch"]: c for c in cells[1:]}
    assert [by_batch[b]["decoded_before_tokens"] for b in (4, 2, 1)] == [0, per_cell, 2 * per_cell]
    for batch, cell in by_batch.items():  # every step emitted exactly `batch` tokens: the rest were aborted
        assert cell["guards"]["lockstep"] == "pass" and cell["tpot_ms"]["n"] == 24
        assert cell["windows"][0]["step_tokens"][0] == batch
        assert cell["prefills"]["mode"] == "once" and cell["prefills"]["prefilled_batch"] == 4
        live = cell["bytes_per_step"]["live_tokens"]
        assert live == 4096 + cell["decoded_before_tokens"] + 2 + 3 * 8 // 2
        assert cell["bytes_per_step"]["dense"] == batch * live * ModelGeometry.from_config(
            load_preset_config("glm-4-9b-chat-1m")).kv_bytes_per_token
    assert [c["prefills"]["count"] for c in cells[1:]] == [1, 0, 0]
    assert by_batch[4]["prefill"]["ttft_ms"] == 10.0 and by_batch[2]["prefill"]["ttft_ms"] is None
    assert session.aborted[0] == (1, True)  # the warm-up request
    assert session.aborted[1:3] == [(2, False), (1, False)]  # 4 -> 2 -> 1 without draining the survivors
    # the survivors are the requests prefilled last (under chunked prefill the first ones decode meanwhile)
    assert session.aborted_ids[1:4] == [["measure-1-0", "measure-1-1"], ["measure-1-2"], ["measure-1-3"]]
    assert session.aborted[3] == (1, True)  # the last survivor, drained before the TTFT repeats
    assert by_batch[1]["ttft_ms"]["n"] == 3 and by_batch[4]["ttft_ms"] is None  # repeats once nothing is live
    assert messages[-1]["type"] == "done"


def test_batch_prefill_once_at_a_single_prefill_context(scripted):
    """At a single-prefill context the ramp decodes on the prefilled batch and TTFT is that one prefill."""
    job = _job("fake-locks", [1, 2], budget=2048, context=8192, single_prefill_from=8192, batch_prefill="once")
    engine, two, one, done = _run(job)
    assert ScriptedSession.last.prefills == [("measure", 2)]
    assert two["batch"] == 2 and two["ramp"]["ramp_steps"] == job.plan.ramp_min_steps and one["ramp"] is None
    assert one["decoded_before_tokens"] == job.plan.ramp_min_steps + job.plan.cell_decode_steps
    assert two["ttft_ms"]["method"] == "single" and two["ttft_ms"]["batch_size"] == 2 and one["ttft_ms"] is None
    assert two["status"] == one["status"] == "ok"
    # the survivor of batch 2 decodes through the ramp and both cells: the engine is sized for that
    assert job.plan.decode_tokens_for(8192) == job.plan.ramp_max_steps + 2 * job.plan.cell_decode_steps + 2


def test_batch_prefill_once_hands_a_stalled_prefill_to_the_next_batch(scripted, monkeypatch):
    calls = []
    prefill = ScriptedSession.prefill

    def stall_first(self, batch, context, tag):
        calls.append(batch)
        if len(calls) == 1:
            raise EngineStall(f"1 of {batch} requests got no first token")
        return prefill(self, batch, context, tag)

    monkeypatch.setattr(scripted, "prefill", stall_first)
    messages = _run(_job("cpu", [1, 2, 4], batch_prefill="once", single_prefill_from=4096))
    cells = [(m["batch"], m["status"]) for m in messages if m["type"] == "cell"]
    assert cells == [(4, "oom"), (2, "ok"), (1, "ok")]
    assert calls == [4, 2]
