"""Process-wide counters that prove which attention path ran (read by the harness).

Counting happens on the host in the metadata builder, once per step per layer group, from
host-side metadata (query_start_loc_cpu, seq_lens_cpu_upper_bound): no device reads, so CUDA-graph
replay is never synchronised. A "row" is one (request, layer) pair.

    from . import counters
    counters.reset(); ...timed window...; counters.snapshot()["sparse_decode_rows"]
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass

import torch


@dataclass
class _Counts:
    sparse_decode_rows: int = 0  # Locks decode rows with more pages than the page budget
    dense_fallback_rows: int = 0  # Locks decode rows whose pages all fit the budget (exact dense)
    crossover_dense_rows: int = 0  # Locks decode rows of steps that ran dense because it was cheaper (crossover.py)
    full_kv_rows: int = 0  # Locks decode rows whose request asked for exact attention (per-request selection)
    stock_decode_rows: int = 0  # decode rows that ran stock attention (sliding window, unsupported layer)
    prefill_rows: int = 0  # prefill/extend rows (always stock attention)
    stock_layer_calls: int = 0  # (layer, step) pairs whose decode rows ran stock attention
    sliding_window_calls: int = 0  # the part of stock_layer_calls due to a sliding window
    summaries_built: int = 0  # (physical page, layer) summaries written
    eager_build_calls: int = 0  # summary builds timed in build_ms (eager steps only)


_lock = threading.Lock()
_counts = _Counts()
_pending_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
_build_ms_cpu = 0.0
_build_ms_resolved = 0.0


def add(**deltas: int) -> None:
    """Add to named counters, e.g. add(sparse_decode_rows=3)."""
    with _lock:
        for name, delta in deltas.items():
            setattr(_counts, name, getattr(_counts, name) + delta)


def add_build_time_ms(ms: float) -> None:
    """Host-measured build time (CPU path, where the op is synchronous)."""
    global _build_ms_cpu
    with _lock:
        _build_ms_cpu += ms


def add_build_events(start: torch.cuda.Event, end: torch.cuda.Event) -> None:
    """CUDA events around an eager build; resolved lazily in snapshot() so the step never syncs."""
    with _lock:
        _pending_events.append((start, end))


def snapshot() -> dict[str, float | int]:
    """All counters plus build_ms (eager builds; decode-graph builds run inside the replay)."""
    global _build_ms_resolved
    with _lock:
        for start, end in _pending_events:
            end.synchronize()
            _build_ms_resolved += start.elapsed_time(end)
        _pending_events.clear()
        result: dict[str, float | int] = asdict(_counts)
        result["build_ms"] = _build_ms_cpu + _build_ms_resolved
        return result


def reset() -> None:
    global _counts, _build_ms_cpu, _build_ms_resolved
    with _lock:
        _counts = _Counts()
        _pending_events.clear()
        _build_ms_cpu = 0.0
        _build_ms_resolved = 0.0
