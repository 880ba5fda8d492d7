"""Kernel profile: microseconds per layer for each stage, and how close each is to its bandwidth floor.

`locks bench kernel` writes one record per (preset, context, batch) with every stage in dicts
(`timings_us[stage].mean_us`, `bytes`, `floor_us`, `floor_fraction`); a record of one stage
(`cell.stage`, `us_per_layer`, ...) is read too. A failed cell fills every stage column of its row.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from . import markdown as md
from .records import Record, dig, status_of

ROW_KEYS = ["geometry", "context_tokens", "batch_size", "budget_tokens"]
KEYS = ROW_KEYS + ["stage"]
WHOLE_CELL = "*"  # the stage of a failed multi-stage record
# Pipeline order, then the dense baselines; stages not listed follow alphabetically.
STAGE_ORDER = ("build", "summarize", "score", "select", "select_flat", "score_select", "decode_pages", "merge", "decode",
               "attend", "sparse_attend",
               "locks_step", "triton_dense", "fa3", "flashinfer", "sdpa", "dense_attend", "total")


def _num(value) -> float:
    if isinstance(value, dict):  # timings_us[stage] = {mean_us, min_us, ...}
        value = value.get("mean_us")
    return np.nan if value is None else float(value)


def _rows(record: Record) -> list[dict]:
    cell = record.get("cell") or {}
    status, reason = status_of(record)
    geometry = str(cell.get("geometry") or cell.get("preset") or dig(record, "geometry", "name", default="?"))
    if cell.get("format"):
        geometry += f" {cell['format']}"
    settings = [f"{key}={str(cell[key]).lower()}" for key in ("select", "scorer_kernel", "pdl") if key in cell]  # pdl: older records
    if settings:  # a cell names only the backend settings that differ from the deployed ones
        geometry += f" [{','.join(settings)}]"
    base = {
        "geometry": geometry,
        "context_tokens": int(cell.get("context_tokens") or 0),
        "batch_size": int(cell.get("batch_size") or 1),
        "budget_tokens": int(cell.get("budget_tokens") or 0),
        "status": status,
        "reason": reason,
        "date": str(dig(record, "provenance", "date", default="")),
        "speedup_vs_dense": _num(record.get("speedup_vs_dense")),
        "best_dense": str(record.get("best_dense") or ""),
        # the code paths timed (records from before the bench named them: blank)
        "kernels": " / ".join(str(dig(record, "kernels", key)) for key in ("score", "select")) if record.get("kernels") else "",
    }
    if isinstance(record.get("timings_us"), dict):
        stages = {name: (_num(t), record.get("bytes", {}).get(name), dig(record, "floor_us", name),
                         dig(record, "floor_fraction", name)) for name, t in record["timings_us"].items()}
    elif cell.get("stage") is not None:
        stages = {str(cell["stage"]): (_num(record.get("us_per_layer")), record.get("bytes"),
                                       record.get("floor_us"), record.get("floor_fraction"))}
    else:
        stages = {WHOLE_CELL: (np.nan, None, None, None)}
    rows = []
    for stage, (us, nbytes, floor_us, fraction) in stages.items():
        if fraction is None and floor_us is not None and us > 0:
            fraction = floor_us / us
        rows.append({**base, "stage": stage, "us_per_layer": us, "bytes": _num(nbytes),
                     "floor_us": _num(floor_us), "floor_fraction": _num(fraction)})
    return rows


def stage_rank(stage: str) -> tuple[int, str]:
    return (STAGE_ORDER.index(stage), "") if stage in STAGE_ORDER else (len(STAGE_ORDER), stage)


def kernel_frame(records: Sequence[Record]) -> pd.DataFrame:
    """One row per (geometry, context, batch, budget, stage); the newest record of a repeated cell wins."""
    if not records:
        return pd.DataFrame(columns=KEYS)
    frame = pd.DataFrame([row for r in records for row in _rows(r)]).sort_values(KEYS + ["date"], kind="stable")
    frame["superseded"] = frame.groupby(KEYS)["date"].transform("size") - 1
    return frame.drop_duplicates(KEYS, keep="last").reset_index(drop=True)


def cell_name(row: pd.Series) -> str:
    stage = "" if row["stage"] == WHOLE_CELL else f" {row['stage']}"
    return f"kernel {row['geometry']}{stage} @ {md.fmt_tokens(row['context_tokens'])} bs{row['batch_size']} b={row['budget_tokens']}"


def _stage_cell(cells: pd.DataFrame, stage: str, notes: md.Notes) -> str:
    hit = cells[cells["stage"] == stage]
    if hit.empty:
        hit = cells[cells["stage"] == WHOLE_CELL]
        if hit.empty:
            return md.DASH
    cell = hit.iloc[0]
    if cell["status"] != "ok":
        return notes.status_cell(cell["status"], cell["reason"], cell_name(cell))
    text = f"{md.fmt_num(cell['us_per_layer'], 1)} ({md.fmt_pct(cell['floor_fraction'])})"
    if cell["superseded"]:
        text += notes.mark(f"{cell_name(cell)}: {cell['superseded']} older record(s) superseded")
    return text


def render_kernel(frame: pd.DataFrame, notes: md.Notes) -> str:
    """One table per geometry: rows (context, batch, budget), a column per stage, `µs (floor %)`."""
    if frame.empty:
        return ""
    parts = ["## Kernel profile (µs per layer; % of the bandwidth floor reached)"]
    for geometry, group in frame.groupby("geometry", sort=True):
        stages = sorted((s for s in group["stage"].unique() if s != WHOLE_CELL), key=stage_rank) or [WHOLE_CELL]
        with_speedup = group["speedup_vs_dense"].notna().any()
        with_kernels = (group["kernels"] != "").any()
        rows = []
        for (context, batch, budget), cells in group.groupby(ROW_KEYS[1:], sort=True):
            row = [md.fmt_tokens(context), str(batch), str(budget)] + [_stage_cell(cells, s, notes) for s in stages]
            if with_kernels:
                row.append(cells.iloc[0]["kernels"] or md.DASH)
            if with_speedup:
                first = cells.iloc[0]
                best = f" ({first['best_dense']})" if first["best_dense"] else ""
                row.append(md.fmt_ratio(first["speedup_vs_dense"]) + (best if not md.missing(first["speedup_vs_dense"]) else ""))
            rows.append(row)
        header = ["Context", "Batch", "Budget"] + ["stages" if s == WHOLE_CELL else s for s in stages]
        header += ["Kernels (score / select)"] if with_kernels else []
        header += ["Speedup vs best dense"] if with_speedup else []
        parts += ["", f"### {geometry}", "", md.table(header, rows)]
    return "\n".join(parts)
