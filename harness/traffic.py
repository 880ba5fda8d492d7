"""Bytes read per decode step and the floor time they imply; step-time statistics.

Dense: every KV byte of the live context, all layers and KV heads. Locks: every summary row of the
full pages (scanned to score them) plus the K and V of the k selected pages (sink and recent pages
count inside the budget). Partially filled pages count as full pages: an upper bound of at most one
page per (request, layer, KV head).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..kernels.config import PAGE_SIZE, SelectionConfig, SummaryFormat
from .presets import ModelGeometry
from .ranks import per_gpu_weights
from .record_schemas import FLOOR_KV_ONLY, FLOOR_RECORDED


def summary_row_bytes(fmt: SummaryFormat, head_dim: int, page_size: int = PAGE_SIZE) -> int:
    """Bytes of one packed summary row: the kernels' SummaryLayout when present, else its documented formula."""
    try:
        from ..kernels.build.packing import SummaryLayout

        return int(SummaryLayout(fmt, head_dim, page_size).row_bytes)
    except (ImportError, AttributeError, TypeError):
        return row_bytes_formula(fmt, head_dim, page_size)


def row_bytes_formula(fmt: SummaryFormat, head_dim: int, page_size: int = PAGE_SIZE) -> int:
    """docs/architecture.md's packed row: payload + float16 scales, padded to 64 bytes."""
    rank, bits = fmt.rank, fmt.basis_bits
    if bits is None:  # fp16 centroid, coefficients and basis; no scales
        payload, scales = 2 * (head_dim + page_size * rank + head_dim * rank), 0
    else:
        payload = head_dim + page_size * rank + math.ceil(head_dim * rank * bits / 8)
        scales = 2 * (1 + page_size + rank)
    return -(-(payload + scales) // 64) * 64


def dense_bytes_per_step(geometry: ModelGeometry, live_tokens: Sequence[int]) -> int:
    """KV bytes of the whole live context of every request of the batch."""
    return int(sum(live_tokens)) * geometry.kv_bytes_per_token


def locks_bytes_per_step(
    geometry: ModelGeometry, live_tokens: Sequence[int], budget_tokens: int, fmt: SummaryFormat
) -> dict[str, int]:
    """Summary bytes scanned + KV bytes of the selected pages, summed over the batch."""
    page_budget = SelectionConfig(budget_tokens=budget_tokens).page_budget
    row = summary_row_bytes(fmt, geometry.head_dim)
    heads = geometry.num_layers * geometry.num_kv_heads
    page_kv = 2 * PAGE_SIZE * geometry.head_dim * geometry.kv_dtype_bytes
    summary = selected = 0
    for tokens in live_tokens:
        pages = -(-int(tokens) // PAGE_SIZE)
        summary += (int(tokens) // PAGE_SIZE) * row * heads
        selected += min(page_budget, pages) * page_kv * heads
    return {"summary_bytes": summary, "selected_kv_bytes": selected, "total": summary + selected,
            "summary_row_bytes": row, "page_budget": page_budget}


def floor_ms(num_bytes: int, bytes_per_s: float) -> float:
    """Time to stream `num_bytes` at the measured copy bandwidth."""
    return num_bytes / bytes_per_s * 1e3


def step_stats(step_ms: Sequence[float], batch: int) -> dict:
    """mean/sd/p50/p99/min/max over timed steps (all ms), their count n, cv = sd/mean, tokens per second."""
    values = np.asarray(step_ms, dtype=np.float64)
    if values.size == 0:
        return {"n": 0}
    mean = float(values.mean())
    sd = float(values.std(ddof=1)) if values.size > 1 else 0.0
    return {
        "n": int(values.size),
        "mean": mean,
        "sd": sd,
        "cv": sd / mean if mean > 0 else None,
        "p50": float(np.percentile(values, 50)),
        "p99": float(np.percentile(values, 99)),
        "min": float(values.min()),
        "max": float(values.max()),
        "tokens_per_s": batch * 1e3 / mean if mean > 0 else None,
    }


@dataclass(frozen=True)
class FloorBasis:
    """What an engine's byte floors stand on: the weight bytes a step reads (None: unknown) and the rate
    bytes move at, with where that rate came from (harness/bandwidth.py: measured at boot, or the plan's)."""

    weights: dict | None
    bandwidth_bytes_per_s: float
    bandwidth_source: str


def cell_bytes(plan, geometry: ModelGeometry, context: int, budget: int | None, batch: int, basis: FloorBasis,
               decoded_before: int = 0) -> dict:
    """Bytes per decode step at the live length mid-measurement (the prompt, the tokens decoded before the
    cell, settle and half the windows): attention ({dense, locks}), weights, and the floors: floor_ms of
    the attention bytes alone, step_floor_ms of weights + attention bytes, both at the basis' rate."""
    rate, weights = basis.bandwidth_bytes_per_s, basis.weights
    live = context + decoded_before + plan.settle_steps + plan.windows * plan.steps_per_window // 2
    tokens = [live] * batch
    dense = dense_bytes_per_step(geometry, tokens)
    out = {"dense": dense, "locks": None, "live_tokens": live, "bandwidth_bytes_per_s": rate,
           "bandwidth_source": basis.bandwidth_source}
    if budget is not None:
        parts = locks_bytes_per_step(geometry, tokens, budget, SummaryFormat.parse(plan.summary_format))
        out.update(locks=parts["total"], summary_bytes=parts["summary_bytes"],
                   selected_kv_bytes=parts["selected_kv_bytes"], summary_row_bytes=parts["summary_row_bytes"],
                   page_budget=parts["page_budget"])
    attention = out["locks"] if out["locks"] is not None else dense
    out["weights"] = weights["read_per_step"] if weights else None
    out["weights_source"] = weights["source"] if weights else None
    out["step_bytes"] = attention + out["weights"] if weights else None
    # dense/locks/weights/step_bytes above are totals over all GPUs. Under TP each rank reads its own
    # num_kv_heads / tp heads and weight shard and the ranks stream in parallel, so the floors are one
    # GPU's bytes over one GPU's bandwidth (at TP = 1 per GPU and total coincide).
    tp = plan.tensor_parallel_size
    per_gpu_attention = attention // tp  # exact: tp divides the KV heads (plan validation)
    per_gpu_weight = per_gpu_weights(weights, tp)
    out["tensor_parallel_size"] = tp
    out["per_gpu"] = {
        "attention": per_gpu_attention,
        "weights": per_gpu_weight,
        "step_bytes": per_gpu_attention + per_gpu_weight if per_gpu_weight is not None else None,
    }
    out["floor_ms"] = floor_ms(per_gpu_attention, rate)
    step_gpu = out["per_gpu"]["step_bytes"]
    if step_gpu is not None:
        out["step_floor_ms"], out["step_floor_basis"] = floor_ms(step_gpu, rate), FLOOR_RECORDED
    else:
        out["step_floor_ms"], out["step_floor_basis"] = out["floor_ms"], FLOOR_KV_ONLY
        out["step_floor_why"] = "the weight bytes of this model are not known (harness/weights.py)"
    return out
