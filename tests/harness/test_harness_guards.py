"""Guards fire on the inputs that should make them fire, and only on those."""

import pytest
from locks_toolkit.harness import guards as g


def _samples(reasons, clocks):
    """NVML samples as the sampler records them (one dict per sample)."""
    return [{"t": 0.02 * i, "reasons": r, "sm_mhz": c, "mem_mhz": 3201, "temp_c": 60, "power_w": 600.0}
            for i, (r, c) in enumerate(zip(reasons, clocks))]


def test_lockstep_passes_when_every_request_emits_once_per_step():
    result = g.check_lockstep([4] * 64, [4] * 64, batch=4)
    assert result.status == g.PASS and result.detail["steps"] == 64


def test_lockstep_fails_on_a_shrinking_batch():
    # Step log of a batch of 4 where one request is preempted at step 40 (KV pressure).
    tokens = [4] * 40 + [3] * 24
    requests = [4] * 40 + [3] * 24
    result = g.check_lockstep(tokens, requests, batch=4)
    assert result.status == g.FAIL
    assert "step 40" in result.reason and "24 of 64" in result.reason
    assert result.detail["bad_steps"][0] == 40


def test_lockstep_fails_on_a_mixed_prefill_step_and_on_double_tokens():
    assert g.check_lockstep([2, 0, 2], [2, 0, 2], batch=2).rejects  # a step that emitted nothing
    assert g.check_lockstep([2, 3, 2], [2, 2, 2], batch=2).rejects  # one request emitted two tokens
    assert g.check_lockstep([], [], batch=2).rejects
    with pytest.raises(ValueError):
        g.check_lockstep([1, 1], [1], batch=1)


def test_throttle_rejects_hw_slowdown_bit():
    samples = _samples([g.SW_POWER_CAP, g.SW_POWER_CAP | g.HW_SLOWDOWN, g.SW_POWER_CAP], [1980, 1755, 1980])
    result = g.check_throttle(samples, sm_clock_max_mhz=1980, sag_threshold=0.25)
    assert result.status == g.FAIL
    assert "hw_slowdown" in result.reason
    assert "sw_power_cap" in result.detail["reasons_seen"]


@pytest.mark.parametrize("bit,name", [(g.HW_THERMAL_SLOWDOWN, "hw_thermal_slowdown"),
                                      (g.SW_THERMAL_SLOWDOWN, "sw_thermal_slowdown"),
                                      (g.HW_POWER_BRAKE_SLOWDOWN, "hw_power_brake_slowdown")])
def test_throttle_rejects_thermal_and_power_brake(bit, name):
    result = g.check_throttle(_samples([0, bit], [1980, 1980]), 1980, 0.25)
    assert result.rejects and name in result.reason


def test_sw_power_cap_alone_passes_and_is_recorded():
    samples = _samples([g.SW_POWER_CAP] * 5, [1980, 1965, 1950, 1980, 1972])
    result = g.check_throttle(samples, 1980, 0.25)
    assert result.status == g.PASS
    assert result.detail["reasons_seen"] == ["sw_power_cap"]
    assert "sw_power_cap" in result.reason


def test_throttle_rejects_an_unexplained_clock_sag_beyond_threshold_only():
    sagging = _samples([0, 0, 0], [1980, 1400, 1980])
    result = g.check_throttle(sagging, 1980, 0.25)
    assert result.rejects and "1400 MHz with no power-cap reason" in result.reason  # 1400 < 0.75 * 1980 = 1485
    assert not g.check_throttle(sagging, 1980, 0.30).rejects  # 1400 >= 0.70 * 1980 = 1386


def test_a_sag_under_the_sw_power_cap_is_the_workloads_own_draw_and_is_kept():
    """Dense arms at high batch run far below the maximum clock with only the SW power-cap bit set (1450-1800
    MHz against 1980 on the H200): the window stays, and the record says how far the clock went."""
    capped = _samples([g.SW_POWER_CAP] * 3, [1980, 1450, 1470])
    result = g.check_throttle(capped, 1980, 0.25)
    assert result.status == g.PASS and result.detail["power_capped_samples"] == 2
    assert "down to 1450 MHz in 2 of 3 samples with sw_power_cap set" in result.reason
    mixed = _samples([g.SW_POWER_CAP, 0, g.SW_POWER_CAP], [1450, 1400, 1980])  # one low sample has no reason
    assert g.check_throttle(mixed, 1980, 0.25).rejects


def test_nvml_unavailable_is_never_a_pass():
    assert g.check_throttle(None, None, 0.25).status == g.UNAVAILABLE
    assert g.check_throttle([], 1980, 0.25).status == g.UNAVAILABLE


def test_reason_names_decode_every_bit():
    assert g.reason_names(g.GPU_IDLE | g.SW_POWER_CAP | g.HW_THERMAL_SLOWDOWN) == [
        "gpu_idle", "sw_power_cap", "hw_thermal_slowdown"]
    assert g.reason_names(0x1000) == ["unknown_0x1000"]


def test_deployed_path_from_counter_deltas():
    before = {"sparse_decode_rows": 100, "dense_fallback_rows": 0, "stock_decode_rows": 0}
    sparse = {"sparse_decode_rows": 100 + 64 * 40, "dense_fallback_rows": 0, "stock_decode_rows": 0}
    fallback = {"sparse_decode_rows": 100 + 63 * 40, "dense_fallback_rows": 40, "stock_decode_rows": 0}
    idle = dict(before)
    assert g.check_deployed(before, sparse, sparse_arm=True).status == g.PASS
    result = g.check_deployed(before, fallback, sparse_arm=True)
    assert result.rejects and "40 dense fallback rows" in result.reason
    assert g.check_deployed(before, idle, sparse_arm=True).rejects
    assert g.check_deployed(None, sparse, sparse_arm=True).status == g.UNAVAILABLE
    assert g.check_deployed(None, None, sparse_arm=False).status == g.NOT_APPLICABLE
    # rows the crossover ran dense are the deployed path choosing, not a fallback; a window of only those passes
    chosen = dict(sparse, crossover_dense_rows=24 * 40)
    result = g.check_deployed(before, chosen, sparse_arm=True)
    assert result.status == g.PASS and "960 decode rows chosen dense by the crossover" in result.reason
    only_chosen = dict(before, crossover_dense_rows=64 * 40)
    assert g.check_deployed(before, only_chosen, sparse_arm=True).status == g.PASS
    assert g.check_deployed(before, dict(only_chosen, dense_fallback_rows=1), sparse_arm=True).rejects


def test_window_and_cell_verdicts():
    ok = g.GuardResult(g.PASS)
    shrink = g.check_lockstep([2, 1], [2, 1], batch=2)
    hot = g.check_throttle(_samples([g.HW_SLOWDOWN], [1980]), 1980, 0.25)
    blind = g.check_throttle(None, None, 0.25)
    assert g.judge_window(ok, ok).clean
    assert g.judge_window(ok, blind).clean  # recorded as unavailable, not rejected ...
    assert not g.judge_window(ok, blind, require_nvml=True).clean  # ... unless NVML is required
    windows = [g.judge_window(shrink, ok), g.judge_window(ok, hot)]
    status, reason = g.judge_cell(windows, [g.GuardResult(g.NOT_APPLICABLE)] * 2)
    assert status == "refused" and "no clean window" in reason and "lockstep" in reason and "hw_slowdown" in reason
    status, reason = g.judge_cell(windows + [g.judge_window(ok, ok)], [g.GuardResult(g.NOT_APPLICABLE)] * 3)
    assert status == "ok" and reason == "2 of 3 windows discarded"
    fallback = g.GuardResult(g.FAIL, "3 dense fallback rows in a timed window")
    status, reason = g.judge_cell([g.judge_window(ok, ok)] * 2, [g.GuardResult(g.PASS), fallback])
    assert status == "refused" and "window 1" in reason and "dense fallback" in reason
    assert g.summarize([ok, hot, blind]) == g.FAIL
    assert g.summarize([ok, blind]) == g.UNAVAILABLE


def test_sampler_thread_feeds_the_throttle_guard(monkeypatch):
    import itertools
    import time

    from locks_toolkit.harness import nvml

    ticks = itertools.count()

    def fake_sample():
        i = next(ticks)
        return {"t": time.monotonic(), "reasons": g.SW_POWER_CAP | (g.HW_SLOWDOWN if i == 2 else 0),
                "sm_mhz": 1980, "mem_mhz": 3201, "temp_c": 55, "power_w": 650.0}

    monkeypatch.setattr(nvml, "sample", fake_sample)
    with nvml.ThrottleSampler(interval_s=0.002) as sampler:
        deadline = time.monotonic() + 5
        while len(sampler.samples) < 4 and time.monotonic() < deadline:
            time.sleep(0.002)
    assert len(sampler.samples) >= 4 and sampler.samples[0]["t"] == 0.0
    assert all(b["t"] >= a["t"] for a, b in zip(sampler.samples, sampler.samples[1:]))
    assert g.check_throttle(sampler.samples, 1980, 0.25).rejects  # the slowdown in sample 2 was caught

    monkeypatch.setattr(nvml, "sample", lambda: None)
    with nvml.ThrottleSampler() as blind:
        pass
    assert blind.samples is None and g.check_throttle(blind.samples, None, 0.25).status == g.UNAVAILABLE
