"""The whole report: records -> markdown text. Pure; the same records always give the same bytes."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pandas as pd

from . import markdown as md
from .compare import render_comparison_tables
from .decode import decode_frame, latest_runs, render_batched, render_ladder
from .grid import render_grid
from .kernel import kernel_frame, render_kernel
from .microscope import microscope_frame, render_microscope
from .noise import render_noise
from .provenance import provenance_header, records_caption
from .quality import eval_frame, render_paired_gaps, render_quality
from .records import Record, RecordSet, RecordsError, split_by_schema
from .schemas import DECODE, EVAL, KERNEL, KNOWN_SCHEMAS, MICROSCOPE
from .task_floors import render_task_floors


def known_records(records: Iterable[Record], name: str = "the results") -> RecordSet:
    """Split by schema; raise when nothing is of a schema this report knows."""
    record_set = split_by_schema(records)
    if not record_set.by_schema:
        found = ", ".join(record_set.unknown) or "no records at all"
        raise RecordsError(
            f"{name} hold no record of a known schema (found: {found})",
            f"pass JSONL written by `locks bench` or `locks eval` (schemas {', '.join(KNOWN_SCHEMAS)})",
        )
    return record_set


def _document(title: str, sections: list[str], notes: md.Notes) -> str:
    parts = [f"# {title}"] + [s for s in sections if s]
    if len(notes):
        parts.append("## Notes\n\n" + notes.render())
    return "\n\n".join(parts) + "\n"


def decode_sections(frame: pd.DataFrame, notes: md.Notes) -> list[str]:
    """The decode tables (ladder, batched grid, batched cells, noise) that `locks report` and
    `locks bench decode` share; together they show every cell, failed ones by a footnote with the reason."""
    return [render_ladder(frame, notes), render_grid(frame, notes), render_batched(frame, notes), render_noise(frame)]


def render_decode_run(records: Iterable[Record], title: str = "Decode cells") -> str:
    """The closing summary of `locks bench decode`: the decode sections of `locks report` for these records."""
    frame = decode_frame(split_by_schema(records).get(DECODE))
    if frame.empty:
        return "_no decode records_\n"
    notes = md.Notes()
    return _document(title, decode_sections(frame, notes), notes)


def render_report(records: Iterable[Record], title: str = "Locks results", sources: list[str] | None = None,
                  runs: str = "all") -> str:
    """Provenance (with the `sources` files when given), then every table the records support, then one
    footnote per cell that is not clean. runs: "all" shows every run of a repeated cell, "latest" its newest."""
    record_set = known_records(records)
    notes = md.Notes()
    decode = decode_frame(record_set.get(DECODE), runs)
    sections = [
        provenance_header(record_set, notes, sources),
        *decode_sections(decode, notes),
        render_kernel(kernel_frame(record_set.get(KERNEL)), notes),
        render_quality(evals := eval_frame(record_set.get(EVAL)), notes),
        render_paired_gaps(evals),
        render_task_floors(evals),
        render_microscope(microscope_frame(record_set.get(MICROSCOPE)), notes),
    ]
    return _document(title, sections, notes)


def render_comparison(records_a: Iterable[Record], records_b: Iterable[Record], title: str = "Locks results: A vs B") -> str:
    """Both provenance headers, then per-cell `A → B (B/A)` tables for every kind either side holds."""
    set_a, set_b = known_records(records_a, "A"), known_records(records_b, "B")
    notes = md.Notes()
    header_a = provenance_header(set_a, notes).replace("## Provenance", "## Provenance of A", 1)
    header_b = provenance_header(set_b, notes).replace("## Provenance", "## Provenance of B", 1)
    return _document(title, [header_a, header_b, *render_comparison_tables(set_a, set_b, notes)], notes)


def plot_report(records: Iterable[Record], out_dir: Path, sources: list[str] | None = None) -> list[Path]:
    """PNG plots for the records (reports/plots.py), each captioned with `sources` (file names), commits,
    GPUs and dates."""
    from .plots import write_plots  # matplotlib is optional: imported only when plots are asked for

    record_set = known_records(records)
    caption = records_caption(record_set.all, sources)
    return write_plots(latest_runs(decode_frame(record_set.get(DECODE))), eval_frame(record_set.get(EVAL)), out_dir,
                       micro=microscope_frame(record_set.get(MICROSCOPE)), caption=caption)
