"""Checks of the backend's decode captures (debug.py) against fp32 torch references.

`check_oracle_captures` (harness/lab/backend_check.py): the oracle scorer's selection recomputed from the keys, and the
kernel's output vs attention over the captured pages. `check_rank_captures` (any scorer, one process,
so one TP rank): the output vs attention over the captured pages, the sink and recent pages kept, the
page ids valid and distinct; it returns a small JSON-able dict, with the selections and queries of one
layer per step, which the TP check (harness/lab/tp_check.py) gathers from every rank and compares across TP.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..config import PAGE_SIZE

BF16_ATOL, BF16_RTOL = 2e-2, 2e-2
_FAULTS_KEPT = 8  # the first faults are named in the result; the rest are only counted


def capture_inputs(cap: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, block_table, seq_lens, selected_pages) of a capture, on its KV cache's device."""
    device = cap["k_cache"].device
    return (cap["q"].to(device), cap["block_table"].to(device), cap["seq_lens"].to(device),
            cap["selected_pages"].to(device))


def sparse_reference(cap: dict) -> torch.Tensor:
    """fp32 [S, Hq, d]: torch attention over the captured pages of each (sequence, KV head)."""
    from ..decode.reference import paged_decode_reference

    q, table, seq_lens, selected = capture_inputs(cap)
    return paged_decode_reference(q, cap["k_cache"], cap["v_cache"], table, seq_lens, cap["scale"], selected.long())


def excess_error(out: torch.Tensor, ref: torch.Tensor, rtol: float = BF16_RTOL) -> float:
    """max(|out - ref| - rtol |ref|): passes at <= atol; NaN anywhere counts as infinite."""
    err = ((out.to(ref.device, torch.float32) - ref).abs() - rtol * ref.abs()).max().item()
    return math.inf if math.isnan(err) else err


def check_oracle_captures(page_budget: int, captures: Sequence[dict] | None = None) -> dict:
    """Each captured decode step: oracle selection recomputed from the keys, and the kernel's output
    vs fp32 torch attention over the captured pages (and vs dense, to show the check can fail)."""
    from ..config import scored_pages
    from ..decode.reference import paged_decode_reference
    from ..score.reference import exact_page_scores
    from ..select.reference import combine_group, select_pages
    from . import debug

    captures = debug.captures if captures is None else captures
    worst_err, worst_dense_gap, selection_mismatch = 0.0, float("inf"), 0
    for cap in captures:
        k_cache, v_cache = cap["k_cache"], cap["v_cache"]
        device = k_cache.device
        q, table, seq_lens, selected = capture_inputs(cap)
        num_kv_heads = k_cache.shape[2]
        group = q.shape[1] // num_kv_heads
        for row, length in enumerate(cap["seq_lens"].tolist()):
            num_pages, full = -(-length // 16), scored_pages(length)
            keys = k_cache[table[row, :full].long()].permute(2, 0, 1, 3)  # [Hkv, full, 16, d]
            scores = torch.full((num_kv_heads, group, num_pages), float("-inf"), device=device)
            scores[..., :full] = exact_page_scores(q[row].reshape(num_kv_heads, group, -1), keys, cap["scale"])
            mask = (torch.arange(num_pages, device=device) < full).expand(num_kv_heads, num_pages)
            want = select_pages(combine_group(scores, "share_average", mask), num_pages, page_budget)
            selection_mismatch += int(not torch.equal(want, selected[row].long()))
        sparse_ref = sparse_reference(cap)
        dense_ref = paged_decode_reference(q, k_cache, v_cache, table, seq_lens, cap["scale"], None)
        out = cap["out"].to(device)
        worst_err = max(worst_err, excess_error(out, sparse_ref))  # NaN counts as infinite
        worst_dense_gap = min(worst_dense_gap, (out - dense_ref).abs().max().item())
    return {"captures": len(captures), "selection_mismatches": selection_mismatch,
            "max_excess_error": worst_err, "min_max_gap_to_dense": worst_dense_gap,
            "discriminating": worst_dense_gap > 10 * BF16_ATOL,  # sparse != dense by far more than the tolerance
            "pass": bool(captures) and selection_mismatch == 0 and worst_err <= BF16_ATOL}


def selection_faults(selected: torch.Tensor, seq_lens: Sequence[int]) -> list[str]:
    """What is wrong with int [S, Hkv, k] logical page ids (-1 padded) of sequences of `seq_lens` tokens.

    With n pages > k: k distinct ids in [0, n) that include the sink page 0 and the recent page n - 1.
    With n <= k (dense fallback): exactly the pages 0..n-1. Rows of length 0 (padding) are skipped.
    """
    faults = []
    width = selected.shape[-1]
    for row, length in enumerate(seq_lens):
        if length <= 0:
            continue
        num_pages = -(-int(length) // PAGE_SIZE)
        for head, ids in enumerate(selected[row].tolist()):
            where = f"row {row} (seq_len {length}, {num_pages} pages) KV head {head}"
            pages = [p for p in ids if p != -1]
            if any(p < 0 or p >= num_pages for p in pages):
                faults.append(f"{where}: page ids outside [0, {num_pages}): {sorted(pages)}")
            elif len(set(pages)) != len(pages):
                faults.append(f"{where}: duplicate page ids {sorted(pages)}")
            elif num_pages > width and (0 not in pages or num_pages - 1 not in pages):
                faults.append(f"{where}: sink page 0 or recent page {num_pages - 1} not selected")
            elif num_pages > width and len(pages) != width:
                faults.append(f"{where}: {len(pages)} pages selected of a budget of {width}")
            elif num_pages <= width and sorted(pages) != list(range(num_pages)):
                faults.append(f"{where}: dense fallback must select every page, got {sorted(pages)}")
    return faults


def _step_detail(index: int, cap: dict, excess: float) -> dict:
    """One capture as plain lists: seq_lens [S], selected [S][Hkv][pages ascending], q [S][Hq][d], and
    its excess error (so a failing record names the step)."""
    selected = [[sorted(p for p in head if p != -1) for head in row] for row in cap["selected_pages"].tolist()]
    q = cap["q"].float()
    return {"index": index, "layer": cap["layer"], "seq_lens": cap["seq_lens"].tolist(), "selected": selected,
            "q": q.tolist(), "q_abs_max": q.abs().max().item() if q.numel() else 0.0, "excess_error": excess}


def check_rank_captures(captures: Sequence[dict] | None = None, detail_layer: int | None = 0,
                        atol: float = BF16_ATOL, rtol: float = BF16_RTOL) -> dict:
    """This process's captures (default: debug.captures) checked without an oracle -> JSON-able dict.

    Per capture: the kernel's output vs fp32 attention over the captured pages (excess error
    |out - ref| - rtol |ref| <= atol) and `selection_faults`. `steps` lists the captures of layer
    `detail_layer` in decode order (`_step_detail`; None: no details).
    """
    from . import debug

    captures = debug.captures if captures is None else captures
    worst: float | None = None
    worst_abs = 0.0
    faults: list[str] = []
    steps = []
    for cap in captures:
        live = cap["seq_lens"] > 0  # padded rows (seq_len 0) attend nothing; their output is never read
        out, ref = cap["out"][live].float(), sparse_reference(cap)[live.to(cap["k_cache"].device)].cpu()
        err = excess_error(out, ref, rtol) if out.numel() else 0.0
        worst = err if worst is None else max(worst, err)
        worst_abs = max(worst_abs, (out - ref).abs().max().item() if out.numel() else 0.0)
        faults += [f"{cap['layer']}: {fault}" for fault in selection_faults(cap["selected_pages"], cap["seq_lens"].tolist())]
        if detail_layer is not None and debug.layer_index(cap["layer"]) == detail_layer:
            steps.append(_step_detail(len(steps), cap, err))
    return {
        "captures": len(captures),
        "layers": sorted({debug.layer_index(cap["layer"]) for cap in captures}),
        "max_excess_error": worst,
        "max_abs_error": worst_abs,
        "atol": atol,
        "rtol": rtol,
        "selection_faults": len(faults),
        "faults": faults[:_FAULTS_KEPT],
        "pass": bool(captures) and worst is not None and worst <= atol and not faults,
        "detail_layer": detail_layer,
        "steps": steps,
    }
