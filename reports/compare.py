"""Two result sets side by side: every cell's value in A, in B (each with its n and 95% CI where the
measure has them), and the ratio B/A, for regressions. A cell measured in several runs compares its
latest run."""

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
    n: str | None = None  # the column holding each cell's sample count
    ci: Mapping[str, tuple[str, str]] | None = None  # metric -> (low, high) columns of its 95% CI


def _digits(digits: int) -> Callable[[object], str]:
    return lambda value: md.fmt_num(value, digits)


# A normal 95% interval of the mean TPOT over a cell's timed steps. Steps are not independent (clock
# and scheduler drift span windows), so it is a lower bound on the run-to-run spread: repeat runs for that.
Z95 = 1.96


def _decode_measures(record_set: RecordSet) -> pd.DataFrame:
    frame = decode_frame(record_set.get(DECODE), runs="latest")
    if frame.empty:
        return frame
    frame["setup"] = [setup_title(tuple(row)) for row in frame[SETUP_KEYS].itertuples(index=False)]
    frame["bytes"] = np.where(frame["dense"], frame["bytes_dense"], frame["bytes_locks"])
    half = Z95 * frame["tpot_sd"].astype(float) / np.sqrt(frame["tpot_n"].astype(float))
    frame["tpot_low"], frame["tpot_high"] = frame["tpot_mean"] - half, frame["tpot_mean"] + half
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
        n="tpot_n",
        ci={"tpot_mean": ("tpot_low", "tpot_high")},
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
        n="n",
        ci={"mean": ("low", "high")},
    ),
    Measures(
        "Selection fidelity (microscope)",
        {"model": ("Model", str), "context_tokens": ("Context", md.fmt_tokens), "combine": ("Combine", str),
         "budget_tokens": ("Budget", str), "selector_label": ("Selector", str)},
        {m: (title, _digits(max(digits, 1))) for m, (title, _, digits) in MICROSCOPE_METRICS.items()},
        _microscope_measures,
        n="n",
    ),
)


def ratios(a: pd.DataFrame, b: pd.DataFrame, keys: list[str], metrics: list[str], extra: list[str] = ()) -> pd.DataFrame:
    """Outer join on `keys`: `<m>_a`, `<m>_b`, `<m>_ratio` (= b / a; NaN when either is absent or a is 0),
    and each `extra` column of both sides (`<c>_a`, `<c>_b`)."""
    columns = keys + metrics + [c for c in extra if c not in metrics] + ["status", "reason"]
    merged = pd.merge(a.reindex(columns=columns), b.reindex(columns=columns), on=keys, how="outer",
                      suffixes=("_a", "_b"), indicator="side", sort=True)
    for metric in metrics:
        num_a, num_b = merged[f"{metric}_a"].astype(float), merged[f"{metric}_b"].astype(float)
        with np.errstate(divide="ignore", invalid="ignore"):
            merged[f"{metric}_ratio"] = np.where((num_a != 0) & num_a.notna() & num_b.notna(), num_b / num_a, np.nan)
    return merged


def _side_text(row: pd.Series, metric: str, side: str, fmt: Callable[[object], str], notes: md.Notes, where: str,
               spec: Measures) -> str:
    present = row["side"] in ("both", "left_only" if side == "a" else "right_only")
    if not present:
        return "absent"
    status = row[f"status_{side}"]
    if isinstance(status, str) and status != "ok":
        return notes.status_cell(status, row[f"reason_{side}"], f"{side.upper()}: {where}")
    text = fmt(row[f"{metric}_{side}"])
    if spec.ci and metric in spec.ci:
        low, high = (row[f"{c}_{side}"] for c in spec.ci[metric])
        if not (md.missing(low) or md.missing(high)):
            text += f" [{fmt(low)}, {fmt(high)}]"
    counted = spec.ci.keys() if spec.ci else list(spec.metrics)[:1]  # n beside the value it counts
    if spec.n and metric in counted and not md.missing(row[f"{spec.n}_{side}"]):
        text += f" n={int(row[f'{spec.n}_{side}'])}"
    return text


def render_measures(spec: Measures, a: RecordSet, b: RecordSet, notes: md.Notes) -> str:
    frame_a, frame_b = spec.frame_of(a), spec.frame_of(b)
    if frame_a.empty and frame_b.empty:
        return ""
    keys = list(spec.keys)
    extra = ([spec.n] if spec.n else []) + [c for pair in (spec.ci or {}).values() for c in pair]
    merged = ratios(frame_a, frame_b, keys, list(spec.metrics), extra)
    rows = []
    for _, row in merged.iterrows():
        key_cells = [fmt(row[k]) for k, (_, fmt) in spec.keys.items()]
        where = " ".join(key_cells)
        cells = []
        for metric, (_, fmt) in spec.metrics.items():
            text = f"{_side_text(row, metric, 'a', fmt, notes, where, spec)} → {_side_text(row, metric, 'b', fmt, notes, where, spec)}"
            if not md.missing(row[f"{metric}_ratio"]):
                text += f" ({row[f'{metric}_ratio']:.3f}×)"
            cells.append(text)
        rows.append(key_cells + cells)
    header = [title for title, _ in spec.keys.values()] + [title for title, _ in spec.metrics.values()]
    legend = []
    if spec.n or spec.ci:
        legend = [("Each side: value" + (" [95% CI]" if spec.ci else "") + (" n=samples" if spec.n else "")
                   + (" (TPOT: a normal interval over the timed steps, narrower than run-to-run spread)" if spec.n == "tpot_n" else "")
                   + "."), ""]
    return "\n".join([f"## {spec.title}: A → B (B/A)", "", *legend, md.table(header, rows, "l" * len(keys) + "r" * len(spec.metrics))])


def render_comparison_tables(a: RecordSet, b: RecordSet, notes: md.Notes) -> list[str]:
    return [text for spec in MEASURES if (text := render_measures(spec, a, b, notes))]
