"""The report's tables as data: one pandas frame per table, written as CSV and/or JSON beside the markdown.

The frames are the ones the markdown is rendered from, with plain column names and no formatting, so
`pd.read_csv("report.decode.csv")` gives the same numbers the tables show (means unrounded, NaN empty).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from .decode import CELL_KEYS, SETUP_KEYS, decode_frame
from .grid import grid_frame
from .kernel import kernel_frame
from .microscope import fidelity_table, microscope_frame
from .quality import budget_text, eval_frame, quality_table
from .records import RecordSet
from .schemas import DECODE, EVAL, KERNEL, MICROSCOPE
from .task_floors import budget_floor_table, fullkv_task_table

TABLE_FORMATS = ("csv", "json")

# The decode frame's columns a reader wants, in this order (the rest are rendering helpers).
DECODE_COLUMNS = CELL_KEYS + [
    "run", "runs", "arm", "budget_tokens", "dense", "status", "reason", "date", "tpot_mean", "tpot_sd", "tpot_n", "tpot_cv",
    "speedup", "dense_arm", "dense_same_run", "dense_tpot", "throughput_tok_s", "ttft_mean", "ttft_sd", "ttft_first", "build_ms",
    "build_delta", "build_kernel_mean", "build_kernel_sd", "bytes_dense", "bytes_locks", "weights_bytes",
    "floor_fraction", "floor_basis", "windows_n", "windows_clean",
]


def noise_frame(decode: pd.DataFrame) -> pd.DataFrame:
    """Per (setup, arm): ok cells, median and max TPOT sd/mean, and where the max sits."""
    ok = decode[(decode["status"] == "ok") & decode["tpot_cv"].notna()] if len(decode) else decode
    rows = []
    for key, cells in ok.groupby(SETUP_KEYS + ["arm_label"], sort=True):
        worst = cells.loc[cells["tpot_cv"].idxmax()]
        rows.append({**dict(zip(SETUP_KEYS + ["arm_label"], key)), "ok_cells": len(cells),
                     "median_cv": cells["tpot_cv"].median(), "max_cv": worst["tpot_cv"],
                     "max_at_context": worst["context_tokens"], "max_at_batch": worst["batch_size"]})
    return pd.DataFrame(rows, columns=SETUP_KEYS + ["arm_label", "ok_cells", "median_cv", "max_cv", "max_at_context",
                                                    "max_at_batch"])


def data_tables(record_set: RecordSet, runs: str = "all") -> dict[str, pd.DataFrame]:
    """name -> frame for every table the records support (an empty table is left out); the decode table
    has a row per run of a repeated cell with runs="all" (`run`, `runs`, `date`)."""
    decode = decode_frame(record_set.get(DECODE), runs)
    tables: dict[str, pd.DataFrame] = {}
    if len(decode):
        tables["decode"] = decode[[c for c in DECODE_COLUMNS if c in decode.columns]]
        grid = grid_frame(decode)  # the sparse arms' cells with their speedup and frontier flag
        if (grid["batch_size"] > 1).any():
            tables["batched_grid"] = grid[CELL_KEYS + ["status", "speedup", "is_frontier", "throughput_tok_s",
                                                       "dense_arm", "dense_throughput"]]
        noise = noise_frame(decode)
        if len(noise):
            tables["noise"] = noise
    evals = eval_frame(record_set.get(EVAL))
    quality = quality_table(evals)
    for name, frame in (("fullkv_tasks", fullkv_task_table(evals)), ("budget_floors", budget_floor_table(evals))):
        if len(frame):
            tables[name] = frame
    if len(quality):  # the budget as the markdown writes it ("full" for FullKV), not its sort key
        budget = quality.pop("budget_sort").map(budget_text)
        quality.insert(quality.columns.get_loc("arm_label"), "budget", budget)
        tables["quality"] = quality
    fidelity = fidelity_table(microscope_frame(record_set.get(MICROSCOPE)))
    if len(fidelity):
        tables["microscope"] = fidelity
    kernel = kernel_frame(record_set.get(KERNEL))
    if len(kernel):
        tables["kernel"] = kernel
    return tables


def write_tables(tables: dict[str, pd.DataFrame], stem: Path, formats: tuple[str, ...]) -> list[Path]:
    """`<stem>.<table>.<format>` for each table and format; returns the paths written."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    written = []
    for name, frame in tables.items():
        frame = frame.reset_index(drop=True)
        for fmt in formats:
            path = stem.parent / f"{stem.name}.{name}.{fmt}"
            if fmt == "csv":
                frame.to_csv(path, index=False, lineterminator="\n")
            else:
                path.write_text(frame.to_json(orient="records", indent=1, double_precision=10) + "\n", encoding="utf-8")
            written.append(path)
    return written
