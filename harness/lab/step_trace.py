"""Where a decode step's time goes: torch.profiler over a few engine steps of one arm.

The matched pair gives one number per step (TPOT); the kernel profile times Locks' kernels alone.
When the two disagree (once ~14 µs per layer of the Locks-vs-FA3 gap was in neither), this
traces the real engine: one prompt of `context` tokens, `warm_steps` untraced decode steps, then
`steps` decode steps inside the profiler, each wrapped in a named range. Per step it reports the wall
time, the device time covered by kernels (union of their intervals), the idle rest, the kernel count
and the kernels that take the most time per step. On a CPU engine (tests) the activities are the
step's top-level CPU ops instead of kernels. The chrome trace is written next to the record.

    locks bench trace --arm locks --context 128k --layers 40 --budget 2048 --out runs/trace
"""

from __future__ import annotations

import gzip
import json
import logging
import os
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..arms import arm_file_stem, get_arm
from ..plan import DecodePlan

log = logging.getLogger(__name__)

SCHEMA_TRACE = "locks.bench.trace/1"
STEP_RANGE = "locks_trace_step_"
TOP_ACTIVITIES = 15
TOP_IDLE = 6
IDLE_GAP_US = 5.0  # longer than any launch gap inside a CUDA graph (~0.4-1 µs on the H200)


@dataclass(frozen=True)
class Activity:
    """One kernel (or CPU op) on the profiler's clock, µs."""

    name: str
    start_us: float
    end_us: float

    @property
    def duration_us(self) -> float:
        return self.end_us - self.start_us


def covered_us(activities: Sequence[Activity], start_us: float, end_us: float) -> float:
    """Length of the union of the activities' intervals clipped to [start_us, end_us]."""
    spans = sorted((max(a.start_us, start_us), min(a.end_us, end_us)) for a in activities)
    total, reach = 0.0, start_us
    for lo, hi in spans:
        if hi <= reach:
            continue
        total += hi - max(lo, reach)
        reach = hi
    return total


def summarize_steps(activities: Sequence[Activity], windows: Sequence[tuple[float, float]],
                    top: int = TOP_ACTIVITIES, device_windows: Sequence[tuple[float, float]] | None = None) -> dict:
    """Per-step wall / busy / idle time and activity counts, plus the activities taking the most time per step.

    `windows` are the steps' host ranges (the wall time). An activity belongs to the step whose window
    contains its start: the step's device range when `device_windows` has one per step (on the GPU a
    step's kernels run after its host range has moved on: assigned by host ranges, an H200 trace
    had every other step own two steps' kernels), else its host range. A step's busy time counts its own
    activities wherever they run.
    """
    if not windows:
        raise ValueError("no step windows: the traced steps recorded no ranges")
    windows = sorted(windows)
    owners = sorted(device_windows) if device_windows and len(device_windows) == len(windows) else windows
    per_step: list[list[Activity]] = [[] for _ in windows]
    starts = [w[0] for w in owners]
    for activity in activities:
        index = next((i for i in range(len(windows) - 1, -1, -1) if starts[i] <= activity.start_us), None)
        if index is not None:
            per_step[index].append(activity)
    steps = []
    for (start, end), own in zip(windows, per_step):
        wall = end - start
        busy = covered_us(own, min([start] + [a.start_us for a in own]), max([end] + [a.end_us for a in own]))  # all of it
        steps.append({"wall_us": wall, "busy_us": busy, "idle_us": max(wall - busy, 0.0),
                      "activity_us": sum(a.duration_us for a in own), "activities": len(own)})
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for own in per_step:
        for activity in own:
            totals[activity.name][0] += activity.duration_us
            totals[activity.name][1] += 1
    n = len(windows)
    ranked = sorted(totals.items(), key=lambda item: -item[1][0])[:top]
    return {
        "steps": n,
        "mean": {key: sum(step[key] for step in steps) / n for key in steps[0]},
        "per_step": steps,
        "top": [{"name": name, "us_per_step": total / n, "calls_per_step": calls / n} for name, (total, calls) in ranked],
        "idle_before": idle_before([a for own in per_step for a in own], n),
    }


def idle_before(activities: Sequence[Activity], steps: int, min_gap_us: float = IDLE_GAP_US,
                top: int = TOP_IDLE) -> list[dict]:
    """Idle device time per step grouped by the activity that ends each gap (gaps over `min_gap_us`).

    Inside a CUDA graph consecutive kernels sit < 1 µs apart; the long gaps are where the device waits
    for the host (scheduling, metadata builders, input copies, the graph launch), and the activity after
    a gap says which phase of the step it precedes."""
    gaps: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    reach = None
    for activity in sorted(activities, key=lambda a: a.start_us):
        if reach is not None and activity.start_us - reach > min_gap_us:
            gaps[activity.name][0] += activity.start_us - reach
            gaps[activity.name][1] += 1
        reach = activity.end_us if reach is None else max(reach, activity.end_us)
    ranked = sorted(gaps.items(), key=lambda item: -item[1][0])[:top]
    return [{"name": name, "us_per_step": total / steps, "gaps_per_step": count / steps} for name, (total, count) in ranked]


def activities_from_profile(events, device: str) -> tuple[list[Activity], list[tuple[float, float]], list[tuple[float, float]]]:
    """(kernels or, on CPU, the steps' top-level ops; the steps' host ranges; their device ranges) from
    torch.profiler events. A `record_function` range appears twice on the GPU: once on the host and once
    as the span of the kernels it launched; the latter are not activities themselves."""
    from torch.autograd import DeviceType

    def ranges(kind):
        return [(e.time_range.start, e.time_range.end) for e in events if e.name.startswith(STEP_RANGE) and e.device_type == kind]

    if device == "cuda":
        chosen = [e for e in events if e.device_type == DeviceType.CUDA and not e.name.startswith(STEP_RANGE)]
    else:  # CPU ops whose parent is a step range: each op counted once, not with its children
        chosen = [e for e in events if e.device_type == DeviceType.CPU and e.cpu_parent is not None
                  and e.cpu_parent.name.startswith(STEP_RANGE)]
    return ([Activity(e.name, e.time_range.start, e.time_range.end) for e in chosen], ranges(DeviceType.CPU),
            ranges(DeviceType.CUDA))


def activities_from_chrome_trace(path: str | Path) -> tuple[list[Activity], list[tuple[float, float]], list[tuple[float, float]]]:
    """`activities_from_profile` of a stored chrome trace (`.json` or `.json.gz`, as `trace_arm` writes
    it): the GPU's kernels and copies, the steps' host ranges and their device ranges."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as handle:
        events = json.load(handle)["traceEvents"]

    def ranges(category):
        return [(e["ts"], e["ts"] + e["dur"]) for e in events
                if e.get("cat") == category and e.get("name", "").startswith(STEP_RANGE)]

    kernels = [Activity(e["name"], e["ts"], e["ts"] + e["dur"]) for e in events
               if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    return kernels, ranges("user_annotation"), ranges("gpu_user_annotation")


def trace_arm(plan: DecodePlan, arm_name: str, context: int, budget: int | None, steps: int, warm_steps: int,
              out_dir: str | Path) -> dict:
    """Profile `steps` decode steps of one arm at one context (batch 1); returns the trace record."""
    import torch

    from .. import provenance as prov
    from ..presets import ModelGeometry
    from ..runner import resolve_model
    from ..session import EngineSession
    from ..worker import EngineJob, job_environment

    if steps < 1 or warm_steps < 0:
        raise ValueError(f"steps {steps} must be >= 1 and warm_steps {warm_steps} >= 0")
    arm = get_arm(arm_name)
    model_dir, config, dummy, _ = resolve_model(plan)
    geometry = ModelGeometry.from_config(config, plan.dtype)
    job = EngineJob(plan, arm_name, context, budget if arm.sparse else None, (1,), model_dir, dummy, geometry,
                    int(config.get("vocab_size", 32000)), measure_ttft=False)
    os.environ.update(job_environment(job))  # before vLLM is imported by the session
    session = EngineSession(plan, arm_name, model_dir, dummy, job.knobs, job.vocab_size)
    try:
        prefill = session.prefill(1, context, "trace")
        session.decode(prefill.request_ids, warm_steps)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if arm.device == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        step_ms = []
        with torch.profiler.profile(activities=activities) as profiler:
            for index in range(steps):
                with torch.profiler.record_function(f"{STEP_RANGE}{index}"):
                    step_ms += session.decode(prefill.request_ids, 1).step_ms
        session.abort(prefill.request_ids)
    finally:
        if plan.tensor_parallel_size > 1:
            session.close()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    trace_file = out_dir / f"trace-{arm_file_stem(arm_name)}-{context}.json"
    profiler.export_chrome_trace(str(trace_file))
    found, windows, device_windows = activities_from_profile(profiler.events(), arm.device)
    summary = summarize_steps(found, windows, device_windows=device_windows)
    log.info("%s @ %d: %.0f µs per step, device busy %.0f µs, %.0f activities", arm_name, context,
             summary["mean"]["wall_us"], summary["mean"]["busy_us"], summary["mean"]["activities"])
    return {"schema": SCHEMA_TRACE, "kind": "trace", "status": "ok", "reason": "",
            "cell": {"arm": arm_name, "context_tokens": context, "budget_tokens": job.budget, "batch_size": 1,
                     "layers": geometry.num_layers, "graph_mode": plan.graph_mode,
                     "async_scheduling": plan.async_scheduling},
            "step_ms": step_ms, "summary": summary, "activity": "kernels" if arm.device == "cuda" else "cpu ops",
            "trace_file": str(trace_file), "provenance": prov.collect(schema=SCHEMA_TRACE)}


def markdown(record: dict, top: int = 10) -> str:
    """The record as a short markdown summary: mean step split and the costliest activities."""
    cell = record["cell"]
    title = f"{cell['arm']} @ {cell['context_tokens']} tokens, {cell['layers']} layers ({record['activity']})"
    return summary_markdown(title, record["summary"], top)


def summary_markdown(title: str, summary: dict, top: int = 10) -> str:
    """`summarize_steps`' result under a heading: mean step split, costliest activities, idle gaps."""
    mean = summary["mean"]
    lines = [f"### {title}", "",
             (f"wall {mean['wall_us']:.0f} µs per step; busy {mean['busy_us']:.0f} µs, idle {mean['idle_us']:.0f} µs; "
              f"{mean['activities']:.0f} activities per step"), "",
             "| activity | µs per step | calls per step |", "| :--- | ---: | ---: |"]
    lines += [f"| `{t['name'][:80]}` | {t['us_per_step']:.1f} | {t['calls_per_step']:.1f} |" for t in summary["top"][:top]]
    idle = summary.get("idle_before") or []
    if idle:
        lines += ["", f"| device idle (gaps > {IDLE_GAP_US:g} µs) before | µs per step | gaps per step |", "| :--- | ---: | ---: |"]
        lines += [f"| `{g['name'][:80]}` | {g['us_per_step']:.1f} | {g['gaps_per_step']:.1f} |" for g in idle]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m locks_toolkit.harness.lab.step_trace TRACE.json[.gz] ...`: summarize stored chrome traces again."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("traces", nargs="+", help="chrome traces written by `locks bench trace`")
    args = parser.parse_args(argv)
    for path in args.traces:
        found, windows, device_windows = activities_from_chrome_trace(path)
        sys.stdout.write(summary_markdown(Path(path).name, summarize_steps(found, windows, device_windows=device_windows)) + "\n\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
