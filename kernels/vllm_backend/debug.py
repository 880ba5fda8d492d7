"""Opt-in capture of per-step decode tensors (additional_config locks.debug_capture_layers).

Eager only: CUDA-graph replays run no Python, so nothing is recorded there. Each record holds
host copies; the KV cache is referenced (not copied) because pages are append-only, so the final
cache reproduces any earlier step given that step's seq_lens.
"""

from __future__ import annotations

import re

import torch

captures: list[dict] = []
_LAYER_RE = re.compile(r"layers\.(\d+)\.")


def layer_index(layer_name: str) -> int:
    match = _LAYER_RE.search(layer_name + ".")
    return int(match.group(1)) if match else -1


def _host_copy(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    # copy=True: on the CPU backend `.cpu()` / `.to("cpu", float32)` return the live buffer itself
    # (persistent selection scratch, reused query/output), which the next step overwrites.
    return t.detach().to("cpu", dtype or t.dtype, copy=True)


def record(layer_name: str, q, block_table, seq_lens, selected_pages, out, k_cache, v_cache, scale: float,
           summary_rows=None, selection: dict | None = None) -> None:
    """One decode step of one layer. summary_rows (referenced like the cache: a page's row is written once
    it completes) and selection (layout, num_kv_heads, page_budget, combine, select) let the step's
    selection be replayed outside the engine (`harness/lab/selection_replay.py`)."""
    captures.append(
        {
            "layer": layer_name,
            "q": _host_copy(q, torch.float32),
            "q_dtype": q.dtype,
            "block_table": _host_copy(block_table),
            "seq_lens": _host_copy(seq_lens),
            "selected_pages": _host_copy(selected_pages),
            "out": _host_copy(out, torch.float32),
            "k_cache": k_cache,
            "v_cache": v_cache,
            "scale": scale,
            "summary_rows": summary_rows,
            "selection": selection or {},
        }
    )


def clear() -> None:
    captures.clear()
