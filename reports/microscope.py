"""Microscope tables: selection fidelity per selector and budget, and per layer."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from . import markdown as md
from .records import Record, dig, status_of

RUN_KEYS = ["model", "context_tokens", "combine", "engine"]  # one table each; blank when the records do not say
KEYS = RUN_KEYS + ["budget_tokens", "selector_label"]
# metric -> (column header, how records combine, digits). "pooled": over every (record, layer, step, query
# head) sample, weighted by each record's sample count: the number the microscope's terminal table shows.
# "kept/eligible": pooled counts. "mean": the mean over records of each record's value (a percentile of the
# pooled samples cannot be rebuilt from per-record percentiles, so those headers say "record mean").
METRICS = {
    "gamma": ("γ", "pooled", 3),
    "gamma_c": ("γ contested", "pooled", 3),
    "recall": ("Recall", "pooled", 3),
    "needle_retention": ("Needle kept", "kept/eligible", 3),
    "score_err_p50": ("Score err p50 (record mean)", "mean", 4),
    "score_err_p95": ("Score err p95 (record mean)", "mean", 4),
    "score_err_max": ("Score err max", "max", 4),
    "share_log_err": ("Share log err (record mean)", "mean", 4),
    "captured_energy": ("Energy (record mean)", "mean", 3),
    "bound_violations": ("Bound violations", "sum", 0),
}
LEGEND = ("γ, γ contested and recall are pooled over every (record, layer, step, query head) sample, and needle "
          "kept is carrier pages kept / eligible over all records: the definitions of the microscope's own "
          "table. Columns marked (record mean) are the mean over records of each record's value; score error "
          "max is the maximum, bound violations the sum.")
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
        "engine": str(cell.get("engine") or "transformers"),  # the cell names another engine only
        "budget_tokens": int(cell.get("budget_tokens") or 0),
        "selector_label": md.with_format(str(cell.get("selector") or "?"), cell.get("format")),
        "layer": int(cell["layer"]) if cell.get("layer") is not None else -1,
        "record_id": str(cell.get("record_id") or ""),
        "status": status,
        "reason": reason,
        "date": str(dig(record, "provenance", "date", default="")),
    }
    metrics = record.get("metrics") or record  # the pooled summary rows of `locks eval microscope` are flat
    for count in ("samples", "needle_kept", "needle_eligible"):  # absent in older records: plain means then
        row[count] = float(metrics[count]) if metrics.get(count) is not None else np.nan
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
            row[metric] = _combine(ok, metric, how)
        rows.append(row)
    return pd.DataFrame(rows, columns=KEYS + ["n", "failures", *METRICS])


def _combine(ok: pd.DataFrame, metric: str, how: str) -> float:
    """One metric over the ok records of a (budget, selector), as METRICS says (plain mean without counts)."""
    values = ok[metric].dropna()
    if values.empty:
        return np.nan
    if how == "kept/eligible" and ok["needle_eligible"].notna().all():
        eligible = ok["needle_eligible"].sum()
        return float(ok["needle_kept"].sum() / eligible) if eligible else np.nan
    if how == "pooled" and ok.loc[values.index, "samples"].notna().all():
        weights = ok.loc[values.index, "samples"]
        return float((values * weights).sum() / weights.sum())
    if how in ("pooled", "kept/eligible"):
        how = "mean"
    return float(getattr(values, how)())


def run_title(model: str, context_tokens: int, combine: str, engine: str = "transformers") -> str:
    parts = [model or "model not recorded"]
    if context_tokens:
        parts.append(f"@ {md.fmt_tokens(context_tokens)}")
    if combine:
        parts.append(f"combine {combine}")
    if engine != "transformers":
        parts.append(f"(captured in {engine} with the Locks backend)")
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
    parts = ["## Selection fidelity (microscope)", "", LEGEND]
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
