"""PNG plots (matplotlib, Agg): TPOT, speedup, bytes and TTFT vs context, the batched grid, quality and the
microscope vs budget; each figure is captioned with the records it was drawn from."""

from __future__ import annotations

import logging
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from . import markdown as md
from .decode import SETUP_KEYS, setup_title
from .grid import grid_frame, own_frontiers
from .microscope import RUN_KEYS, fidelity_table
from .quality import ALL_TASKS, FULL_BUDGET, TABLE_KEYS, engine_text, paired_gap_table, quality_table

logger = logging.getLogger(__name__)


class PlotsUnavailable(RuntimeError):
    """matplotlib is not installed."""


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise PlotsUnavailable("plots need matplotlib; install the extra: pip install 'locks-toolkit[plots]'") from exc
    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def _grid_of(plt: Any, count: int) -> tuple[Any, list[Any]]:
    cols = min(count, 3)
    rows = -(-count // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 4 * rows), squeeze=False)
    for ax in axes.flat[count:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:count])


def _wrap(title: str) -> str:
    return "\n".join(textwrap.wrap(title, 60))


def _context_axis(ax: Any, contexts: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(contexts, [md.fmt_tokens(c) for c in contexts])
    ax.set_xlabel("context (tokens)")
    ax.grid(True, alpha=0.3)


def _save(plt: Any, fig: Any, path: Path, caption: str = "") -> Path:
    fig.tight_layout()
    if caption:  # the records a figure was drawn from (files, commit, GPU, date), below the axes
        fig.subplots_adjust(bottom=fig.subplotpars.bottom + 0.06)
        fig.text(0.01, 0.005, "\n".join(textwrap.wrap(caption, 110)), fontsize=6, color="#555555",
                 ha="left", va="bottom")
    fig.savefig(path, format="png", dpi=110, metadata={"Software": None})  # no version stamp in the bytes
    plt.close(fig)
    logger.debug("wrote %s", path)
    return path


def _panels_by_setup(frame: pd.DataFrame, path: Path, ylabel: str, draw, log_y: bool = False,
                     caption: str = "") -> Path:
    """One panel per setup with the context axis; `draw(ax, arm, line)` draws one arm's line."""
    plt = _pyplot()
    groups = list(frame.groupby(SETUP_KEYS, sort=True))
    fig, axes = _grid_of(plt, len(groups))
    for ax, (setup, group) in zip(axes, groups):
        for arm, line in group.groupby("arm_label", sort=True):
            draw(ax, arm, line)
        _context_axis(ax, sorted(group["context_tokens"].unique()))
        if log_y:
            ax.set_yscale("log")
        ax.set_ylabel(ylabel)
        ax.set_title(_wrap(setup_title(setup)), fontsize=8)
        ax.legend(fontsize=8)
    return _save(plt, fig, path, caption)


def plot_tpot(decode: pd.DataFrame, path: Path, caption: str = "") -> Path | None:
    """TPOT mean ± sd vs context, one line per arm with its byte floor dotted, one panel per setup (batch 1,
    ok cells)."""
    ok = decode[(decode["status"] == "ok") & (decode["batch_size"] == 1)] if len(decode) else decode
    if ok.empty:
        return None
    def draw(ax, arm, line):
        drawn = ax.errorbar(line["context_tokens"], line["tpot_mean"], yerr=line["tpot_sd"].fillna(0), marker="o",
                            capsize=3, label=arm)
        floor = line["floor_fraction"] * line["tpot_mean"]  # (weights + attention bytes) / copy bandwidth
        if floor.notna().any():
            ax.plot(line["context_tokens"], floor, linestyle=":", color=drawn[0].get_color(), label=f"{arm} byte floor")

    return _panels_by_setup(ok, path, "TPOT (ms); dotted: the step's byte floor", draw, caption=caption)


def plot_speedup(decode: pd.DataFrame, path: Path, caption: str = "") -> Path | None:
    """Speedup vs context, one line per batch size, one panel per (setup, sparse arm)."""
    sparse = decode[~decode["dense"] & decode["speedup"].notna()] if len(decode) else decode
    if sparse.empty:
        return None
    plt = _pyplot()
    groups = list(sparse.groupby(SETUP_KEYS + ["arm_label"], sort=True))
    fig, axes = _grid_of(plt, len(groups))
    for ax, ((*setup, arm), group) in zip(axes, groups):
        for batch, line in group.groupby("batch_size", sort=True):
            ax.plot(line["context_tokens"], line["speedup"], marker="o", label=f"bs{batch}")
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
        _context_axis(ax, sorted(group["context_tokens"].unique()))
        ax.set_ylabel("speedup vs faster dense")
        ax.set_title(_wrap(f"{arm}: {setup_title(tuple(setup))}"), fontsize=8)
        ax.legend(fontsize=8)
    return _save(plt, fig, path, caption)


def bytes_series(decode: pd.DataFrame) -> pd.DataFrame:
    """The data of `plot_bytes`: per (setup, arm, context) at batch 1, the attention bytes a step reads
    (all KV for a dense arm; summaries scanned + selected pages for a sparse one), with the TPOT beside it."""
    ok = decode[(decode["status"] == "ok") & (decode["batch_size"] == 1)] if len(decode) else decode
    if ok.empty:
        return ok
    frame = ok[SETUP_KEYS + ["arm_label", "dense", "context_tokens", "tpot_mean"]].copy()
    frame["attention_bytes"] = np.where(ok["dense"], ok["bytes_dense"], ok["bytes_locks"])
    return frame.sort_values(SETUP_KEYS + ["arm_label", "context_tokens"]).reset_index(drop=True)


def plot_bytes(decode: pd.DataFrame, path: Path, caption: str = "") -> Path | None:
    """Attention bytes per decode step vs context (log-log), one line per arm, one panel per setup."""
    series = bytes_series(decode)
    if series.empty:
        return None
    return _panels_by_setup(series, path, "attention bytes per step (GB)", lambda ax, arm, line: ax.plot(
        line["context_tokens"], line["attention_bytes"] / 1e9, marker="o", label=arm,
        linestyle="--" if line["dense"].iloc[0] else "-"), log_y=True, caption=caption)


def grid_series(decode: pd.DataFrame) -> list[dict]:
    """The data of `plot_grid`: per (setup, sparse arm) the contexts x batch sizes matrix of speedups vs the
    faster dense arm (None where none exists), the text of each cell, and the sparse arm's own frontier."""
    if decode.empty or decode["dense"].all() or (decode["batch_size"] == 1).all():
        return []
    sparse = grid_frame(decode)
    frontiers = own_frontiers(decode)
    batches = sorted(decode["batch_size"].unique())
    panels = []
    for (*setup, arm), group in sparse.groupby(SETUP_KEYS + ["arm_label"], sort=True):
        contexts = sorted(group["context_tokens"].unique())
        speedup, text = [], []
        for context in contexts:
            row_speedup, row_text = [], []
            for batch in batches:
                hit = group[(group["context_tokens"] == context) & (group["batch_size"] == batch)]
                value = None if hit.empty or md.missing(hit.iloc[0]["speedup"]) else float(hit.iloc[0]["speedup"])
                row_speedup.append(value)
                if hit.empty:
                    row_text.append("")
                elif value is not None:
                    row_text.append(md.fmt_ratio(value))
                elif hit.iloc[0]["status"] == "ok":
                    dense = decode[decode["dense"] & (decode["context_tokens"] == context) & (decode["batch_size"] == batch)
                                   & (decode[SETUP_KEYS] == pd.Series(setup, index=SETUP_KEYS)).all(axis=1)]
                    row_text.append("dense\nOOM" if (dense["status"] == "oom").any() else "no dense\nresult")
                else:
                    row_text.append(md.STATUS_LABEL.get(hit.iloc[0]["status"], hit.iloc[0]["status"]))
            speedup.append(row_speedup)
            text.append(row_text)
        mine = frontiers[(frontiers["arm_label"] == arm)
                         & (frontiers[SETUP_KEYS] == pd.Series(setup, index=SETUP_KEYS)).all(axis=1)]
        frontier = {int(r["context_tokens"]): int(r["frontier_batch"]) for _, r in mine.iterrows()}
        panels.append({"setup": tuple(setup), "arm": arm, "contexts": contexts, "batches": batches,
                       "speedup": speedup, "text": text, "frontier": frontier})
    return panels


def plot_grid(decode: pd.DataFrame, path: Path, caption: str = "") -> Path | None:
    """The batched grid as a heat map of speedup vs the faster dense arm (1.0 = white), one panel per
    (setup, sparse arm); the sparse arm's own frontier at each context is outlined."""
    panels = grid_series(decode)
    if not panels:
        return None
    plt = _pyplot()
    fig, axes = _grid_of(plt, len(panels))
    for ax, panel in zip(axes, panels):
        values = np.array([[np.nan if v is None else v for v in row] for row in panel["speedup"]], dtype=float)
        spread = max(float(np.nanmax(np.abs(np.log2(values)))) if np.isfinite(values).any() else 0.0, 0.1)
        cmap = plt.get_cmap("RdBu").with_extremes(bad="#dddddd")  # no speedup there: grey, not the white of 1.0x
        image = ax.imshow(np.log2(values), cmap=cmap, vmin=-spread, vmax=spread, aspect="auto")
        for i, row in enumerate(panel["text"]):
            for j, label in enumerate(row):
                ax.text(j, i, label, ha="center", va="center", fontsize=7)
        for i, context in enumerate(panel["contexts"]):
            if context in panel["frontier"]:
                j = panel["batches"].index(panel["frontier"][context])
                ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, linewidth=2, edgecolor="black"))
        ax.set_xticks(range(len(panel["batches"])), [f"bs{b}" for b in panel["batches"]])
        ax.set_yticks(range(len(panel["contexts"])), [md.fmt_tokens(c) for c in panel["contexts"]])
        ax.set_xlabel("batch size")
        ax.set_ylabel("context")
        ax.set_title(_wrap(f"{panel['arm']} vs faster dense (outlined: its own frontier): "
                           f"{setup_title(panel['setup'])}"), fontsize=8)
        bar = fig.colorbar(image, ax=ax)
        bar.set_label("log2 speedup")
    return _save(plt, fig, path, caption)


def plot_quality(evals: pd.DataFrame, path: Path, caption: str = "") -> Path | None:
    """Mean score with its 95% CI vs budget per arm (pooled over tasks); dense arms as dashed lines."""
    table = quality_table(evals)
    if table.empty or not (table["n"] > 0).any():
        return None
    pooled = table[(table["task"] == ALL_TASKS) | (table.groupby(TABLE_KEYS)["task"].transform("nunique") == 1)]
    pooled = pooled[pooled["n"] > 0]
    plt = _pyplot()
    groups = list(pooled.groupby(TABLE_KEYS, sort=True))
    fig, axes = _grid_of(plt, len(groups))
    for ax, ((suite, model, engine, context), group) in zip(axes, groups):
        for arm, line in group.groupby("arm_label", sort=True):
            sparse = line[line["budget_sort"] != FULL_BUDGET]
            if not sparse.empty:
                ax.plot(sparse["budget_sort"], sparse["mean"], marker="o", label=arm)
                ax.fill_between(sparse["budget_sort"], sparse["low"], sparse["high"], alpha=0.2)
            for _, dense in line[line["budget_sort"] == FULL_BUDGET].iterrows():
                ax.axhline(dense["mean"], linestyle="--", linewidth=1, color="black", label=f"{arm} (full)")
        budgets = sorted(b for b in group["budget_sort"].unique() if b != FULL_BUDGET)
        if budgets:
            ax.set_xscale("log", base=2)
            ax.set_xticks(budgets, [str(int(b)) for b in budgets])
        ax.set_xlabel("budget (tokens)")
        ax.set_ylabel("score")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(True, alpha=0.3)
        ax.set_title(_wrap(f"{suite}: {model} @ {md.fmt_tokens(context)}{engine_text(engine)}"), fontsize=8)
        ax.legend(fontsize=8)
    return _save(plt, fig, path, caption)


def plot_paired_gaps(evals: pd.DataFrame, path: Path, caption: str = "") -> Path | None:
    """Score minus FullKV's on the same prompts vs budget per sparse arm, with its 95% CI, a panel per context:
    the comparison the pooled means' overlapping intervals hide."""
    table = paired_gap_table(evals)
    if table.empty:
        return None
    plt = _pyplot()
    groups = list(table.groupby(TABLE_KEYS, sort=True))
    fig, axes = _grid_of(plt, len(groups))
    for ax, ((suite, model, engine, context), group) in zip(axes, groups):
        for arm, line in group.groupby("arm_label", sort=True):
            line = line.sort_values("budget_sort")
            ax.plot(line["budget_sort"], line["mean"], marker="o", label=arm)
            ax.fill_between(line["budget_sort"], line["low"], line["high"], alpha=0.2)
        ax.axhline(0.0, linestyle="--", linewidth=1, color="black", label="FullKV")
        budgets = sorted(group["budget_sort"].unique())
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(int(b)) for b in budgets])
        ax.set_xlabel("budget (tokens)")
        ax.set_ylabel("score - FullKV (same prompts)")
        ax.grid(True, alpha=0.3)
        ax.set_title(_wrap(f"{suite}: {model} @ {md.fmt_tokens(context)}{engine_text(engine)}"), fontsize=8)
        ax.legend(fontsize=8)
    return _save(plt, fig, path, caption)


def ttft_series(decode: pd.DataFrame) -> pd.DataFrame:
    """The data of `plot_ttft`: per (setup, arm, context) at batch 1, TTFT (the steady mean, or the single
    prefill at single-prefill contexts, `ttft_kind` says which) and a sparse arm's summary-build kernel ms."""
    ok = decode[(decode["status"] == "ok") & (decode["batch_size"] == 1)] if len(decode) else decode
    if ok.empty:
        return ok
    frame = ok[SETUP_KEYS + ["arm_label", "dense", "context_tokens", "build_kernel_mean"]].copy()
    steady = ok["ttft_mean"].notna()
    frame["ttft_ms"] = np.where(steady, ok["ttft_mean"], ok["ttft_first"])
    frame["ttft_kind"] = np.where(steady, "steady", "single prefill")
    frame = frame[frame["ttft_ms"].notna()]
    return frame.sort_values(SETUP_KEYS + ["arm_label", "context_tokens"]).reset_index(drop=True)


def plot_ttft(decode: pd.DataFrame, path: Path, caption: str = "") -> Path | None:
    """TTFT vs context per arm (log-log) beside the summary build's kernel ms of each sparse arm, per setup."""
    series = ttft_series(decode)
    if series.empty:
        return None
    plt = _pyplot()
    groups = list(series.groupby(SETUP_KEYS, sort=True))
    fig, axes = plt.subplots(len(groups), 2, figsize=(11, 4 * len(groups)), squeeze=False)
    for (left, right), (setup, group) in zip(axes, groups):
        contexts = sorted(group["context_tokens"].unique())
        for arm, line in group.groupby("arm_label", sort=True):
            left.plot(line["context_tokens"], line["ttft_ms"] / 1e3, marker="o", label=arm,
                      linestyle="--" if line["dense"].iloc[0] else "-")
            build = line[line["build_kernel_mean"].notna()]
            if not build.empty:
                right.plot(build["context_tokens"], build["build_kernel_mean"], marker="o", label=arm)
        left.set_yscale("log")
        left.set_ylabel("TTFT (s; steady, or the one prefill at long contexts)")
        right.set_ylabel("summary build, kernel ms per prefill")
        for ax in (left, right):
            _context_axis(ax, contexts)
            ax.set_title(_wrap(setup_title(setup)), fontsize=8)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
        right.set_yscale("log")
    return _save(plt, fig, path, caption)


def microscope_series(micro: pd.DataFrame) -> pd.DataFrame:
    """The data of `plot_microscope`: the fidelity table (per run, budget and selector)."""
    return fidelity_table(micro) if len(micro) else micro


def plot_microscope(micro: pd.DataFrame, path: Path, caption: str = "") -> Path | None:
    """Per microscope run: captured mass (γ) and recall, needle retention, and score-error p50/p95 vs
    budget, one line per selector."""
    table = microscope_series(micro)
    if table.empty or not (table["n"] > 0).any():
        return None
    table = table[table["n"] > 0]
    plt = _pyplot()
    runs = list(table.groupby(RUN_KEYS, sort=True))
    panels = [("gamma", "captured mass γ"), ("recall", "recall of the oracle's pages"),
              ("needle_retention", "needle pages kept"), ("score_err_p95", "score error p95 (p50 dotted)")]
    fig, axes = plt.subplots(len(runs), len(panels), figsize=(4.2 * len(panels), 3.6 * len(runs)), squeeze=False)
    for row, ((model, context, combine, engine), group) in zip(axes, runs):
        budgets = sorted(group["budget_tokens"].unique())
        for ax, (metric, label) in zip(row, panels):
            for selector, line in group.groupby("selector_label", sort=True):
                if line[metric].notna().any():
                    drawn = ax.plot(line["budget_tokens"], line[metric], marker="o", label=selector)
                    if metric == "score_err_p95" and line["score_err_p50"].notna().any():
                        ax.plot(line["budget_tokens"], line["score_err_p50"], linestyle=":", color=drawn[0].get_color())
            ax.set_xscale("log", base=2)
            ax.set_xticks(budgets, [str(int(b)) for b in budgets])
            if metric == "score_err_p95":  # errors span decades (an exact oracle sits at 0)
                ax.set_yscale("symlog", linthresh=0.01)
            ax.set_xlabel("budget (tokens)")
            ax.set_ylabel(label)
            ax.grid(True, alpha=0.3)
            ax.set_title(_wrap(f"{model or 'model ?'} @ {md.fmt_tokens(context)}" + (f", {combine}" if combine else "")
                               + (f", {engine} capture" if engine != "transformers" else "")), fontsize=8)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
    return _save(plt, fig, path, caption)


def write_plots(decode: pd.DataFrame, evals: pd.DataFrame, out_dir: Path, micro: pd.DataFrame | None = None,
                caption: str = "") -> list[Path]:
    """Every plot the frames support, as PNG files in `out_dir` (created), each captioned with `caption`
    (the records it was drawn from); returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    micro = micro if micro is not None else pd.DataFrame()
    written = [
        plot_tpot(decode, out_dir / "tpot_vs_context.png", caption),
        plot_speedup(decode, out_dir / "speedup_vs_context.png", caption),
        plot_bytes(decode, out_dir / "bytes_vs_context.png", caption),
        plot_ttft(decode, out_dir / "ttft_vs_context.png", caption),
        plot_grid(decode, out_dir / "batched_speedup_grid.png", caption),
        plot_quality(evals, out_dir / "quality_vs_budget.png", caption),
        plot_paired_gaps(evals, out_dir / "gap_to_fullkv_vs_budget.png", caption),
        plot_microscope(micro, out_dir / "microscope_vs_budget.png", caption),
    ]
    return [path for path in written if path is not None]
