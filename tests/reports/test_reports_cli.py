"""`locks report` through typer's CliRunner, and the PNG plots (file type and size, not pixels)."""

from __future__ import annotations

import builtins
from pathlib import Path

import pytest
from conftest import check_golden
from locks_toolkit.locks_cli.main import app
from locks_toolkit.reports.records import read_jsonl
from locks_toolkit.reports.render import plot_report, render_comparison, render_report
from typer.testing import CliRunner

FIXTURES = Path(__file__).parents[1] / "fixtures"


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
runner = CliRunner()


def stderr_text(result) -> str:
    """stderr with rich's line wrapping undone."""
    return " ".join(result.stderr.split())


def fixture(name: str) -> str:
    return str(FIXTURES / f"{name}.jsonl")


def test_report_prints_the_markdown_of_all_given_files():
    result = runner.invoke(app, ["report", fixture("decode"), fixture("eval")])
    assert result.exit_code == 0, result.output
    expected = render_report(read_jsonl([fixture("decode"), fixture("eval")]), sources=["decode.jsonl", "eval.jsonl"])
    assert result.stdout == expected and "- Files: `decode.jsonl`, `eval.jsonl`" in expected


def test_report_writes_to_out_when_options_follow_the_files(tmp_path):
    out = tmp_path / "sub" / "report.md"
    result = runner.invoke(app, ["report", fixture("kernel"), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_text(encoding="utf-8") == render_report(read_jsonl([fixture("kernel")]), sources=["kernel.jsonl"])
    assert result.stdout == ""


def test_compare_mode(tmp_path):
    result = runner.invoke(app, ["report", "--compare", fixture("compare_a"), fixture("compare_b")])
    assert result.exit_code == 0, result.output
    expected = render_comparison(read_jsonl([fixture("compare_a")]), read_jsonl([fixture("compare_b")]),
                                 title="Locks results: compare_a.jsonl → compare_b.jsonl")
    assert result.stdout == expected


def test_missing_file_is_a_one_line_error():
    result = runner.invoke(app, ["report", "no/such/results.jsonl"])
    assert result.exit_code == 2
    assert "error: results file no/such/results.jsonl does not exist" in stderr_text(result)
    assert "hint: pass the JSONL written by `locks bench`" in stderr_text(result)
    assert "Traceback" not in result.output


def test_no_known_schema_names_the_fix():
    result = runner.invoke(app, ["report", fixture("unknown")])
    assert result.exit_code == 2
    assert "no record of a known schema (found: locks.bench.prefill/0)" in stderr_text(result)
    assert "hint: pass JSONL written by `locks bench` or `locks eval`" in stderr_text(result)


def test_results_and_compare_together_are_rejected():
    result = runner.invoke(app, ["report", fixture("decode"), "--compare", fixture("compare_a"), fixture("compare_b")])
    assert result.exit_code == 2
    assert "either RESULTS or --compare" in stderr_text(result)


def test_plots_are_png_files(tmp_path):
    files = [fixture("decode"), fixture("eval"), fixture("microscope")]
    result = runner.invoke(app, ["report", *files, "--plots", str(tmp_path / "plots")])
    assert result.exit_code == 0, result.output
    names = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert names == ["batched_speedup_grid.png", "bytes_vs_context.png", "gap_to_fullkv_vs_budget.png",
                     "microscope_vs_budget.png", "quality_vs_budget.png", "speedup_vs_context.png",
                     "tpot_vs_context.png", "ttft_vs_context.png"]  # fmt: skip
    for path in (tmp_path / "plots").iterdir():
        data = path.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000


def test_plots_only_for_what_the_records_hold(tmp_path):
    assert plot_report(read_jsonl([fixture("kernel")]), tmp_path) == []
    sparse_only = [r for r in read_jsonl([fixture("eval")]) if (r.get("cell") or {}).get("arm") != "fullkv"]
    names = [p.name for p in plot_report(sparse_only, tmp_path / "sparse")]
    assert names == ["quality_vs_budget.png"]  # no FullKV records: no gaps to draw


def test_missing_matplotlib_is_a_clear_error(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    result = runner.invoke(app, ["report", fixture("decode"), "--plots", str(tmp_path)])
    assert result.exit_code == 2
    assert "pip install 'locks-toolkit[plots]'" in stderr_text(result)


@pytest.mark.parametrize("args", [["report"], ["report", "--help"]])
def test_help_names_the_options(args):
    result = runner.invoke(app, args)
    assert "--compare" in result.output and "--plots" in result.output


def test_tables_as_csv_and_json_beside_the_markdown(tmp_path):
    import json

    import pandas as pd

    out = tmp_path / "report.md"
    files = [fixture(name) for name in ("decode", "eval", "microscope", "kernel")]
    result = runner.invoke(app, ["report", *files, "--out", str(out), "--format", "md,csv,json"])
    assert result.exit_code == 0, result.output
    assert out.read_text(encoding="utf-8") == render_report(read_jsonl(files), sources=[Path(f).name for f in files])
    names = {"decode", "batched_grid", "noise", "quality", "fullkv_tasks", "budget_floors", "microscope", "kernel"}
    assert {p.name for p in tmp_path.iterdir()} == {"report.md"} | {f"report.{n}.{f}" for n in names for f in ("csv", "json")}
    decode = pd.read_csv(tmp_path / "report.decode.csv")
    # the numbers behind the ladder: the markdown shows fa3 @ 32k bs8 as 9.10 ± 0.03
    row = decode[(decode["arm_label"] == "fa3") & (decode["context_tokens"] == 32768) & (decode["batch_size"] == 8)].iloc[0]
    assert f"{row['tpot_mean']:.2f} ± {row['tpot_sd']:.2f}" == "9.10 ± 0.03"
    assert f"| 32k | 8 | fa3 | {row['tpot_mean']:.2f} ± {row['tpot_sd']:.2f} |" in out.read_text(encoding="utf-8")
    as_json = json.loads((tmp_path / "report.decode.json").read_text(encoding="utf-8"))
    assert len(as_json) == len(decode) and as_json[0].keys() == set(decode.columns)
    grid = pd.read_csv(tmp_path / "report.batched_grid.csv")
    frontier = grid[grid["is_frontier"]]
    assert "**1.59×**" in out.read_text() and (frontier["speedup"].round(2) == 1.59).any()
    quality = pd.read_csv(tmp_path / "report.quality.csv")
    assert {"task", "budget", "arm_label", "n", "mean", "low", "high"} <= set(quality.columns)
    scored = quality.dropna(subset=["mean"])
    assert (scored["low"] <= scored["mean"]).all() and (scored["mean"] <= scored["high"]).all()
    assert "full" in set(quality["budget"].astype(str))
    first = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    again = runner.invoke(app, ["report", *reversed(files), "--out", str(out), "--format", "md,csv,json"])
    tables = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.suffix != ".md"}
    assert again.exit_code == 0 and tables == {k: v for k, v in first.items() if not k.endswith(".md")}  # deterministic
    check_golden("tables.decode.csv", (tmp_path / "report.decode.csv").read_text(encoding="utf-8"))
    check_golden("tables.batched_grid.csv", (tmp_path / "report.batched_grid.csv").read_text(encoding="utf-8"))


@pytest.mark.parametrize("args,message", [
    (["--format", "csv"], "no --out was given"),
    (["--format", "md,xls"], "unknown format(s) xls"),
])
def test_table_formats_refuse_bad_input_with_the_fix(args, message):
    result = runner.invoke(app, ["report", fixture("decode"), *args])
    assert result.exit_code != 0 and message in stderr_text(result)


def test_every_figure_is_captioned_with_its_records(monkeypatch, tmp_path):
    from locks_toolkit.reports import plots

    captions = []
    real_save = plots._save
    monkeypatch.setattr(plots, "_save", lambda plt, fig, path, caption="": captions.append(caption) or real_save(plt, fig, path, caption))
    result = runner.invoke(app, ["report", fixture("decode"), fixture("microscope"), "--plots", str(tmp_path)])
    assert result.exit_code == 0, result.output
    stored = read_jsonl([fixture("decode"), fixture("microscope")])
    commit = stored[0]["provenance"]["git_commit"][:12]
    assert len(captions) == len(list(tmp_path.iterdir())) and len(set(captions)) == 1
    assert captions[0].startswith("records: decode.jsonl, microscope.jsonl · commit ") and commit in captions[0]


def test_runs_keeps_every_run_or_the_latest(tmp_path):
    rerun_file = tmp_path / "rerun.jsonl"
    first = Path(fixture("decode")).read_text().splitlines()[0]  # fa3 @ 16k bs1
    rerun_file.write_text(first.replace('"date": "2026-11-28T09:01:00+00:00"', '"date": "2026-12-01T00:00:00+00:00"') + "\n")
    both = runner.invoke(app, ["report", fixture("decode"), str(rerun_file)])
    assert both.exit_code == 0, both.output
    assert "| fa3 (run 1 of 2, 11-28 09:01) |" in both.output and "| fa3 (run 2 of 2, 12-01 00:00) |" in both.output
    latest = runner.invoke(app, ["report", fixture("decode"), str(rerun_file), "--runs", "latest"])
    assert latest.exit_code == 0 and "(run " not in latest.output and "1 older record(s) of this cell superseded" in latest.output
    bad = runner.invoke(app, ["report", fixture("decode"), "--runs", "best"])
    assert bad.exit_code != 0 and "--runs 'best' unknown" in bad.output and "all, latest" in bad.output
