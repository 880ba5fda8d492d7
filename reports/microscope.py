"""Microscope tables: selection fidelity per selector and budget, and per layer."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from . import markdown as md
from .records import Record, dig, status_of

RUN_KEYS = ["model", "context_tokens", "combine"]  # one table each; blank when the records do not say
KEYS = RUN_KEYS + ["budget_tokens", "selector_label"]
# metric -> (column header, how records combine, digits)
METRICS = {
    "gamma": ("γ", "mean", 3),
    "gamma_c": ("γ contested", "mean", 3),
    "recall": ("Recall", "mean", 3),
    "needle_retention": ("Needle kept", "mean", 3),
    "score_err_p50": ("Score err p50", "mean", 4),
    "score_err_p95": ("Score err p95", "mean", 4),
    "score_err_max": ("Score err max", "max", 4),
    "share_log_err": ("Share log err", "mean", 4),
    "captured_energy": ("Energy", "mean", 3),
    "bound_violations": ("Bound violations", "sum", 0),
}
# Names the suites' pooled summary uses for the same quantities (suites/microscope.py `summarize`).
ALIASES = {
    "gamma": ("gamma_mean",),
    "gamma_c": ("gamma_c_mean",),
    "recall": ("recall_mean",),
    "share_log_err": ("share_log_err_wmean",),
    "bound_violations": ("audit_violated",),
}


def _row(record: Record) -> dict:
    cell = record.get("cell") or {}
    status, reason = status_of(record)
    row = {
        "model": str(cell.get("model") or ""),
        "context_tokens": int(cell.get("context_tokens") or 0),
        "combine": str(cell.get("combine") or ""),
        "budget_tokens": int(cell.get("budget_tokens") or 0),
        "selector_label": md.with_format(str(cell.get("selector") or "?"), cell.get("format")),
        "layer": int(cell["layer"]) if cell.get("layer") is not None else -1,
        "record_id": str(cell.get("record_id") or ""),
        "status": status,
        "reason": reason,
        "date": str(dig(record, "provenance", "date", default="")),
    }
    metrics = record.get("metrics") or record  # the pooled summary rows of `locks eval microscope` are flat
    for metric in METRICS:
        value = next((metrics[name] for name in (metric, *ALIASES.get(metric, ())) if metrics.get(name) is not None), None)
        row[metric] = np.nan if value is None else float(value)
    return row


def microscope_frame(records: Sequence[Record]) -> pd.DataFrame:
    """One row per (selector, budget, layer, record); the newest repeat wins."""
    if not records:
        return pd.DataFrame(columns=KEYS + ["layer", "record_id", "status", "reason", *METRICS])
    keys = KEYS + ["layer", "record_id"]
    frame = pd.DataFrame([_row(r) for r in records]).sort_values(keys + ["date"], kind="stable")
    return frame.drop_duplicates(keys, keep="last").reset_index(drop=True)


def fidelity_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Per (budget, selector): n ok records and each metric combined over records and layers."""
    rows = []
    for key, group in frame.groupby(KEYS, sort=True):
        ok = group[group["status"] == "ok"]
        row = dict(zip(KEYS, key), n=len(ok), failures=md.failures(group, "without metrics"))
        for metric, (_, how, _) in METRICS.items():
            values = ok[metric].dropna()
            row[metric] = getattr(values, how)() if len(values) else np.nan
        rows.append(row)
    return pd.DataFrame(rows, columns=KEYS + ["n", "failures", *METRICS])


def run_title(model: str, context_tokens: int, combine: str) -> str:
    parts = [model or "model not recorded"]
    if context_tokens:
        parts.append(f"@ {md.fmt_tokens(context_tokens)}")
    if combine:
        parts.append(f"combine {combine}")
    return " ".join(parts)


def _per_layer(frame: pd.DataFrame) -> list[str]:
    """γ / recall per layer and selector, one table per budget; only when several layers were measured."""
    ok = frame[(frame["status"] == "ok") & (frame["layer"] >= 0)]
    if ok["layer"].nunique() < 2:
        return []
    parts = []
    per_layer = ok.groupby(["budget_tokens", "layer", "selector_label"], sort=True)[["gamma", "recall"]].mean().reset_index()
    for budget, group in per_layer.groupby("budget_tokens", sort=True):
        selectors = sorted(group["selector_label"].unique())
        rows = []
        for layer, cells in group.groupby("layer", sort=True):
            row = [str(layer)]
            for selector in selectors:
                hit = cells[cells["selector_label"] == selector]
                row.append(md.DASH if hit.empty else f"{md.fmt_num(hit['gamma'].iloc[0], 3)} / {md.fmt_num(hit['recall'].iloc[0], 3)}")
            rows.append(row)
        parts += ["", f"#### γ / recall per layer, budget {budget}", "", md.table(["Layer", *selectors], rows)]
    return parts


def render_microscope(frame: pd.DataFrame, notes: md.Notes) -> str:
    """Per run (model, context, combine): fidelity per selector and budget, then γ / recall per layer."""
    if frame.empty:
        return ""
    table = fidelity_table(frame)
    header = ["Budget", "Selector", "n", *(title for title, _, _ in METRICS.values())]
    parts = ["## Selection fidelity (microscope)", "",
             "Means over records and layers; score error max is the maximum, bound violations the sum."]
    for run, run_table in table.groupby(RUN_KEYS, sort=True):
        rows = []
        for _, cell in run_table.iterrows():
            where = f"microscope {cell['selector_label']} b={cell['budget_tokens']}"
            label = cell["selector_label"] + (notes.mark(f"{where}: {cell['failures']}") if cell["failures"] else "")
            values = [md.fmt_int(cell[m]) if how == "sum" else md.fmt_num(cell[m], digits) for m, (_, how, digits) in METRICS.items()]
            rows.append([str(cell["budget_tokens"]), label, str(cell["n"]), *values])
        in_run = frame[(frame[RUN_KEYS] == pd.Series(run, index=RUN_KEYS)).all(axis=1)]
        parts += ["", f"### {run_title(*run)}", "", md.table(header, rows, "ll" + "r" * (len(header) - 2)), *_per_layer(in_run)]
    return "\n".join(parts)
