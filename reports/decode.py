"""Decode records -> one tidy frame -> the decode-efficiency ladder (batch 1).

A cell is (setup, arm label, context, batch) with setup = (model, layers, graph mode, weights, dtype, TP)
and the arm label carrying the sparse knobs (format, budget). Speedup is always against the faster
dense arm of the same (setup, context, batch); guard outcomes are recomputed from the raw windows.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np
import pandas as pd

from ..harness.record_migrations import upgrade
from . import markdown as md
from .records import Record, dig, status_of
from .schemas import FLOOR_KV_ONLY, FLOOR_PRESET

SETUP_KEYS = ["model", "num_layers", "graph_mode", "dummy_weights", "dtype", "tensor_parallel_size", "async_scheduling",
              "batch_prefill", "prefill_attention"]
CELL_KEYS = SETUP_KEYS + ["arm_label", "context_tokens", "batch_size"]


def _guards(record: Record) -> dict:
    """Guard outcomes recomputed from the record's raw windows, plus the sparse-path check."""
    windows = record.get("windows") or []
    throttles = [w.get("throttle") or {} for w in windows]
    clocks_min = [t["sm_clock_min_mhz"] for t in throttles if t.get("sm_clock_min_mhz") is not None]
    clocks_max = [t["sm_clock_max_mhz"] for t in throttles if t.get("sm_clock_max_mhz") is not None]
    reasons = sorted({str(r) for t in throttles for r in (t.get("reasons_seen") or [])})
    discards = Counter(str(w["discard_reason"]) for w in windows if not w.get("clean") and w.get("discard_reason"))
    return {
        "windows_n": len(windows),
        "windows_clean": sum(bool(w.get("clean")) for w in windows),
        "windows_throttled": sum(t.get("ok") is False for t in throttles),
        "lockstep_failures": sum(w.get("lockstep_ok") is False for w in windows),
        "throttle_unavailable": any(t.get("available") is False for t in throttles),
        "throttle_reasons": ", ".join(reasons),
        "sm_clock_min_mhz": min(clocks_min) if clocks_min else np.nan,
        "sm_clock_max_mhz": max(clocks_max) if clocks_max else np.nan,
        "discards": "; ".join(f"{reason} ({count})" for reason, count in sorted(discards.items())),
        "path_failed": bool(dig(record, "path_check", "required")) and dig(record, "path_check", "ok") is False,
        "path_counters": ", ".join(f"{k}={v}" for k, v in sorted((dig(record, "path_check", "counters") or {}).items())),
    }


def arm_label(arm: str, cell: Record) -> str:
    """`locks r8i4 b=2048`: the sparse knobs that tell two runs of one arm apart (defaults left out)."""
    parts = [arm]
    if cell.get("summary_format"):
        parts.append(str(cell["summary_format"]))
    if cell.get("scorer") and cell["scorer"] != "locks":
        parts.append(str(cell["scorer"]))
    if cell.get("combine") and cell["combine"] != "share_average":
        parts.append(str(cell["combine"]))
    if cell.get("budget_tokens") is not None:
        parts.append(f"b={cell['budget_tokens']}")
    return " ".join(parts)


def _row(record: Record) -> dict:
    cell = record.get("cell") or {}
    status, reason = status_of(record)
    budget = cell.get("budget_tokens")
    arm = str(cell.get("arm") or "?")
    dense = not record.get("sparse")
    tpot_mean = dig(record, "tpot_ms", "mean", default=np.nan)
    floor_ms = record.get("step_floor_ms")
    floor_basis = str(record.get("step_floor_basis") or "")
    counters = dig(record, "ttft_ms", "build_counters") or {}
    each = [e["build_ms"] for e in (dig(record, "ttft_ms", "build_counters_each") or []) if e.get("build_ms") is not None]
    return {
        "model": str(cell.get("model") or "?"),
        "num_layers": cell.get("num_layers") if cell.get("num_layers") is not None else -1,
        "graph_mode": str(cell.get("graph_mode") or "?"),
        "dummy_weights": bool(cell.get("dummy_weights")),
        "arm": arm,
        "backend": str(cell.get("backend") or ""),
        "budget_tokens": budget,
        "dense": dense,
        "dtype": str(cell.get("dtype") or ""),
        # The cell carries these only when they differ from the default (harness/runner.cell_identity).
        "tensor_parallel_size": int(cell.get("tensor_parallel_size") or 1),
        "async_scheduling": bool(cell.get("async_scheduling")),
        "batch_prefill": str(cell.get("batch_prefill") or "per_batch"),
        "prefill_attention": str(cell.get("prefill_attention") or "exact"),
        "arm_label": arm if dense else arm_label(arm, cell),
        "context_tokens": int(cell.get("context_tokens") or 0),
        "batch_size": int(cell.get("batch_size") or 1),
        "status": status,
        "reason": reason,
        "date": str(dig(record, "provenance", "date", default="")),
        "tpot_mean": tpot_mean,
        "tpot_sd": dig(record, "tpot_ms", "sd", default=np.nan),
        "tpot_n": dig(record, "tpot_ms", "n", default=np.nan),
        "tpot_cv": dig(record, "tpot_ms", "cv", default=np.nan),
        "ttft_mean": dig(record, "ttft_ms", "steady_mean", default=np.nan),
        "ttft_sd": dig(record, "ttft_ms", "steady_sd", default=np.nan),
        "ttft_first": dig(record, "ttft_ms", "first_of_engine", default=np.nan),  # single-prefill contexts
        "build_ms": record.get("build_ms") if record.get("build_ms") is not None else np.nan,
        "build_counter_ms": counters.get("build_ms", np.nan),
        "build_counter_calls": counters.get("eager_build_calls", np.nan),
        "build_counter_summaries": counters.get("summaries_built", np.nan),
        "build_kernel_mean": float(np.mean(each)) if each else np.nan,
        "build_kernel_sd": float(np.std(each, ddof=1)) if len(each) > 1 else np.nan,
        "build_kernel_n": len(each),
        "ttft_method": str(dig(record, "ttft_ms", "method", default="") or ""),
        "bytes_dense": dig(record, "bytes_per_step", "dense", default=np.nan),
        "bytes_locks": dig(record, "bytes_per_step", "locks", default=np.nan),
        "floor_fraction": floor_ms / tpot_mean if floor_ms is not None and tpot_mean > 0 else np.nan,
        "floor_basis": floor_basis,
        "floor_why": str(record.get("step_floor_why") or ""),
        "weights_bytes": np.nan if floor_basis == FLOOR_KV_ONLY else dig(record, "bytes_per_step", "weights", default=np.nan),
        "throughput_tok_s": record.get("throughput_tok_s") if record.get("throughput_tok_s") is not None else np.nan,
        **_guards(record),
    }


RUN_CHOICES = ("all", "latest")


def decode_frame(records: Sequence[Record], runs: str = "all") -> pd.DataFrame:
    """One row per decode cell and run, with speedup. A run is one `locks bench decode` invocation (its
    provenance date). runs="all" keeps every run of a cell (`run` of `runs`, oldest first); "latest"
    keeps the newest. A failed record that a later record of the same cell retried is dropped either way
    (`superseded` counts them, with the older runs "latest" drops). Speedup: `_with_dense_reference`."""
    if runs not in RUN_CHOICES:
        raise ValueError(f"runs {runs!r} unknown; use one of {', '.join(RUN_CHOICES)}")
    if not records:
        return pd.DataFrame(columns=CELL_KEYS)
    frame = pd.DataFrame([_row(upgrade(r)) for r in records])
    frame = frame.sort_values(CELL_KEYS + ["date"], kind="stable").reset_index(drop=True)
    retried = (frame.groupby(CELL_KEYS).cumcount(ascending=False) > 0) & (frame["status"] != "ok")
    frame["superseded"] = retried.groupby([frame[k] for k in CELL_KEYS]).transform("sum").astype(int)
    frame = frame[~retried].copy()
    frame["run"] = frame.groupby(CELL_KEYS).cumcount() + 1
    frame["runs"] = frame.groupby(CELL_KEYS)["run"].transform("size")
    if runs == "latest":
        frame["superseded"] += frame["runs"] - 1
        frame = latest_runs(frame)
        frame["run"] = frame["runs"] = 1  # one run shown per cell; `superseded` carries the others
    frame = _with_dense_reference(frame)
    frame["speedup"] = np.where(frame["status"] == "ok", frame["dense_tpot"] / frame["tpot_mean"], np.nan)
    frame = _with_dense_ttft(frame)
    order = SETUP_KEYS + ["context_tokens", "batch_size", "dense", "arm_label", "run"]
    ascending = [True] * (len(order) - 3) + [False, True, True]  # dense arms first within a cell
    return frame.sort_values(order, ascending=ascending, kind="stable").reset_index(drop=True)


def latest_runs(frame: pd.DataFrame) -> pd.DataFrame:
    """The newest run of every cell: what one-value-per-cell views (grid, frontiers, plots) show."""
    if frame.empty or "run" not in frame.columns:
        return frame
    return frame[frame["run"] == frame["runs"]].reset_index(drop=True)


def _fastest_dense(frame: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    ok_dense = frame[frame["dense"] & (frame["status"] == "ok") & frame["tpot_mean"].notna()]
    fastest = ok_dense.sort_values(keys + ["tpot_mean", "arm_label"]).drop_duplicates(keys, keep="first")
    fastest = fastest[keys + ["arm_label", "tpot_mean", "throughput_tok_s"]]
    fastest.columns = keys + ["dense_arm", "dense_tpot", "dense_throughput"]
    return fastest


def _with_dense_reference(frame: pd.DataFrame) -> pd.DataFrame:
    """dense_arm / dense_tpot / dense_throughput: the faster dense arm over the dense cells' latest runs; for
    a cell measured in several runs, the faster dense arm of each row's own run where that run has one (so
    repeated runs pair side by side; `dense_same_run`)."""
    cell = SETUP_KEYS + ["context_tokens", "batch_size"]
    same = _fastest_dense(frame, cell + ["date"])
    other = _fastest_dense(latest_runs(frame), cell).add_suffix("_latest")
    frame = frame.merge(same, on=cell + ["date"], how="left")
    frame = frame.merge(other, left_on=cell, right_on=[f"{k}_latest" for k in cell], how="left")
    frame["dense_same_run"] = frame["dense_tpot"].notna() & (frame["runs"] > 1)
    for column in ("dense_arm", "dense_tpot", "dense_throughput"):
        frame[column] = frame[column].where(frame["dense_same_run"], frame[f"{column}_latest"])
    return frame.drop(columns=[c for c in frame.columns if c.endswith("_latest")])


def _with_dense_ttft(frame: pd.DataFrame) -> pd.DataFrame:
    """`build_delta`: a sparse arm's steady TTFT minus the lowest steady TTFT of an ok dense arm of the
    same (setup, context, batch), the prefill cost of a backend that builds summaries in every prefill."""
    cell = SETUP_KEYS + ["context_tokens", "batch_size"]
    dense = frame[frame["dense"] & (frame["status"] == "ok") & frame["ttft_mean"].notna()]
    dense = dense.sort_values(cell + ["ttft_mean", "arm_label"]).drop_duplicates(cell, keep="first")
    dense = dense[cell + ["arm_label", "ttft_mean"]].set_axis(cell + ["dense_ttft_arm", "dense_ttft"], axis=1)
    frame = frame.merge(dense, on=cell, how="left")
    frame["build_delta"] = np.where(~frame["dense"] & (frame["status"] == "ok"),
                                    frame["ttft_mean"] - frame["dense_ttft"], np.nan)
    return frame


def setup_title(setup: tuple) -> str:
    model, layers, graph_mode, dummy, dtype, tp, async_scheduling, batch_prefill, prefill_attention = setup
    layers_text = "all layers" if layers == -1 else f"{layers} layers"
    dtype_text = f", {dtype}" if dtype else ""
    tp_text = f", TP={tp}" if tp != 1 else ""
    async_text = ", async scheduling" if async_scheduling else ""
    async_text += ", one prefill per engine shared by its batches" if batch_prefill == "once" else ""
    async_text += ", prefill attention skipped (decode timing only, no TTFT)" if prefill_attention == "skip" else ""
    return (f"{model}, {layers_text}{dtype_text}{tp_text}, graph {graph_mode}{async_text}, "
            f"{'dummy' if dummy else 'real'} weights")


def cell_name(row: pd.Series) -> str:
    return f"decode {row['model']} {row['arm_label']} @ {md.fmt_tokens(row['context_tokens'])} bs{row['batch_size']}"


def guard_flags(row: pd.Series) -> tuple[list[str], str]:
    """Short flags for every guard that did not pass, and the sentence that spells them out."""
    n, clean = int(row["windows_n"]), int(row["windows_clean"])
    flags, details = [], [f"{clean} of {n} windows clean"]
    if n == 0:
        flags.append("unguarded")
        details = ["no guard windows recorded"]
    if row["windows_throttled"]:
        flags.append("throttled")
        clock = ""
        if not md.missing(row["sm_clock_min_mhz"]):
            clock = f"; SM clock {row['sm_clock_min_mhz']:.0f}–{row['sm_clock_max_mhz']:.0f} MHz"
        details.append(f"{row['windows_throttled']} throttled (reasons: {row['throttle_reasons'] or 'none named'}{clock})")
    if row["lockstep_failures"]:
        flags.append("lockstep")
        details.append(f"{row['lockstep_failures']} lockstep failures")
    if row["throttle_unavailable"]:
        flags.append("no NVML")
        details.append("throttle guard unavailable, clocks unverified")
    if row["path_failed"]:
        flags.append("path check failed")
        details.append(f"sparse path check failed ({row['path_counters'] or 'no counters'})")
    if row["discards"]:
        details.append(f"discarded: {row['discards']}")
    if row["superseded"]:
        flags.append("rerun")
        details.append(f"{row['superseded']} older record(s) of this cell superseded")
    return flags, f"{cell_name(row)}: " + "; ".join(details)


def guard_marker(row: pd.Series, notes: md.Notes) -> str:
    """A footnote marker when an `ok` cell has any guard flag, else the empty string."""
    if row["status"] != "ok":
        return ""
    flags, sentence = guard_flags(row)
    return notes.mark(sentence) if flags else ""


def guard_cell(row: pd.Series, notes: md.Notes) -> str:
    """`ok (5/5)` when every guard passed, else short flags with a footnote that spells them out."""
    if row["status"] != "ok":
        return md.DASH
    flags, sentence = guard_flags(row)
    counts = f"({int(row['windows_clean'])}/{int(row['windows_n'])})"
    if not flags:
        return f"ok {counts}"
    return f"{', '.join(flags)} {counts}" + notes.mark(sentence)


def _bytes_cell(row: pd.Series) -> str:
    if row["dense"]:
        return md.fmt_bytes(row["bytes_dense"])
    text = md.fmt_bytes(row["bytes_locks"])
    if not md.missing(row["bytes_dense"]) and not md.missing(row["bytes_locks"]) and row["bytes_locks"] > 0:
        text += f" ({row['bytes_dense'] / row['bytes_locks']:.1f}× less)"
    return text


def _build_cell(row: pd.Series, notes: md.Notes) -> str:
    """Δ TTFT vs dense; the harness's own first-after-decode estimate instead where it published one."""
    if row["dense"]:
        return md.DASH
    if not md.missing(row["build_ms"]):
        text = md.fmt_num(row["build_ms"], 0) + notes.mark(
            "Build ms measured by the harness: first prefill after a decode minus the steady TTFT (above 3 sd of "
            "the steady repeats; the one-time build of a backend that builds summaries lazily), not Δ TTFT vs dense")
    else:
        text = md.fmt_num(row["build_delta"], 0)
        if text != md.DASH:
            text += f" (vs {row['dense_ttft_arm']})"
    return text


def _build_kernel_cell(row: pd.Series, notes: md.Notes) -> str:
    """The summary build's kernel time per prefill from the backend counters (CUDA events), mean ± sd over the
    prefills they were read around."""
    if row["dense"] or not row["build_kernel_n"]:
        return md.DASH
    n = int(row["build_kernel_n"])
    text = md.fmt_pm(row["build_kernel_mean"], row["build_kernel_sd"], 0) if n > 1 else md.fmt_num(row["build_kernel_mean"], 0)
    around = "the measured prefill (single-prefill context)" if row["ttft_method"] == "single" else (
        f"each of {n} steady prefills" if n > 1 else "one steady prefill")
    summaries = "" if md.missing(row["build_counter_summaries"]) else (
        f": {int(row['build_counter_summaries'])} summaries built in {md.fmt_int(row['build_counter_calls'])} "
        "eager build calls per prefill")
    return text + notes.mark(f"{cell_name(row)}: backend counters around {around}{summaries}")


def _floor_cell(row: pd.Series, notes: md.Notes) -> str:
    text = md.fmt_pct(row["floor_fraction"])
    if text == md.DASH:
        return text
    where = f"{row['model']} ({'all' if row['num_layers'] == -1 else row['num_layers']} layers)"
    if row["floor_basis"] == FLOOR_KV_ONLY:
        return text + " KV only" + notes.mark(
            f"{where}: {row['floor_why']}, so Floor counts the attention bytes alone (KV only) and omits the "
            "weights every step reads")
    if row["floor_basis"] == FLOOR_PRESET:
        return text + notes.mark(
            f"{where}: the records predate bytes_per_step.weights; Floor counts {md.fmt_bytes(row['weights_bytes'])} "
            "of weights per step computed from the model preset's geometry (harness/weights.py)")
    return text


def arm_run_label(row: pd.Series) -> str:
    """The arm, and for a cell measured in several runs which one and when: 'fa3 (run 2 of 3, 12-01 20:32)'."""
    runs = int(row.get("runs", 1) or 1)
    if runs <= 1:
        return row["arm_label"]
    when = str(row["date"])[5:16].replace("T", " ")
    return f"{row['arm_label']} (run {int(row['run'])} of {runs}, {when})"


def cell_columns(row: pd.Series, notes: md.Notes) -> dict[str, str]:
    """The ladder's columns of one cell, built in an order that numbers footnotes the same way each time."""
    ok = row["status"] == "ok"
    tpot = md.fmt_pm(row["tpot_mean"], row["tpot_sd"]) if ok else notes.status_cell(row["status"], row["reason"], cell_name(row))
    return {
        "Context": md.fmt_tokens(row["context_tokens"]),
        "Batch": str(row["batch_size"]),
        "Arm": arm_run_label(row),
        "TPOT ms (mean ± sd)": tpot,
        "n": md.fmt_int(row["tpot_n"]) if ok else md.DASH,
        "Speedup": md.fmt_ratio(row["speedup"]),
        "tok/s": md.fmt_num(row["throughput_tok_s"], 0) if ok else md.DASH,
        "Steady TTFT ms": _ttft_cell(row, notes) if ok else md.DASH,
        BUILD: _build_cell(row, notes) if ok else md.DASH,
        BUILD_KERNEL: _build_kernel_cell(row, notes) if ok else md.DASH,
        "KV bytes/step": _bytes_cell(row) if ok else md.DASH,
        FLOOR: _floor_cell(row, notes) if ok else md.DASH,
        "Guards": guard_cell(row, notes),
    }


def _ttft_cell(row: pd.Series, notes: md.Notes) -> str:
    if md.missing(row["ttft_mean"]) and not md.missing(row.get("ttft_first", np.nan)):
        return md.fmt_num(row["ttft_first"], 1) + notes.mark(
            "single-prefill context: TTFT is the engine's only prefill (n = 1, the engine's first, so it includes "
            "one-time work); no steady repeats are paid at this length")
    return md.fmt_pm(row["ttft_mean"], row["ttft_sd"], 1)


BUILD = "Build ms (Δ TTFT vs dense)"
BUILD_KERNEL = "Build kernel ms"
FLOOR = "Floor (weights + KV)"
LADDER_HEADER = ["Context", "Arm", "TPOT ms (mean ± sd)", "n", "Speedup", "Steady TTFT ms",
                 BUILD, BUILD_KERNEL, "KV bytes/step", FLOOR, "Guards"]
BATCHED_HEADER = ["Context", "Batch", "Arm", "TPOT ms (mean ± sd)", "n", "Speedup", "tok/s", "KV bytes/step", FLOOR,
                  "Guards"]
BATCHED_LEGEND = ("One decode step emits one token per request of the batch (tok/s = batch / TPOT). Speedup is "
                  "against the faster dense arm at the same context and batch; KV bytes/step and the floor are "
                  "summed over the batch.")
LADDER_LEGEND = (
    "Speedup is against the faster dense arm (lower TPOT) of the same context. "
    f"{BUILD}: a sparse arm's steady TTFT minus the lowest steady TTFT of a dense arm of the same model, "
    "context, batch and run setup (named in brackets), i.e. the summary build done inside every prefill. "
    f"{BUILD_KERNEL}: the summary build's kernel time in one prefill (CUDA events read by the backend), mean ± sd "
    "over the prefills it was read around. "
    "KV bytes/step: attention bytes only (all KV for a dense arm; summaries scanned + selected pages for Locks). "
    f"{FLOOR}: (weight bytes a step reads + KV bytes/step) / the copy bandwidth recorded with the cell, "
    "as a share of the measured TPOT.")


def _align(header: list[str]) -> str:
    return "".join("l" if title in ("Context", "Arm", "TPOT ms (mean ± sd)", "Guards") else "r" for title in header)


def _tables(frame: pd.DataFrame, header: list[str], notes: md.Notes) -> list[str]:
    parts = []
    for setup, group in frame.groupby(SETUP_KEYS, sort=True):
        rows = [[columns[title] for title in header] for columns in (cell_columns(row, notes) for _, row in group.iterrows())]
        parts += ["", f"### {setup_title(setup)}", "", md.table(header, rows, _align(header))]
    return parts


def render_ladder(frame: pd.DataFrame, notes: md.Notes) -> str:
    """Batch-1 cells: one table per setup, rows by context then arm (dense arms first)."""
    ladder = frame[frame["batch_size"] == 1] if len(frame) else frame
    if ladder.empty:
        return ""
    return "\n".join(["## Decode-efficiency ladder (batch 1)", "", LADDER_LEGEND, *_tables(ladder, LADDER_HEADER, notes)])



def render_batched(frame: pd.DataFrame, notes: md.Notes) -> str:
    """Every cell above batch 1, one table per setup: the numbers behind the grid (TPOT per arm, tokens/s,
    bytes, floor, guards), and the only place batched cells of a setup without a sparse arm appear."""
    rest = frame[frame["batch_size"] != 1] if len(frame) else frame
    if rest.empty:
        return ""
    return "\n".join(["## Batched cells (batch > 1)", "", BATCHED_LEGEND, *_tables(rest, BATCHED_HEADER, notes)])
