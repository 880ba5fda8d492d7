"""Per task: what FullKV itself scores at each length, and the budget from which each sparse arm keeps up with it.

A task FullKV cannot do at a length (mean 0) adds zeros to every arm and says nothing about selection: the
tables name it so, instead of averaging it away.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from . import markdown as md
from .quality import FULL_BUDGET, REFERENCE_ARM, TABLE_KEYS, budget_text, engine_text

# A budget is "kept up" when the arm's mean over the prompts both ran is at most this far below FullKV's, at that
# budget and every larger one.
FLOOR_TOLERANCE = 0.1
CANNOT = "FullKV 0"  # FullKV scores 0: no floor to find


def fullkv_task_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Per (suite, model, engine, task, context): FullKV's mean score and its number of scored records."""
    columns = TABLE_KEYS + ["task", "n", "mean"]
    ok = frame[(frame["status"] == "ok") & (frame["arm_label"] == REFERENCE_ARM)]
    if ok.empty:
        return pd.DataFrame(columns=columns)
    table = ok.groupby(TABLE_KEYS + ["task"])["score"].agg(n="size", mean="mean").reset_index()
    return table[columns]


def budget_floor_table(frame: pd.DataFrame, tolerance: float = FLOOR_TOLERANCE) -> pd.DataFrame:
    """Per (table, task, sparse arm): `floor`, the smallest budget from which the arm's paired mean stays within
    `tolerance` of FullKV's at every larger budget it ran (NaN: not even at its largest), and FullKV's mean."""
    columns = TABLE_KEYS + ["task", "arm_label", "fullkv_mean", "floor", "largest"]
    ok = frame[frame["status"] == "ok"]
    index = TABLE_KEYS + ["task", "record_id"]
    reference = ok[ok["arm_label"] == REFERENCE_ARM].set_index(index)["score"]
    sparse = ok[(ok["arm_label"] != REFERENCE_ARM) & (ok["budget_sort"] != FULL_BUDGET)]
    if reference.empty or sparse.empty:
        return pd.DataFrame(columns=columns)
    fullkv = reference.groupby(level=TABLE_KEYS + ["task"]).mean()
    rows = []
    for key, group in sparse.groupby(TABLE_KEYS + ["task", "arm_label"], sort=True):
        gaps = {}
        for budget, cells in group.groupby("budget_sort", sort=True):
            scores = cells.set_index(index)["score"]
            both = scores.index.intersection(reference.index)
            if len(both):
                gaps[budget] = float((scores.loc[both] - reference.loc[both]).mean())
        if not gaps:
            continue
        floor = np.nan
        for budget in sorted(gaps, reverse=True):  # walk down while every larger budget keeps up
            if gaps[budget] < -tolerance:
                break
            floor = budget
        rows.append(dict(zip(TABLE_KEYS + ["task", "arm_label"], key), fullkv_mean=float(fullkv.loc[key[:-1]]),
                         floor=floor, largest=max(gaps)))  # fmt: skip
    return pd.DataFrame(rows, columns=columns)


def render_task_floors(frame: pd.DataFrame) -> str:
    """Per (suite, model, engine): FullKV's score per task and length, then each sparse arm's budget floor."""
    fullkv, floors = fullkv_task_table(frame), budget_floor_table(frame)
    if fullkv.empty:
        return ""
    parts = []
    for (suite, model, engine), group in fullkv.groupby(TABLE_KEYS[:3], sort=True):
        contexts = sorted(group["context_tokens"].unique())
        rows = []
        for task, cells in group.groupby("task", sort=True):
            by_context = cells.set_index("context_tokens")
            rows.append([task] + [_fullkv_cell(by_context, c) for c in contexts])
        means = [group.loc[group["context_tokens"] == c, "mean"].mean() for c in contexts]
        rows.append([f"**{group['task'].nunique()}-task mean**"] + [f"**{md.fmt_num(m)}**" for m in means])
        parts += ["", f"## FullKV's own score per task ({suite} — {model}{engine_text(engine)}; n records; "
                      "0: the model cannot do the task at that length)", "",
                  md.table(["Task"] + [md.fmt_tokens(c) for c in contexts], rows, "l" + "r" * len(contexts))]  # fmt: skip
        mine = floors[(floors["suite"] == suite) & (floors["model"] == model) & (floors["engine"] == engine)]
        if mine.empty:
            continue
        arms = sorted(mine["arm_label"].unique())
        rows = []
        for task in sorted(mine["task"].unique()):
            row = [task]
            for context in contexts:
                here = mine[(mine["task"] == task) & (mine["context_tokens"] == context)].set_index("arm_label")
                row.append(_floor_cell(here, arms))
            rows.append(row)
        parts += ["", f"## Budget floor per task ({suite} — {model}{engine_text(engine)}): the smallest budget from "
                      f"which the arm stays within {FLOOR_TOLERANCE:g} of FullKV on the same prompts at every larger "
                      "budget", "", f"Each cell: {' / '.join(arms)}. \"{CANNOT}\": FullKV scores 0, no floor to find; "
                      "\">B\": still below at its largest budget B.", "",
                  md.table(["Task"] + [f"{md.fmt_tokens(c)}" for c in contexts], rows, "l" + "c" * len(contexts))]  # fmt: skip
    return "\n".join(parts).lstrip("\n")


def _fullkv_cell(by_context: pd.DataFrame, context: int) -> str:
    if context not in by_context.index:
        return md.DASH
    row = by_context.loc[context]
    return f"{md.fmt_num(row['mean'])} (n={int(row['n'])})"


def _floor_cell(here: pd.DataFrame, arms: list[str]) -> str:
    if here.empty:
        return md.DASH
    if (here["fullkv_mean"] == 0).all():
        return CANNOT
    values = []
    for arm in arms:
        if arm not in here.index:
            values.append(md.DASH)
            continue
        row = here.loc[arm]
        values.append(f">{budget_text(row['largest'])}" if np.isnan(row["floor"]) else budget_text(row["floor"]))
    return " / ".join(values)
