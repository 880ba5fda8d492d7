"""`locks bench trace`: the per-step busy/idle split from profiler activities, and a real CPU engine run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from locks_toolkit.harness.lab.step_trace import (
    Activity,
    covered_us,
    markdown,
    summarize_steps,
)
from locks_toolkit.harness.plan import default_plan_path


def test_covered_time_is_the_union_of_clipped_intervals():
    acts = [Activity("a", 0, 10), Activity("b", 5, 15), Activity("c", 20, 30), Activity("d", 22, 25)]
    assert covered_us(acts, 0, 100) == 25  # [0, 15] and [20, 30]
    assert covered_us(acts, 8, 21) == 8  # [8, 15] and [20, 21]
    assert covered_us([], 0, 10) == 0


def test_steps_own_the_activities_they_started_and_rank_them_per_step():
    windows = [(0.0, 100.0), (100.0, 200.0)]
    acts = [Activity("gemm", 0, 40), Activity("attn", 50, 60), Activity("attn", 55, 70),  # step 0: busy 60
            Activity("gemm", 100, 140), Activity("attn", 190, 230)]  # step 1: starts inside, runs past its end
    summary = summarize_steps(acts, windows)
    first, second = summary["per_step"]
    assert (first["busy_us"], first["idle_us"], first["activities"]) == (60, 40, 3)
    assert (second["busy_us"], second["idle_us"], second["activity_us"]) == (80, 20, 80)
    assert summary["mean"]["busy_us"] == 70
    assert [(t["name"], t["us_per_step"], t["calls_per_step"]) for t in summary["top"]] == [("gemm", 40, 1), ("attn", 32.5, 1.5)]
    with pytest.raises(ValueError, match="no step windows"):
        summarize_steps(acts, [])


def test_device_ranges_own_the_kernels_that_run_after_their_host_range():
    # host ranges of 3 steps; each step's kernels run ~60 µs later, inside the step's device range
    host = [(0.0, 100.0), (100.0, 200.0), (200.0, 300.0)]
    device = [(60.0, 150.0), (160.0, 250.0), (260.0, 350.0)]
    acts = [Activity("k", 60, 100), Activity("k", 110, 150), Activity("k", 160, 240), Activity("k", 260, 300),
            Activity("k", 310, 340)]
    by_device = summarize_steps(acts, host, device_windows=device)
    assert [s["activities"] for s in by_device["per_step"]] == [2, 1, 2]
    assert [s["busy_us"] for s in by_device["per_step"]] == [80, 80, 70]
    assert [s["wall_us"] for s in by_device["per_step"]] == [100, 100, 100]  # wall stays the host's
    # by host ranges the same kernels would land one step late: the first step owns one kernel only
    assert [s["activities"] for s in summarize_steps(acts, host)["per_step"]] == [1, 2, 2]
    # a device-range list that does not match the steps is ignored
    assert summarize_steps(acts, host, device_windows=device[:2])["per_step"][0]["activities"] == 1


def test_idle_gaps_are_charged_to_the_activity_that_ends_them():
    # two steps: a 40 µs wait before "launch" each step, graph kernels 0.5 µs apart, a 10 µs wait before "copy"
    acts = []
    for base in (0.0, 200.0):
        acts += [Activity("copy", base + 10, base + 12), Activity("launch", base + 52, base + 60)]
        acts += [Activity("k", base + 60.5 + 3 * i, base + 63 + 3 * i) for i in range(5)]
    gaps = {g["name"]: g for g in summarize_steps(acts, [(0.0, 200.0), (200.0, 400.0)])["idle_before"]}
    assert gaps["launch"]["us_per_step"] == 40 and gaps["launch"]["gaps_per_step"] == 1
    # the first activity has nothing before it to wait on; the second step's copy waits from the last kernel
    assert gaps["copy"]["us_per_step"] == pytest.approx((210 - 75) / 2) and gaps["copy"]["gaps_per_step"] == 0.5
    assert "k" not in gaps  # launch gaps inside a graph are not idle time to explain


def test_a_stored_chrome_trace_is_summarized_again(tmp_path):
    import gzip

    from locks_toolkit.harness.lab.step_trace import STEP_RANGE, activities_from_chrome_trace

    events = [{"cat": "user_annotation", "name": f"{STEP_RANGE}{i}", "ts": 100.0 * i, "dur": 100.0} for i in range(2)]
    events += [{"cat": "gpu_user_annotation", "name": f"{STEP_RANGE}{i}", "ts": 100.0 * i + 50, "dur": 90.0} for i in range(2)]
    events += [{"cat": "kernel", "name": "k", "ts": 100.0 * i + 55, "dur": 30.0} for i in range(2)]
    events += [{"cat": "gpu_memcpy", "name": "copy", "ts": 100.0 * i + 50, "dur": 2.0} for i in range(2)]
    events += [{"cat": "cpu_op", "name": "aten::add", "ts": 10.0, "dur": 5.0}]  # host ops are not activities
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as handle:
        json.dump({"traceEvents": events}, handle)
    found, host, device = activities_from_chrome_trace(path)
    assert sorted(a.name for a in found) == ["copy", "copy", "k", "k"]
    assert host == [(0.0, 100.0), (100.0, 200.0)] and device == [(50.0, 140.0), (150.0, 240.0)]
    summary = summarize_steps(found, host, device_windows=device)
    assert [s["activities"] for s in summary["per_step"]] == [2, 2] and summary["mean"]["busy_us"] == 32
    assert summary["idle_before"][0]["name"] == "copy" and summary["idle_before"][0]["us_per_step"] == pytest.approx(65 / 2)


def test_markdown_names_the_arm_and_the_costliest_activity():
    summary = summarize_steps([Activity("k1", 0, 5), Activity("k2", 5, 7)], [(0.0, 10.0)])
    record = {"cell": {"arm": "locks", "context_tokens": 4096, "layers": 2}, "activity": "kernels", "summary": summary}
    text = markdown(record)
    assert "locks @ 4096" in text and text.index("`k1`") < text.index("`k2`") and "idle 3 µs" in text


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_cli_traces_the_cpu_engine(tmp_path):
    """The real vLLM CPU engine with the Locks CPU backend: every traced step has a window and ops."""
    smoke = str(default_plan_path().parent / "smoke-cpu.yaml")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = [sys.executable, "-m", "locks_toolkit.locks_cli.main", "bench", "trace", "--plan", smoke,
            "--arm", "locks-cpu", "--context", "300", "--budget", "128", "--steps", "2", "--warm-steps", "1",
            "--out", str(tmp_path)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=380, env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    (record,) = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    summary = record["summary"]
    assert record["schema"] == "locks.bench.trace/1" and record["activity"] == "cpu ops"
    assert summary["steps"] == 2 and len(record["step_ms"]) == 2
    for step in summary["per_step"]:
        assert step["activities"] > 0 and 0 < step["busy_us"] <= step["wall_us"] + 1
    assert summary["top"] and (tmp_path / "trace-locks-cpu-300.json").stat().st_size > 0
    assert "locks-cpu @ 300" in done.stdout
