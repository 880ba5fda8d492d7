"""TTFT and the summary build seen through it: which prefills a cell paid, the single-prefill TTFT, the
repeats (`measure_ttft`), and the build estimate from the first prefill after a decode against them."""

from __future__ import annotations

import statistics
from collections.abc import Callable

from .plan import DecodePlan
from .record_schemas import BUILD_SD_MULTIPLE


def prefill_protocol(plan: DecodePlan, context: int, with_ttft: bool) -> dict:
    """How many prefills the engine paid for this cell, and why (the record says which protocol ran)."""
    if plan.single_prefill(context):
        return {"mode": "single", "count": 1, "from_context": plan.single_prefill_from,
                "why": f"context >= single_prefill_from ({plan.single_prefill_from}): no warm-up prefill, the clock "
                       "ramp decodes on the measured requests, TTFT is this prefill (it includes one-time work)"}
    repeats = 1 + plan.ttft_repeats if with_ttft else 0
    return {"mode": "full", "count": 1 + repeats, "from_context": plan.single_prefill_from,
            "why": "measured prefill" + (f" + first-after-decode and {plan.ttft_repeats} steady TTFT prefills"
                                         if with_ttft else "") + " (the engine's warm-up prefill is not counted)"}


def single_prefill_ttft(pre, batch: int, counters: dict | None) -> dict:
    """TTFT at a single-prefill context: the measured prefill, the engine's first (so not steady)."""
    return {
        "batch_size": batch,
        "method": "single",
        "first_of_engine": pre.ttft_ms,
        "first_after_decode": None,
        "steady": [],
        "steady_mean": None,
        "steady_sd": None,
        "steady_median": None,
        "n": 0,
        "first_minus_steady_ms": None,
        "build_counters": counters,
        "build_counters_each": [counters] if counters is not None else [],
    }


def build_estimate(ttft: dict, sparse: bool) -> tuple[float | None, str]:
    """(build_ms, why): first prefill after a decode minus the steady mean, only when it stands out.

    A lazy backend builds summaries once, at the first prefill after a decode; ours builds them inside
    every prefill, so there the difference is noise (even negative) and the cost sits in steady TTFT.
    The estimate is published only above BUILD_SD_MULTIPLE sd of the steady repeats, else None.
    """
    if not sparse:
        return None, "dense arm: no summaries to build"
    steady = ttft.get("steady") or []
    if len(steady) < 2:
        return None, f"not estimated: {len(steady)} steady TTFT sample(s), at least 2 are needed for an sd"
    excess = ttft["first_after_decode"] - ttft["steady_mean"]
    threshold = BUILD_SD_MULTIPLE * ttft["steady_sd"]
    if excess > threshold and excess > 0:
        return excess, (f"first prefill after decode minus steady mean ({excess:.1f} ms) exceeds "
                        f"{BUILD_SD_MULTIPLE:g} sd of the steady samples ({threshold:.1f} ms)")
    return None, (f"not significant: first prefill after decode minus steady mean is {excess:.1f} ms, "
                  f"within {BUILD_SD_MULTIPLE:g} sd of the steady samples ({threshold:.1f} ms); a backend "
                  f"that builds summaries inside every prefill carries the cost in steady TTFT")


def measure_ttft(session, context: int, repeats: int, on_phase: Callable[[int, int], None] = lambda index, of: None) -> dict:
    """First prefill after decode (carries one-time work of a lazy backend) and `repeats` steady ones (batch 1);
    `on_phase(index, repeats)` before each.

    The backend counters (sparse arms) are read around every steady prefill: each delta is the summary
    work one prefill does (summaries built, eager build calls, their CUDA-event time); `build_counters`
    is the last one's.
    """
    on_phase(0, repeats)
    first = session.prefill(1, context, "ttft-first")
    session.abort(first.request_ids)
    steady, each = [], []
    for index in range(repeats):
        on_phase(index + 1, repeats)
        before = session.read_counters()
        again = session.prefill(1, context, "ttft")
        delta = counter_delta(before, session.read_counters())  # read before abort: aborting steps the engine
        if delta is not None:
            each.append(delta)
        session.abort(again.request_ids)
        steady.append(again.ttft_ms)
    build_counters = each[-1] if each else None
    return {
        "method": "repeats",
        "batch_size": 1,
        "first_after_decode": first.ttft_ms,
        "steady": steady,
        "steady_mean": statistics.fmean(steady),
        "steady_sd": statistics.stdev(steady) if len(steady) > 1 else 0.0,
        "steady_median": statistics.median(steady),
        "n": len(steady),
        "first_minus_steady_ms": first.ttft_ms - statistics.fmean(steady),
        "build_counters": build_counters,
        "build_counters_each": each,
    }


def counter_delta(start: dict | None, end: dict | None) -> dict | None:
    """The backend counters' change between two reads (None when either read found no counters)."""
    if start is None or end is None:
        return None
    return {key: end[key] - start.get(key, 0) for key in end if isinstance(end[key], (int, float))}
