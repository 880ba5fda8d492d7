"""Quality vs budget per suite and task, with seeded bootstrap confidence intervals over records."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from . import markdown as md
from .records import Record, dig, status_of

TABLE_KEYS = ["suite", "model", "engine", "context_tokens"]  # engines apart: the same cell from two is two cells
ROW_KEYS = ["task", "budget_sort"]
CELL_KEYS = TABLE_KEYS + ROW_KEYS + ["arm_label"]
ALL_TASKS = "(all tasks)"
FULL_BUDGET = np.inf  # dense arms have no budget; they sort after every finite budget


def bootstrap_ci(scores: Sequence[float], level: float = 0.95, resamples: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high): percentile bootstrap of the mean; the fixed seed makes the bounds reproducible."""
    values = np.asarray(scores, dtype=np.float64)
    if values.size == 0:
        return (np.nan, np.nan, np.nan)
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, values.size, size=(resamples, values.size))].mean(axis=1)
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return float(values.mean()), float(low), float(high)


def task_mean_ci(scores_by_task: Sequence[Sequence[float]], level: float = 0.95, resamples: int = 2000,
                 seed: int = 0) -> tuple[float, float, float]:  # fmt: skip
    """(mean, low, high) of the mean of task means (RULER's average: every task weighs the same, whatever its
    count of records), by a percentile bootstrap that resamples records within each task."""
    groups = [np.asarray(g, dtype=np.float64) for g in scores_by_task if len(g)]
    if not groups:
        return (np.nan, np.nan, np.nan)
    rng = np.random.default_rng(seed)
    means = np.mean([g[rng.integers(0, g.size, size=(resamples, g.size))].mean(axis=1) for g in groups], axis=0)
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return float(np.mean([g.mean() for g in groups])), float(low), float(high)


def _row(record: Record) -> dict:
    cell = record.get("cell") or {}
    status, reason = status_of(record)
    budget = cell.get("budget_tokens")
    score = record.get("score")
    return {
        "suite": str(cell.get("suite") or "?"),
        "model": str(cell.get("model") or "?"),
        "engine": str(record.get("engine") or "?"),
        "context_tokens": int(cell.get("context_tokens") or 0),
        "task": str(cell.get("task") or "?"),
        "budget_sort": FULL_BUDGET if budget is None else float(budget),
        "arm_label": md.with_format(str(cell.get("arm") or "?"), cell.get("format")),
        "record_id": str(cell.get("record_id") or ""),
        "status": "error" if status == "ok" and score is None else status,
        "reason": "ok record without a score" if status == "ok" and score is None else reason,
        "score": np.nan if score is None else float(score),
        "date": str(dig(record, "provenance", "date", default="")),
    }


def eval_frame(records: Sequence[Record]) -> pd.DataFrame:
    """One row per eval record; the newest record of a repeated (cell, record_id) wins."""
    if not records:
        return pd.DataFrame(columns=CELL_KEYS + ["record_id", "status", "reason", "score"])
    frame = pd.DataFrame([_row(r) for r in records]).sort_values(CELL_KEYS + ["record_id", "date"], kind="stable")
    return frame.drop_duplicates(CELL_KEYS + ["record_id"], keep="last").reset_index(drop=True)


def common_records(frame: pd.DataFrame) -> pd.DataFrame:
    """The rows of the (task, record) pairs that every arm at their budget ran, of the tasks every arm of their
    table ran: the pooled means then cover the same tasks for every arm, and the same prompts for every arm at
    one budget (a run cut short leaves some prompts with only a few of their cells)."""
    arms = frame.groupby(TABLE_KEYS)["arm_label"].transform("nunique")
    frame = frame[frame.groupby(TABLE_KEYS + ["task"])["arm_label"].transform("nunique") == arms]
    keys = TABLE_KEYS + ["budget_sort"]
    at_budget = frame.groupby(keys)["arm_label"].transform("nunique")
    return frame[frame.groupby(keys + ["task", "record_id"])["arm_label"].transform("nunique") == at_budget]


def pooled_tasks(frame: pd.DataFrame) -> dict[tuple, tuple[list[str], list[str]]]:
    """Per table key: (the tasks its `(all tasks)` row pools, the tasks left out because some arm lacks them)."""
    kept = {key: sorted(tasks) for key, tasks in common_records(frame).groupby(TABLE_KEYS)["task"].unique().items()}
    return {key: (kept.get(key, []), sorted(set(group["task"]) - set(kept.get(key, []))))
            for key, group in frame.groupby(TABLE_KEYS, sort=True)}  # fmt: skip


def quality_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Per cell: n, mean score and its 95% bootstrap CI, plus a sentence for unscored records.

    When a table has several tasks, an `(all tasks)` row holds the mean of the task means over the records
    `common_records` keeps (`task_mean_ci`).
    """
    if frame.empty:
        return pd.DataFrame(columns=CELL_KEYS + ["n", "mean", "low", "high", "failures"])
    common = common_records(frame)
    pooled = common[common.groupby(TABLE_KEYS)["task"].transform("nunique") > 1]
    pooled = pooled.assign(pooled_task=pooled["task"], task=ALL_TASKS)
    rows = []
    for key, group in pd.concat([frame, pooled]).groupby(CELL_KEYS, sort=True):
        ok = group[group["status"] == "ok"]
        scores = ok["score"].to_numpy()
        if key[CELL_KEYS.index("task")] == ALL_TASKS:
            mean, low, high = task_mean_ci([g.to_numpy() for _, g in ok.groupby("pooled_task")["score"]])
        else:
            mean, low, high = bootstrap_ci(scores)
        rows.append(dict(zip(CELL_KEYS, key), n=int(scores.size), mean=mean, low=low, high=high, failures=md.failures(group, "not scored")))
    table = pd.DataFrame(rows)
    table["task_sort"] = table["task"] == ALL_TASKS  # the pooled row closes each suite
    return table.sort_values(TABLE_KEYS + ["task_sort", "task", "budget_sort", "arm_label"], kind="stable").drop(columns="task_sort")


def engine_text(engine: str) -> str:
    """`, vllm engine` for a table title; records written before they named their engine show none."""
    return "" if engine == "?" else f", {engine} engine"


def budget_text(budget: float) -> str:
    return "full" if budget == FULL_BUDGET else str(int(budget))


def render_quality(frame: pd.DataFrame, notes: md.Notes) -> str:
    """One table per (suite, model, context): rows (task, budget), a column per arm, `mean [low, high]`."""
    table = quality_table(frame)
    if table.empty:
        return ""
    parts = ["## Quality vs budget (mean score, 95% bootstrap CI over records)"]
    pooled = pooled_tasks(frame)
    for (suite, model, engine, context), group in table.groupby(TABLE_KEYS, sort=True):
        arms = sorted(group["arm_label"].unique())
        kept, left_out = pooled.get((suite, model, engine, context), ([], []))
        rows = []
        for (task, budget), cells in group.groupby(ROW_KEYS, sort=False):
            row = [task, budget_text(budget)]
            if task == ALL_TASKS and left_out:
                row[0] = task + notes.mark(f"{suite} @ {md.fmt_tokens(context)}: the pooled row holds the records every "
                                           f"arm ran ({', '.join(kept)}); left out, not run by every arm: "
                                           f"{', '.join(left_out)}")  # fmt: skip
            for arm in arms:
                hit = cells[cells["arm_label"] == arm]
                if hit.empty:
                    row.append(md.DASH)
                    continue
                cell = hit.iloc[0]
                where = f"eval {suite}/{task} {arm} b={budget_text(budget)} @ {md.fmt_tokens(context)}"
                if cell["n"] == 0:
                    text = "no scores"
                elif cell["n"] == 1:
                    text = f"{md.fmt_num(cell['mean'])} (n=1)"
                else:
                    text = f"{md.fmt_num(cell['mean'])} [{md.fmt_num(cell['low'])}, {md.fmt_num(cell['high'])}] (n={cell['n']})"
                if cell["failures"]:
                    text += notes.mark(f"{where}: {cell['failures']}")
                row.append(text)
            rows.append(row)
        parts += ["", f"### {suite} — {model} @ {md.fmt_tokens(context)}{engine_text(engine)}", "", md.table(["Task", "Budget"] + arms, rows, "ll" + "r" * len(arms))]
    return "\n".join(parts)


REFERENCE_ARM = "fullkv"


def paired_gap_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Per (table, budget, sparse arm): the arm's score minus FullKV's on the same prompts, the mean of the task
    means over the prompts `common_records` keeps, with a 95% bootstrap CI resampling prompts
    within each task (`task_mean_ci`). Pairing removes the prompts' own spread, which dominates the CIs of the two
    means apart (a task FullKV cannot do adds zeros to both sides)."""
    columns = TABLE_KEYS + ["budget_sort", "arm_label", "n", "mean", "low", "high"]
    common = common_records(frame)
    ok = common[common["status"] == "ok"]
    reference = ok[ok["arm_label"] == REFERENCE_ARM].set_index(TABLE_KEYS + ["task", "record_id"])["score"]
    sparse = ok[(ok["arm_label"] != REFERENCE_ARM) & (ok["budget_sort"] != FULL_BUDGET)]
    if reference.empty or sparse.empty:
        return pd.DataFrame(columns=columns)
    rows = []
    for key, group in sparse.groupby(TABLE_KEYS + ["budget_sort", "arm_label"], sort=True):
        scores = group.set_index(TABLE_KEYS + ["task", "record_id"])["score"]
        both = scores.index.intersection(reference.index)
        if both.empty:
            continue
        gaps = scores.loc[both] - reference.loc[both]
        mean, low, high = task_mean_ci([g.to_numpy() for _, g in gaps.groupby(level="task")])
        rows.append(dict(zip(TABLE_KEYS + ["budget_sort", "arm_label"], key), n=len(both), mean=mean, low=low, high=high))
    return pd.DataFrame(rows, columns=columns)


def render_paired_gaps(frame: pd.DataFrame) -> str:
    """One table per (suite, model, engine): rows (context, budget), a column per sparse arm, `gap [low, high]`."""
    table = paired_gap_table(frame)
    if table.empty:
        return ""
    parts = ["## Score minus FullKV on the same prompts (mean of the task means, 95% bootstrap CI over prompts within "
             "each task)"]
    for (suite, model, engine), group in table.groupby(TABLE_KEYS[:3], sort=True):
        arms = sorted(group["arm_label"].unique())
        rows = []
        for (context, budget), cells in group.groupby(["context_tokens", "budget_sort"], sort=True):
            row = [md.fmt_tokens(context), budget_text(budget)]
            for arm in arms:
                hit = cells[cells["arm_label"] == arm]
                cell = hit.iloc[0] if not hit.empty else None
                row.append(md.DASH if cell is None else
                           f"{cell['mean']:+.2f} [{cell['low']:+.2f}, {cell['high']:+.2f}] (n={cell['n']})")  # fmt: skip
            rows.append(row)
        parts += ["", f"### {suite} — {model}{engine_text(engine)}", "",
                  md.table(["Context", "Budget"] + arms, rows, "rr" + "r" * len(arms))]  # fmt: skip
    return "\n".join(parts)
