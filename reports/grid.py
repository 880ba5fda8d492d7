"""The batched grid: speedup per context x batch for each sparse arm, with the per-context frontier.

The frontier at a context is the largest batch where the sparse arm and at least one dense arm both
ran, so a speedup exists; it is bold, and its throughputs are listed beside the row. Each arm's own
frontier (its largest batch that ran, whether or not the other arm fits there) is compared by
throughput in the last column: Locks keeps ~10% more bytes resident, so its frontier can be lower.
"""

from __future__ import annotations

import pandas as pd

from . import markdown as md
from .decode import SETUP_KEYS, cell_name, guard_marker, latest_runs, setup_title


def _cell_markers(cells: pd.DataFrame, notes: md.Notes) -> str:
    """Footnotes for what one grid cell hides: any arm that failed, or a guard flag on any arm."""
    markers = []
    for _, other in cells.iterrows():
        if other["status"] != "ok":
            markers.append(notes.status_marker(other["status"], other["reason"], cell_name(other)))
        else:
            markers.append(guard_marker(other, notes))
    return "".join(markers)


def grid_frame(frame: pd.DataFrame) -> pd.DataFrame:
    """Sparse-arm rows of the decode frame (each cell's latest run) with an `is_frontier` flag per (setup, arm, context)."""
    frame = latest_runs(frame)
    sparse = frame[~frame["dense"]].copy()
    sparse["has_speedup"] = sparse["speedup"].notna()
    frontier = sparse[sparse["has_speedup"]].groupby(SETUP_KEYS + ["arm_label", "context_tokens"])["batch_size"].max()
    keys = list(zip(*(sparse[k] for k in SETUP_KEYS + ["arm_label", "context_tokens"])))
    sparse["is_frontier"] = [
        bool(has and frontier.get(key) == batch)
        for key, batch, has in zip(keys, sparse["batch_size"], sparse["has_speedup"])
    ]
    return sparse


def own_frontiers(frame: pd.DataFrame) -> pd.DataFrame:
    """Per (setup, sparse arm, context): each side's own frontier (largest ok batch) and throughput there;
    the dense side is the dense arm with the highest throughput at its own frontier; `ratio` = sparse / dense.
    Each cell's latest run."""
    frame = latest_runs(frame)
    ok = frame[frame["status"] == "ok"]
    keys = SETUP_KEYS + ["context_tokens"]
    dense = ok[ok["dense"]].sort_values(keys + ["arm_label", "batch_size"]).drop_duplicates(keys + ["arm_label"], keep="last")
    best = dense.sort_values(keys + ["throughput_tok_s"]).drop_duplicates(keys, keep="last")
    best = best[keys + ["arm_label", "batch_size", "throughput_tok_s"]].rename(columns={
        "arm_label": "dense_frontier_arm", "batch_size": "dense_frontier_batch", "throughput_tok_s": "dense_frontier_tput"})
    sparse = ok[~ok["dense"]].sort_values(keys + ["arm_label", "batch_size"]).drop_duplicates(keys + ["arm_label"], keep="last")
    sparse = sparse[keys + ["arm_label", "batch_size", "throughput_tok_s"]].rename(columns={
        "batch_size": "frontier_batch", "throughput_tok_s": "frontier_tput"})
    out = sparse.merge(best, on=keys, how="left")
    out["ratio"] = out["frontier_tput"] / out["dense_frontier_tput"]
    return out.reset_index(drop=True)


def _own_frontier_text(frontiers: pd.DataFrame, setup: list, arm_label: str, context: int) -> str:
    hit = frontiers[(frontiers[SETUP_KEYS] == pd.Series(setup, index=SETUP_KEYS)).all(axis=1)
                    & (frontiers["arm_label"] == arm_label) & (frontiers["context_tokens"] == context)]
    if hit.empty:
        return md.DASH
    row = hit.iloc[0]
    text = f"bs{row['frontier_batch']}: {md.fmt_num(row['frontier_tput'], 0)}"
    if md.missing(row["dense_frontier_tput"]):
        return text + " / no dense arm ran"
    return (f"{text} / bs{int(row['dense_frontier_batch'])}: {md.fmt_num(row['dense_frontier_tput'], 0)} "
            f"({row['dense_frontier_arm']}) = {md.fmt_ratio(row['ratio'])}")


def render_grid(frame: pd.DataFrame, notes: md.Notes) -> str:
    """One table per (setup, sparse arm); only when some cell has a batch above 1."""
    if frame.empty or (frame["batch_size"] == 1).all() or frame["dense"].all():
        return ""
    sparse = grid_frame(frame)
    parts = ["## Batched grid (speedup vs the faster dense arm)", "",
             "Bold: the frontier, the largest batch at which both the sparse arm and a dense arm fit. Own frontiers: "
             "each side at its own largest batch that ran (sparse / the dense arm with the most tok/s there), "
             "throughput ratio."
             + (" A cell measured in several runs shows its latest run." if "runs" in frame and (frame["runs"] > 1).any() else "")]
    frontiers = own_frontiers(frame)
    batches = sorted(frame["batch_size"].unique())
    for (*setup, arm_label), group in sparse.groupby(SETUP_KEYS + ["arm_label"], sort=True):
        header = ["Context"] + [f"bs{b}" for b in batches] + ["Throughput at frontier (tok/s, sparse / dense)",
                                                              "Own frontiers (tok/s)"]
        rows = []
        in_setup = frame[(frame[SETUP_KEYS] == pd.Series(setup, index=SETUP_KEYS)).all(axis=1)]
        for context in sorted(in_setup["context_tokens"].unique()):  # dense-only contexts too: their failures show
            by_context = group[group["context_tokens"] == context]
            row = [md.fmt_tokens(context)]
            frontier_text = md.DASH
            for batch in batches:
                hit = by_context[by_context["batch_size"] == batch]
                cells = in_setup[(in_setup["context_tokens"] == context) & (in_setup["batch_size"] == batch)]
                others = cells[cells["dense"]]
                if hit.empty:
                    row.append(md.DASH + _cell_markers(others, notes))
                    continue
                cell = hit.iloc[0]
                if cell["status"] != "ok":
                    text = md.STATUS_LABEL.get(cell["status"], cell["status"])
                elif md.missing(cell["speedup"]):
                    why = ("dense OOM" if (others["status"] == "oom").any()
                           else "dense failed" if len(others) else "no dense arm")
                    text = f"{why}; {md.fmt_num(cell['tpot_mean'])} ms"
                else:
                    text = md.fmt_ratio(cell["speedup"])
                    if cell["is_frontier"]:
                        text = md.bold(text)
                        frontier_text = (f"bs{batch}: {md.fmt_num(cell['throughput_tok_s'], 0)} / "
                                         f"{md.fmt_num(cell['dense_throughput'], 0)} ({cell['dense_arm']})")
                row.append(text + _cell_markers(hit, notes) + _cell_markers(others, notes))
            rows.append(row + [frontier_text, _own_frontier_text(frontiers, setup, arm_label, context)])
        parts += ["", f"### {setup_title(tuple(setup))} — {arm_label}", "",
                  md.table(header, rows, "l" + "r" * len(batches) + "ll")]
    return "\n".join(parts)
