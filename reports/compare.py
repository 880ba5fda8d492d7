"""Two result sets side by side: every cell's value in A, in B, and the ratio B/A, for regressions."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import pandas as pd

from . import markdown as md
from .decode import SETUP_KEYS, decode_frame, setup_title
from .kernel import kernel_frame
from .microscope import METRICS as MICROSCOPE_METRICS, fidelity_table, microscope_frame
from .quality import budget_text, eval_frame, quality_table
from .records import RecordSet
from .schemas import DECODE, EVAL, KERNEL, MICROSCOPE


@dataclass(frozen=True)
class Measures:
    """One comparable table: key columns (with titles and formatters) and numeric metric columns."""

    title: str
    keys: Mapping[str, tuple[str, Callable[[object], str]]]
    metrics: Mapping[str, tuple[str, Callable[[object], str]]]
    frame_of: Callable[[RecordSet], pd.DataFrame]


def _digits(digits: int) -> Callable[[object], str]:
    return lambda value: md.fmt_num(value, digits)


def _decode_measures(record_set: RecordSet) -> pd.DataFrame:
    frame = decode_frame(record_set.get(DECODE))
    if frame.empty:
        return frame
    frame["setup"] = [setup_title(tuple(row)) for row in frame[SETUP_KEYS].itertuples(index=False)]
    frame["bytes"] = np.where(frame["dense"], frame["bytes_dense"], frame["bytes_locks"])
    return frame


def _quality_measures(record_set: RecordSet) -> pd.DataFrame:
    table = quality_table(eval_frame(record_set.get(EVAL)))
    if not table.empty:
        table["status"] = np.where(table["n"] > 0, "ok", "error")
        table["reason"] = table["failures"]
    return table


def _microscope_measures(record_set: RecordSet) -> pd.DataFrame:
    table = fidelity_table(microscope_frame(record_set.get(MICROSCOPE)))
    table["status"] = np.where(table["n"] > 0, "ok", "error")
    table["reason"] = table["failures"]
    return table


MEASURES = (
    Measures(
        "Decode cells",
        {"setup": ("Setup", str), "context_tokens": ("Context", md.fmt_tokens),
         "batch_size": ("Batch", str), "arm_label": ("Arm", str)},
        {"tpot_mean": ("TPOT ms", _digits(2)), "speedup": ("Speedup", md.fmt_ratio), "ttft_mean": ("Steady TTFT ms", _digits(1)),
         "build_ms": ("Build ms", _digits(0)), "bytes": ("KV bytes/step", md.fmt_bytes), "throughput_tok_s": ("tok/s", _digits(0))},
        _decode_measures,
    ),
    Measures(
        "Kernel profile (µs per layer)",
        {"geometry": ("Geometry", str), "context_tokens": ("Context", md.fmt_tokens), "batch_size": ("Batch", str),
         "budget_tokens": ("Budget", str), "stage": ("Stage", str)},
        {"us_per_layer": ("µs/layer", _digits(1)), "floor_fraction": ("Floor", md.fmt_pct)},
        lambda rs: kernel_frame(rs.get(KERNEL)),
    ),
    Measures(
        "Quality (mean score)",
        {"suite": ("Suite", str), "model": ("Model", str), "context_tokens": ("Context", md.fmt_tokens),
         "task": ("Task", str), "budget_sort": ("Budget", budget_text), "arm_label": ("Arm", str)},
        {"mean": ("Score", _digits(3))},
        _quality_measures,
    ),
    Measures(
        "Selection fidelity (microscope)",
        {"model": ("Model", str), "context_tokens": ("Context", md.fmt_tokens), "combine": ("Combine", str),
         "budget_tokens": ("Budget", str), "selector_label": ("Selector", str)},
        {m: (title, _digits(max(digits, 1))) for m, (title, _, digits) in MICROSCOPE_METRICS.items()},
        _microscope_measures,
    ),
)


def ratios(a: pd.DataFrame, b: pd.DataFrame, keys: list[str], metrics: list[str]) -> pd.DataFrame:
    """Outer join on `keys`: `<m>_a`, `<m>_b`, `<m>_ratio` (= b / a; NaN when either is absent or a is 0)."""
    columns = keys + metrics + ["status", "reason"]
    merged = pd.merge(a.reindex(columns=columns), b.reindex(columns=columns), on=keys, how="outer",
                      suffixes=("_a", "_b"), indicator="side", sort=True)
    for metric in metrics:
        num_a, num_b = merged[f"{metric}_a"].astype(float), merged[f"{metric}_b"].astype(float)
        with np.errstate(divide="ignore", invalid="ignore"):
            merged[f"{metric}_ratio"] = np.where((num_a != 0) & num_a.notna() & num_b.notna(), num_b / num_a, np.nan)
    return merged


def _side_text(row: pd.Series, metric: str, side: str, fmt: Callable[[object], str], notes: md.Notes, where: str) -> str:
    present = row["side"] in ("both", "left_only" if side == "a" else "right_only")
    if not present:
        return "absent"
    status = row[f"status_{side}"]
    if isinstance(status, str) and status != "ok":
        return notes.status_cell(status, row[f"reason_{side}"], f"{side.upper()}: {where}")
    return fmt(row[f"{metric}_{side}"])


def render_measures(spec: Measures, a: RecordSet, b: RecordSet, notes: md.Notes) -> str:
    frame_a, frame_b = spec.frame_of(a), spec.frame_of(b)
    if frame_a.empty and frame_b.empty:
        return ""
    keys = list(spec.keys)
    merged = ratios(frame_a, frame_b, keys, list(spec.metrics))
    rows = []
    for _, row in merged.iterrows():
        key_cells = [fmt(row[k]) for k, (_, fmt) in spec.keys.items()]
        where = " ".join(key_cells)
        cells = []
        for metric, (_, fmt) in spec.metrics.items():
            text = f"{_side_text(row, metric, 'a', fmt, notes, where)} → {_side_text(row, metric, 'b', fmt, notes, where)}"
            if not md.missing(row[f"{metric}_ratio"]):
                text += f" ({row[f'{metric}_ratio']:.3f}×)"
            cells.append(text)
        rows.append(key_cells + cells)
    header = [title for title, _ in spec.keys.values()] + [title for title, _ in spec.metrics.values()]
    return "\n".join([f"## {spec.title}: A → B (B/A)", "", md.table(header, rows, "l" * len(keys) + "r" * len(spec.metrics))])


def render_comparison_tables(a: RecordSet, b: RecordSet, notes: md.Notes) -> list[str]:
    return [text for spec in MEASURES if (text := render_measures(spec, a, b, notes))]
