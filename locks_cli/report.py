"""`locks report`: Markdown tables and plots from stored result records."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..reports.decode import RUN_CHOICES
from ..reports.plots import PlotsUnavailable
from ..reports.records import RecordsError, read_jsonl
from ..reports.render import known_records, plot_report, render_comparison, render_report
from ..reports.tables import TABLE_FORMATS, data_tables, write_tables
from .errors import fail, stderr_console

_stderr = stderr_console

# A group callback rather than a command, so `locks report FILES...` needs no subcommand name;
# interspersed args let options follow the files.
app = typer.Typer(
    help="Markdown tables and plots from stored result records.",
    no_args_is_help=True,
    subcommand_metavar="",
    context_settings={"allow_interspersed_args": True},
)


@app.callback(invoke_without_command=True)
def report(
    results: Optional[list[Path]] = typer.Argument(None, help="JSONL result files (records of `locks bench` / `locks eval`).", show_default=False),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Write the markdown here instead of stdout."),
    compare: Optional[tuple[Path, Path]] = typer.Option(None, "--compare", help="Two JSONL files A B: per-cell values and ratios B/A.", show_default=False),
    plots: Optional[Path] = typer.Option(None, "--plots", help="Also write PNG plots into this folder (needs the `plots` extra; with --compare, of B)."),
    formats: str = typer.Option("md", "--format", help="Comma-separated: md (the markdown), csv, json (each table as "
                                "<out>.<table>.csv/.json beside --out)."),
    runs: str = typer.Option("all", "--runs", help="A decode cell measured in several runs: all (every run, with its "
                             "index and date) or latest (the newest only)."),
) -> None:
    """Render the decode ladder, batched grid, kernel profile, quality and microscope tables."""
    wanted = tuple(dict.fromkeys(f.strip() for f in formats.split(",") if f.strip()))
    unknown = [f for f in wanted if f not in ("md", *TABLE_FORMATS)]
    if unknown or not wanted:
        raise fail(f"--format {formats!r}: unknown format(s) {', '.join(unknown) or '(none given)'}",
                   "pass md, csv, json or a comma-separated mix, e.g. --format md,csv")
    if runs not in RUN_CHOICES:
        raise fail(f"--runs {runs!r} unknown", f"pass one of {', '.join(RUN_CHOICES)}")
    table_formats = tuple(f for f in wanted if f in TABLE_FORMATS)
    if table_formats and out is None:
        raise fail(f"--format {','.join(table_formats)} writes files beside the markdown, and no --out was given",
                   "pass --out report.md (the tables go to report.<table>.csv / .json)")
    if table_formats and compare:
        raise fail("--format csv/json applies to a report, not to --compare", "drop --compare or use --format md")
    if not results and not compare:
        raise fail("no results given", "pass one or more JSONL files, or --compare A.jsonl B.jsonl")
    if results and compare:
        raise fail("pass either RESULTS or --compare A B, not both", "compare two files with: locks report --compare A.jsonl B.jsonl")
    try:
        if compare:
            records_a, records_b = read_jsonl([compare[0]]), read_jsonl([compare[1]])
            text = render_comparison(records_a, records_b, title=f"Locks results: {compare[0].name} → {compare[1].name}")
            records = records_b  # plots show the candidate B
        else:
            records = read_jsonl(results)
            text = render_report(records, sources=[p.name for p in results], runs=runs)
        written = plot_report(records, plots, [p.name for p in (compare[1:] if compare else results)]) if plots else []
        if table_formats:
            written += write_tables(data_tables(known_records(records), runs), out.with_suffix(""), table_formats)
    except RecordsError as exc:
        raise fail(exc.message, exc.hint or None) from None
    except PlotsUnavailable as exc:
        raise fail(str(exc)) from None
    if out and "md" in wanted:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text, encoding="utf-8")
        _stderr.print(f"wrote {out}", highlight=False)
    elif not out:
        typer.echo(text, nl=False)
    for path in written:
        _stderr.print(f"wrote {path}", highlight=False)
