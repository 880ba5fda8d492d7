"""`reports/`: every table against a golden file, plus hand-checked numbers behind them.

Fixtures (tests/fixtures/*.jsonl) are hand-chosen records that include refused, OOM, throttled and
error cells. Golden files live in tests/golden/. After an intended change of the output, regenerate
them and review the diff:

    UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/reports/test_reports.py -q

The test then rewrites the golden files and passes; without the variable a mismatch fails.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
from conftest import check_golden
from locks_toolkit.reports import markdown as md
from locks_toolkit.reports.compare import ratios
from locks_toolkit.reports.decode import decode_frame, latest_runs, render_ladder
from locks_toolkit.reports.grid import grid_frame, render_grid
from locks_toolkit.reports.kernel import kernel_frame, render_kernel
from locks_toolkit.reports.microscope import fidelity_table, microscope_frame, render_microscope
from locks_toolkit.reports.noise import render_noise
from locks_toolkit.reports.provenance import provenance_header
from locks_toolkit.reports.quality import bootstrap_ci, eval_frame, quality_table, render_quality
from locks_toolkit.reports.records import RecordsError, read_jsonl, split_by_schema
from locks_toolkit.reports.render import render_comparison, render_report
from locks_toolkit.reports.schemas import DECODE, EVAL, KERNEL, MICROSCOPE

FIXTURES = Path(__file__).parents[1] / "fixtures"
ALL = [FIXTURES / f"{name}.jsonl" for name in ("decode", "kernel", "eval", "microscope", "unknown")]


def records(name: str) -> list[dict]:
    return read_jsonl([FIXTURES / f"{name}.jsonl"])


def section(render, frame) -> str:
    """One table with its own footnotes, as the golden files hold it."""
    notes = md.Notes()
    return render(frame, notes) + "\n\n" + notes.render() + "\n"


# --- golden files: one per table, and the whole report --------------------------------------------------


def test_ladder_golden():
    check_golden("ladder.md", section(render_ladder, decode_frame(records("decode"))))


def test_ladder_with_weights_and_build_golden():
    check_golden("ladder_weights.md", section(render_ladder, decode_frame(records("decode_weights"))))


def test_grid_golden():
    check_golden("grid.md", section(render_grid, decode_frame(records("decode"))))


def test_kernel_golden():
    check_golden("kernel.md", section(render_kernel, kernel_frame(records("kernel"))))


def test_quality_golden():
    check_golden("quality.md", section(render_quality, eval_frame(records("eval"))))


def test_microscope_golden():
    check_golden("microscope.md", section(render_microscope, microscope_frame(records("microscope"))))


def test_provenance_golden():
    record_set = split_by_schema(read_jsonl(ALL))
    notes = md.Notes()
    check_golden("provenance.md", provenance_header(record_set, notes) + "\n\n" + notes.render() + "\n")


def test_full_report_golden_and_independent_of_record_order():
    all_records = read_jsonl(ALL)
    text = render_report(all_records)
    check_golden("report.md", text)
    shuffled = list(all_records)
    random.Random(7).shuffle(shuffled)
    assert render_report(shuffled) == text


def test_compare_golden():
    text = render_comparison(records("compare_a"), records("compare_b"), title="A vs B")
    check_golden("compare.md", text)


# --- nothing silently dropped -------------------------------------------------------------------------


def test_every_failed_cell_has_a_footnote_with_its_reason():
    all_records = read_jsonl(ALL)
    text = render_report(all_records)
    failed = [r for r in all_records if r.get("status") not in (None, "ok")]
    assert {r["status"] for r in failed} == {"refused", "oom", "error"}  # the fixtures cover every failure
    notes = text.split("## Notes", 1)[1]
    for record in failed:
        assert record["reason"] in notes, f"no footnote for {record['cell']}"


def test_throttled_and_lockstep_windows_are_footnoted():
    notes = md.Notes()
    table = render_ladder(decode_frame(records("decode")), notes)
    assert "throttled (2/3)[^" in table and "lockstep (2/3)[^" in table and "no NVML (3/3)[^" in table
    assert "SM clock 1410–1980 MHz" in notes.render()
    assert "sw_thermal_slowdown" in notes.render()


def test_unknown_schema_is_counted_not_dropped():
    text = render_report(read_jsonl(ALL))
    assert "`locks.bench.prefill/0`: 1 record not shown[^" in text


def test_every_run_of_a_repeated_cell_is_kept_with_its_index_and_date():
    decode = records("decode")
    rerun = json.loads(json.dumps(decode[0]))  # fa3 @ 16k bs1, measured again later
    rerun["tpot_ms"]["mean"] = 6.50
    rerun["provenance"]["date"] = "2026-12-01T00:00:00+00:00"
    frame = decode_frame([rerun] + decode)  # file order must not matter: the date decides
    row = frame[(frame["arm_label"] == "fa3") & (frame["context_tokens"] == 16384) & (frame["batch_size"] == 1)]
    assert row["tpot_mean"].tolist() == [decode[0]["tpot_ms"]["mean"], 6.50]
    assert row["run"].tolist() == [1, 2] and row["runs"].tolist() == [2, 2] and row["superseded"].tolist() == [0, 0]
    table = render_ladder(frame, md.Notes())
    assert "| fa3 (run 2 of 2, 12-01 00:00) | 6.50 ± " in table and "| fa3 (run 1 of 2, " in table
    # each run's speedup is against the dense arms of its own run: run 2 has only fa3, so 1.00x
    assert row["dense_same_run"].tolist() == [True, True] and row["speedup"].tolist()[1] == pytest.approx(1.0)
    assert len(latest_runs(frame)) == len(decode_frame(decode))  # one row per cell again
    with pytest.raises(ValueError, match="runs 'some' unknown"):
        decode_frame(decode, runs="some")


def test_latest_run_of_a_repeated_cell_wins_and_is_flagged_when_asked():
    decode = records("decode")
    rerun = json.loads(json.dumps(decode[0]))  # fa3 @ 16k bs1, measured again later
    rerun["tpot_ms"]["mean"] = 6.50
    rerun["provenance"]["date"] = "2026-12-01T00:00:00+00:00"
    frame = decode_frame([rerun] + decode, runs="latest")
    row = frame[(frame["arm_label"] == "fa3") & (frame["context_tokens"] == 16384) & (frame["batch_size"] == 1)]
    assert len(row) == 1 and row["tpot_mean"].item() == 6.50 and row["superseded"].item() == 1
    notes = md.Notes()
    assert "rerun (3/3)[^" in render_ladder(frame, notes)
    assert "1 older record(s) of this cell superseded" in notes.render()


# --- hand-checked numbers -----------------------------------------------------------------------------


def _cell(frame, arm_label, context, batch):
    hit = frame[(frame["arm_label"] == arm_label) & (frame["context_tokens"] == context) & (frame["batch_size"] == batch)]
    assert len(hit) == 1
    return hit.iloc[0]


def test_speedup_is_against_the_faster_dense_arm():
    frame = decode_frame(records("decode"))
    # 32k: flashinfer (6.91) beats fa3 (7.33); 1m: flashinfer errored, so fa3 (27.50) is the reference.
    assert _cell(frame, "locks r8i4 b=2048", 32768, 1)["speedup"] == pytest.approx(6.91 / 7.24)
    assert _cell(frame, "fa3", 32768, 1)["speedup"] == pytest.approx(6.91 / 7.33)
    assert _cell(frame, "locks r8i4 b=2048", 1048576, 1)["speedup"] == pytest.approx(27.50 / 12.95)
    assert _cell(frame, "locks r8i4 b=2048", 1048576, 1)["dense_arm"] == "fa3"
    # 128k bs16: both dense arms OOM, so no speedup exists although the sparse arm ran.
    assert math.isnan(_cell(frame, "locks r8i4 b=2048", 131072, 16)["speedup"])
    floor = _cell(frame, "fa3", 16384, 1)
    assert floor["floor_fraction"] == pytest.approx(records("decode")[0]["floor_ms"] / 6.93)


@pytest.mark.parametrize("key, value, title", [
    ("async_scheduling", True, ", async scheduling"),
    ("prefill_attention", "skip", ", prefill attention skipped (decode timing only, no TTFT)"),
])
def test_another_protocol_is_another_setup(key, value, title):
    """Async scheduling, or a cache filled without prefill attention: cells apart from the plain ones, titled so."""
    plain = records("decode")
    other = [json.loads(json.dumps(r)) for r in plain]
    for record in other:
        record["cell"][key] = value
        if record.get("tpot_ms"):
            record["tpot_ms"]["mean"] = record["tpot_ms"]["mean"] / 2  # never compared with the plain cells
    frame = decode_frame(plain + other)
    moved = frame[frame[key] == value]
    assert len(frame) == 2 * len(decode_frame(plain)) and len(moved) == len(frame) // 2
    # speedups are taken within a setup: halving every other TPOT leaves them unchanged
    assert sorted(moved["speedup"].dropna()) == pytest.approx(sorted(frame[frame[key] != value]["speedup"].dropna()))
    text = render_ladder(frame, md.Notes())
    titles = [line for line in text.splitlines() if line.startswith("### ")]
    assert len(titles) == 2 and {t.replace(title, "") for t in titles} == {min(titles, key=len)}
    assert sum(f"{title}, dummy weights" in t for t in titles) == 1


def test_frontier_is_the_largest_batch_with_a_speedup():
    sparse = grid_frame(decode_frame(records("decode")))
    frontier = sparse[sparse["is_frontier"]].set_index("context_tokens")["batch_size"].to_dict()
    assert frontier == {16384: 1, 32768: 32, 131072: 8, 1048576: 1}
    table = render_grid(decode_frame(records("decode")), md.Notes())
    assert "**1.26×**" in table and "**1.59×**" in table  # 15.40/12.20 and 29.00/18.20
    assert "bs32: 2623 / 2078 (flashinfer)" in table  # 32 * 1000 / 12.20 and 32 * 1000 / 15.40
    assert "dense OOM; 31.40 ms[^" in table


def test_compare_ratios_by_hand():
    a, b = split_by_schema(records("compare_a")), split_by_schema(records("compare_b"))
    keys, metrics = ["arm_label", "context_tokens", "batch_size"], ["tpot_mean", "speedup"]
    merged = ratios(decode_frame(a.get(DECODE)), decode_frame(b.get(DECODE)), keys, metrics).set_index(keys)
    locks_32k = merged.loc[("locks r8i4 b=2048", 32768, 1)]
    assert locks_32k["tpot_mean_ratio"] == pytest.approx(0.966851, abs=1e-6)  # 7.00 / 7.24
    assert locks_32k["speedup_ratio"] == pytest.approx(1.034286, abs=1e-6)  # (7.33/7.00) / (7.33/7.24)
    locks_128k = merged.loc[("locks r8i4 b=2048", 131072, 1)]
    assert locks_128k["status_b"] == "oom" and math.isnan(locks_128k["tpot_mean_ratio"])
    assert merged.loc[("fa3", 1048576, 1), "side"] == "right_only"
    quality = ratios(quality_table(eval_frame(a.get(EVAL))), quality_table(eval_frame(b.get(EVAL))),
                     ["task", "arm_label"], ["mean"])
    assert quality["mean_ratio"].tolist() == [pytest.approx(4 / 3)]  # 1.00 / 0.75
    text = render_comparison(records("compare_a"), records("compare_b"))
    # each side with its n and 95% CI: 7.24 ± 1.96 x 0.03 / sqrt(30) = [7.229, 7.251]
    assert "7.24 [7.23, 7.25] n=30 → 7.00 [6.99, 7.01] n=30 (0.967×)" in text
    assert "| 1.01× → 1.05× (1.034×) |" in text  # no n or CI where the measure has none
    assert "8.27 [" in text and "→ OOM[^" in text and "absent → 12.50 [" in text
    assert "0.750 [0.250, 1.000] n=4 → 1.000 [1.000, 1.000] n=4 (1.333×)" in text


def test_bootstrap_all_equal_scores_give_a_zero_width_interval():
    mean, low, high = bootstrap_ci([0.7] * 9)
    assert mean == low == high == pytest.approx(0.7)


def test_bootstrap_two_values_hand_case():
    # Resampling {0, 1} twice gives means 0, 0.5, 1 with probabilities 1/4, 1/2, 1/4: the 2.5% and
    # 97.5% quantiles are the sample's own extremes.
    assert bootstrap_ci([0.0, 1.0]) == (0.5, 0.0, 1.0)
    mean, low, high = bootstrap_ci([0.0, 1.0] * 10)
    assert mean == 0.5 and 0.0 <= low < 0.5 < high <= 1.0
    assert bootstrap_ci([0.0, 1.0] * 10) == (mean, low, high)  # seeded: deterministic
    assert all(math.isnan(v) for v in bootstrap_ci([]))


def test_quality_table_counts_failures_and_pools_tasks():
    table = quality_table(eval_frame(records("eval"))).set_index(["task", "arm_label", "budget_sort"])
    fullkv = table.loc[("niah_single_2", "fullkv", math.inf)]
    assert fullkv["n"] == 5 and fullkv["mean"] == 1.0 and "OOM (1)" in fullkv["failures"]
    refused = table.loc[("niah_single_2", "locks r8i4", 32.0)]
    assert refused["n"] == 0 and "refused (3)" in refused["failures"]
    pooled = table.loc[("(all tasks)", "locks r8i4", 2048.0)]
    assert pooled["n"] == 12 and pooled["mean"] == pytest.approx((6 * 1.0 + 5.0) / 12)


def _eval_record(task, record_id, arm, budget, score):
    """A scored eval record at 4K with only what the quality tables read."""
    return {"schema": "locks.eval/1", "status": "ok", "score": score, "engine": "vllm",
            "cell": {"suite": "ruler", "model": "m", "context_tokens": 4096, "task": task, "record_id": record_id,
                     "arm": arm, "budget_tokens": budget}}  # fmt: skip


def test_the_pooled_row_holds_only_the_records_every_arm_ran():
    rec = _eval_record
    rows = [rec(t, f"{t}/{i}", arm, b, 1.0) for t in ("a", "b") for i in range(2)
            for arm, b in (("fullkv", None), ("locks", 64), ("quest", 64))]  # fmt: skip
    rows += [rec("c", f"c/{i}", arm, b, 0.0) for i in range(8) for arm, b in (("fullkv", None), ("locks", 64))]
    rows += [rec("a", "a/9", "locks", 64, 0.0)]  # a record only one arm ran
    frame = eval_frame(rows)
    table = quality_table(frame).set_index(["task", "arm_label", "budget_sort"])
    pooled = table.loc[("(all tasks)", "locks", 64.0)]
    assert pooled["n"] == 4 and pooled["mean"] == 1.0  # not 4 of 13 (c and a/9 left out): the same prompts as quest
    assert table.loc[("c", "locks", 64.0)]["n"] == 8
    text = render_quality(frame, notes := md.Notes())
    assert "(all tasks)[^" in text and "left out, not run by every arm: c" in notes.render()


def test_pooled_rows_weigh_every_task_alike_and_hold_the_prompts_every_arm_ran_at_that_budget():
    from locks_toolkit.reports.quality import paired_gap_table

    rec = _eval_record
    settings = (("fullkv", None), ("locks", 64), ("quest", 64), ("locks", 128), ("quest", 128))
    rows = [rec("a", f"a/{i}", arm, b, 1.0) for i in range(2) for arm, b in settings]
    rows += [rec("b", f"b/{i}", arm, b, 0.0) for i in range(8) for arm, b in settings]
    # a prompt cut short: FullKV and both arms at 64 ran, quest at 128 did not
    rows += [rec("b", "b/8", arm, b, 1.0 if b == 128 else 0.0) for arm, b in settings[:4]]
    frame = eval_frame(rows)
    table = quality_table(frame).set_index(["task", "arm_label", "budget_sort"])
    assert table.loc[("(all tasks)", "locks", 64.0)]["mean"] == pytest.approx(0.5)  # the task means' mean, not 2/11
    assert table.loc[("(all tasks)", "locks", 64.0)]["n"] == 11
    assert table.loc[("(all tasks)", "locks", 128.0)]["n"] == 10  # b/8 left out where quest lacks it
    assert table.loc[("(all tasks)", "locks", 128.0)]["mean"] == pytest.approx(0.5)
    assert table.loc[("b", "locks", 128.0)]["n"] == 9  # the task's own row keeps every record
    gaps = paired_gap_table(frame).set_index(["budget_sort", "arm_label"])
    assert gaps.loc[(128.0, "locks")]["n"] == 10 and gaps.loc[(128.0, "locks")]["mean"] == pytest.approx(0.0)


def test_budget_floors_walk_down_from_the_largest_budget_and_name_what_fullkv_cannot_do():
    from locks_toolkit.reports.task_floors import budget_floor_table, render_task_floors

    rec = _eval_record
    # task a: FullKV 1.0; locks 0.0 at 64, 1.0 at 128, 0.0 at 256 (a dip), 1.0 at 512; quest 0.95 from 64 on
    locks = {64: 0.0, 128: 1.0, 256: 0.0, 512: 1.0}
    rows = [rec("a", f"a/{i}", "fullkv", None, 1.0) for i in range(2)]
    rows += [rec("a", f"a/{i}", "locks", b, s) for i in range(2) for b, s in locks.items()]
    rows += [rec("a", f"a/{i}", "quest", b, 0.95) for i in range(2) for b in locks]
    rows += [rec("z", "z/0", arm, b, 0.0) for arm, b in (("fullkv", None), ("locks", 64), ("quest", 64))]
    rows += [rec("w", "w/0", "fullkv", None, 1.0), rec("w", "w/0", "locks", 64, 0.0)]  # below at its one budget
    floors = budget_floor_table(eval_frame(rows)).set_index(["task", "arm_label"])
    assert floors.loc[("a", "locks"), "floor"] == 512  # 128 keeps up, but 256 does not: the floor is above the dip
    assert floors.loc[("a", "quest"), "floor"] == 64
    assert math.isnan(floors.loc[("w", "locks"), "floor"]) and floors.loc[("w", "locks"), "largest"] == 64
    text = render_task_floors(eval_frame(rows))
    assert "| a | 512 / 64 |" in text and "| z | FullKV 0 |" in text and "| w | >64 / — |" in text
    assert "| z | 0.00 (n=1) |" in text and "| **3-task mean** | **0.67** |" in text


def test_task_mean_ci_resamples_within_each_task():
    from locks_toolkit.reports.quality import task_mean_ci

    mean, low, high = task_mean_ci([[1.0, 1.0], [0.0] * 8])
    assert mean == low == high == pytest.approx(0.5)  # no task's spread: no interval, whatever the counts
    mean, low, high = task_mean_ci([[0.0, 1.0] * 10, [0.5] * 3])
    assert mean == pytest.approx(0.5) and 0.25 < low < 0.5 < high < 0.75  # half the one task's own interval
    assert all(math.isnan(v) for v in task_mean_ci([[], []]))


def test_the_same_cell_from_two_engines_is_two_cells_in_two_tables():
    base = [r for r in records("eval") if r.get("status") == "ok"][:3]
    both = [{**r, "engine": "transformers"} for r in base] + [{**r, "engine": "vllm", "score": 1.0 - r["score"]} for r in base]
    table = quality_table(eval_frame(both))
    per_engine = table[table["task"] != "(all tasks)"].groupby("engine")["n"].sum()
    assert per_engine.to_dict() == {"transformers": 3, "vllm": 3}  # neither engine's records replace the other's
    text = render_quality(eval_frame(both), md.Notes())
    assert ", transformers engine" in text and ", vllm engine" in text


def test_microscope_combines_mean_max_and_sum():
    frame = microscope_frame(records("microscope"))
    row = fidelity_table(frame).set_index(["budget_tokens", "selector_label"]).loc[(2048, "locks r8i4")]
    assert row["n"] == 4
    assert row["gamma"] == pytest.approx((0.951 + 0.946 + 0.936 + 0.931) / 4)  # layers 0 and 20, records r0 and r1
    assert row["score_err_max"] == 0.1944  # layer 20; layer 0 has 0.162
    assert row["bound_violations"] == 1 + 1 + 3 + 3  # layer 0: 1 each, layer 20: 3 each


def test_microscope_reads_the_names_of_suites_summarize():
    # suites/records.py nests `summarize([cell])` under `metrics`; a pooled summary row is flat.
    names = {"gamma_mean": 0.91, "gamma_c_mean": 0.85, "recall_mean": 0.8, "share_log_err_wmean": 0.02,
             "needle_retention": None, "audit_violated": 2}
    cell = {"selector": "locks", "format": "r8i4", "budget_tokens": 256, "layer": 3, "record_id": "niah-0"}
    nested = {"schema": MICROSCOPE, "cell": cell, "status": "ok", "reason": None, "metrics": names}
    flat = {"schema": MICROSCOPE, "cell": {**cell, "layer": None}, "status": "ok", **names}
    for record in (nested, flat):
        row = microscope_frame([record]).iloc[0]
        assert (row["gamma"], row["gamma_c"], row["recall"], row["share_log_err"], row["bound_violations"]) == (0.91, 0.85, 0.8, 0.02, 2)
        assert math.isnan(row["needle_retention"])


def test_kernel_stages_are_exploded_from_the_bench_record():
    frame = kernel_frame(records("kernel")).set_index(["context_tokens", "batch_size", "stage"])
    score = frame.loc[(1048576, 1, "score")]
    assert score["us_per_layer"] == 41.0
    assert score["floor_fraction"] == pytest.approx((65536 * 2 * 960 / 4.23e12 * 1e6) / 41.0, abs=1e-4)
    assert frame.loc[(1048576, 4, "*"), "status"] == "oom"  # a failed cell has no stages, one row
    table = render_kernel(kernel_frame(records("kernel")), md.Notes())
    assert "| 1m | 1 | 2048 | 1950.0 (8%) | 41.0 (73%) |" in table and "5.00× (flashinfer)" in table  # 290 / 58


def test_kernel_rows_name_the_kernels_a_cell_timed():
    import copy

    stored = records("kernel")
    assert "Kernels" not in render_kernel(kernel_frame(stored), md.Notes())  # records that do not say: no column
    named = copy.deepcopy(stored)
    for record in named:
        record["kernels"] = {"score": "cuda", "select": "chunked" if record["cell"]["context_tokens"] >= 1 << 20 else "one",
                             "pdl": False}
    table = render_kernel(kernel_frame(named), md.Notes())
    assert "| Kernels (score / select) |" in table
    assert "| 1m | 1 | 2048 | 1950.0 (8%) | 41.0 (73%) |" in table and "| cuda / chunked |" in table


def test_kernel_floor_fraction_derived_when_missing():
    record = {"schema": KERNEL, "cell": {"geometry": "g", "context_tokens": 1024, "batch_size": 1,
              "budget_tokens": 256, "stage": "attend"}, "status": "ok", "us_per_layer": 8.0, "floor_us": 6.0}
    assert kernel_frame([record]).iloc[0]["floor_fraction"] == 0.75


def test_no_known_schema_is_an_error_naming_the_fix():
    with pytest.raises(RecordsError, match="no record of a known schema .*locks bench"):
        render_report(records("unknown"))


def test_markdown_number_spellings():
    assert [md.fmt_tokens(t) for t in (0, None, 3 << 20, 3 << 10, 1536, 7)] == ["—", "—", "3m", "3k", "1536", "7"]
    assert md.with_format("locks", "r8i4") == "locks r8i4" and md.with_format("locks r8i4", "r8i4") == "locks r8i4"
    assert md.with_format("oracle", None) == "oracle"


def test_markdown_table_rejects_a_wrong_alignment():
    with pytest.raises(ValueError, match="2 letters for 3 columns"):
        md.table(["a", "b", "c"], [], "lr")


def test_a_cpu_smoke_record_as_the_harness_writes_it_renders():
    from locks_toolkit.harness.traffic import step_stats

    tpot = step_stats([41.0, 43.5, 42.0, 44.1], batch=1)
    window = {"step_ms": [41.0, 43.5, 42.0, 44.1], "lockstep_ok": True, "clean": True, "discard_reason": None,
              "throttle": {"available": False, "ok": None, "reasons_seen": [], "reasons_mask": None,
                           "sm_clock_min_mhz": None, "sm_clock_max_mhz": None, "reason": "NVML unavailable"},
              "nvml_samples": None}
    record = {
        "schema": DECODE, "kind": "decode", "status": "ok", "reason": "",
        "cell": {"arm": "cpu", "backend": "CPU_ATTN", "model": "tiny-llama", "num_layers": 2, "context_tokens": 512,
                 "batch_size": 1, "budget_tokens": None, "summary_format": None, "graph_mode": "none",
                 "dummy_weights": True, "dtype": "float32", "workload": "1q1s512"},
        "provenance": {"git_commit": None, "git_dirty": None, "versions": {"vllm": None}, "gpu": None, "date": "2026-11-29T16:00:00+00:00"},
        "tpot_ms": tpot, "throughput_tok_s": tpot["tokens_per_s"], "windows": [window], "ttft_ms": None, "build_ms": None,
        "bytes_per_step": {"dense": 4194304, "locks": None, "live_tokens": 520, "floor_ms": 0.5}, "floor_ms": 0.5,
        "path_check": {"required": False, "ok": True, "status": "not_applicable", "counters": None},
    }
    text = render_report([record])
    assert f"| 512 | cpu | {tpot['mean']:.2f} ± {tpot['sd']:.2f} | 4 | 1.00× | — | — | — | 4.2 MB |" in text
    assert "no NVML (1/1)[^" in text and "GPUs: no GPU" in text and "Commits: unknown" in text


def test_readme_example_is_the_current_output():
    readme = (Path(__file__).parents[2] / "reports" / "README.md").read_text(encoding="utf-8")
    example = readme.split("not a measurement):\n\n", 1)[1].split("\n\nModules:", 1)[0]
    rendered = section(render_ladder, decode_frame(records("decode")))
    for block in example.split("\n\n"):
        assert block in rendered, "reports/README.md example is stale; paste the ladder from tests/golden/ladder.md"


def test_compare_when_each_side_holds_a_different_kind():
    text = render_comparison(records("decode"), records("microscope"))
    assert "## Decode cells: A → B (B/A)" in text and "## Selection fidelity (microscope): A → B (B/A)" in text
    assert "6.93 [6.92, 6.94] n=30 → absent" in text and "absent → 0.952" in text  # fa3 @ 16k; oracle γ at b=2048


def test_batched_dense_only_cells_are_listed_not_dropped():
    dense_bs8 = [r for r in records("decode") if r["cell"]["arm"] != "locks" and r["cell"]["batch_size"] == 8]
    text = render_report(dense_bs8)
    assert "## Batched cells (batch > 1)" in text
    assert "| 32k | 8 | fa3 | 9.10 ± 0.03 |" in text and "| 1m | 8 | fa3 | refused[^" in text
    only_bs8 = [r for r in records("decode") if r["cell"]["batch_size"] == 8]  # no batch-1 cell at all
    text = render_report(only_bs8)
    assert "**1.59×**" in text
    # the grid's numbers, per arm: TPOT and tokens/s (batch / TPOT) beside the speedup
    row = next(line for line in text.splitlines() if line.startswith("| 32k | 8 | locks"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    mean = float(cells[3].split(" ± ")[0])
    assert float(cells[6]) == pytest.approx(8 / mean * 1e3, rel=0.01) and cells[5].endswith("×")


def test_noise_is_the_median_and_max_sd_over_mean_per_arm():
    rng = random.Random(11)
    cells, expected = [], {}
    for arm, budget in (("locks", 2048), ("fa3", None)):
        cvs = []
        for context in (16384, 32768, 131072):
            record = json.loads(json.dumps(records("decode")[0]))
            record["cell"].update(arm=arm, budget_tokens=budget, summary_format="r8i4" if budget else None,
                                  context_tokens=context)
            mean, sd = rng.uniform(5, 30), rng.uniform(0.01, 2)
            record["tpot_ms"] = {"mean": mean, "sd": sd, "n": 30}  # no `cv`: derived from sd / mean
            if context == 32768:
                record["tpot_ms"]["cv"] = rng.uniform(0.01, 0.3)  # the harness's own value wins
            cvs.append((record["tpot_ms"].get("cv", sd / mean), context))
            cells.append(record)
        worst = max(cvs)
        expected[arm] = [f"{100 * sorted(cvs)[1][0]:.1f}%", f"{100 * worst[0]:.1f}%", f"{worst[1] >> 10}k bs1"]
    failed = json.loads(json.dumps(cells[0]))
    failed.update(status="oom", reason="no memory")
    failed["cell"]["context_tokens"] = 1 << 20  # an OOM cell with timings is not counted
    text = render_noise(decode_frame(cells + [failed]))
    rows = [line.strip("|").split(" | ") for line in text.splitlines() if line.startswith(("| fa3 ", "| locks "))]
    assert [row[0].strip() for row in rows] == ["fa3", "locks r8i4 b=2048"]  # dense arms first
    assert [[c.strip() for c in row[1:]] for row in rows] == [["3", *expected["fa3"]], ["3", *expected["locks"]]]
    assert render_noise(decode_frame([failed])) == "" and render_noise(decode_frame([])) == ""


@pytest.mark.parametrize("schema", [DECODE, KERNEL, EVAL, MICROSCOPE])
def test_bare_records_render_with_dashes_not_crashes(schema):
    text = render_report([{"schema": schema, "status": "ok"}, {"schema": schema}])
    assert "no status field" in text  # the record without a status is an error cell with its footnote


# --- build cost and the step floor (tests/fixtures/decode_weights.jsonl: the H200 FA3/Locks pair, the 32k
# cells rewritten as the current harness writes them, plus a local model the report cannot know) --------


def test_build_is_the_steady_ttft_above_the_fastest_dense_prefill():
    weights_records = records("decode_weights")
    frame = decode_frame(weights_records)
    steady = {(r["cell"]["model"], r["cell"]["arm"], r["cell"]["context_tokens"]): r["ttft_ms"]["steady_mean"]
              for r in weights_records}
    for context in (32768, 131072):
        locks = _cell(frame[frame["model"] == "glm-4-9b-chat-1m"], "locks r8i4 b=2048", context, 1)
        expected = steady[("glm-4-9b-chat-1m", "locks", context)] - steady[("glm-4-9b-chat-1m", "fa3", context)]
        assert locks["build_delta"] == pytest.approx(expected) and locks["dense_ttft_arm"] == "fa3"
        assert math.isnan(locks["build_ms"])  # 32k: null with a reason; 128k: the old record's -16 ms is noise
    lazy = _cell(frame, "locks-kv r8i4 b=2048", 32768, 1)
    assert lazy["build_ms"] == pytest.approx(250.0)  # a harness estimate above 3 sd is kept, and marked
    notes = md.Notes()
    table = render_ladder(frame, notes)
    assert f"| {expected:.0f} (vs fa3) |" in table and "| 250[^" in table
    assert "| 41[^" in table  # the build's kernel time in one steady prefill (backend counters)
    assert "around one steady prefill: 81920 summaries built in 160 eager build calls per prefill" in notes.render()


def test_dense_reference_for_build_is_the_lower_steady_ttft_not_the_lower_tpot():
    fa3, locks = [r for r in records("decode_weights") if r["cell"]["model"] == "glm-4-9b-chat-1m"
                  and r["cell"]["context_tokens"] == 32768]
    other = json.loads(json.dumps(fa3))
    other["cell"].update(arm="flashinfer", backend="FLASHINFER")
    other["tpot_ms"]["mean"] = 20.0  # slower decode, faster prefill
    other["ttft_ms"]["steady_mean"] = 1300.0
    row = _cell(decode_frame([fa3, other, locks]), "locks r8i4 b=2048", 32768, 1)
    assert row["dense_arm"] == "fa3" and row["dense_ttft_arm"] == "flashinfer"
    assert row["build_delta"] == pytest.approx(locks["ttft_ms"]["steady_mean"] - 1300.0)


def test_floor_counts_the_weights_a_step_reads():
    from locks_toolkit.harness.presets import load_preset_config
    from locks_toolkit.harness.weights import weights_from_config

    weights_records = records("decode_weights")
    frame = decode_frame(weights_records)
    by_cell = {(r["cell"]["model"], r["cell"]["arm"], r["cell"]["context_tokens"]): r for r in weights_records}
    glm = frame[frame["model"] == "glm-4-9b-chat-1m"]
    recorded = by_cell[("glm-4-9b-chat-1m", "locks", 32768)]
    row = _cell(glm, "locks r8i4 b=2048", 32768, 1)
    assert row["floor_basis"] == "recorded"
    assert row["floor_fraction"] == pytest.approx(recorded["step_floor_ms"] / recorded["tpot_ms"]["mean"])
    old = by_cell[("glm-4-9b-chat-1m", "locks", 131072)]  # no weights recorded: the preset supplies them
    weights = weights_from_config(load_preset_config("glm-4-9b-chat-1m"))["read_per_step"]
    row = _cell(glm, "locks r8i4 b=2048", 131072, 1)
    floor_ms = (weights + old["bytes_per_step"]["locks"]) / 4.23e12 * 1e3
    assert row["floor_basis"] == "preset" and row["floor_fraction"] == pytest.approx(floor_ms / old["tpot_ms"]["mean"])
    unknown = by_cell[("/models/mystery-7b", "fa3", 32768)]
    row = _cell(frame[frame["model"] == "/models/mystery-7b"], "fa3", 32768, 1)
    assert row["floor_basis"] == "kv_only" and row["floor_fraction"] == pytest.approx(unknown["floor_ms"] / unknown["tpot_ms"]["mean"])
    assert "8% KV only[^" in render_ladder(frame, md.Notes())


def test_the_committed_h200_ladder_renders_its_single_prefill_rungs_and_build_kernel_time():
    """The bs1 ladder as the harness wrote it on the H200: rungs from 128K on paid one prefill (TTFT n = 1,
    footnoted), the build kernel time is a mean ± sd over the steady prefills below that, and speedups are
    against the faster dense arm of each rung."""
    from locks_toolkit.reports.plots import bytes_series, ttft_series

    path = Path(__file__).parents[2] / "docs" / "results" / "efficiency" / "ladder-bs1-h200.jsonl"
    stored = [json.loads(line) for line in path.read_text().splitlines()]
    frame = decode_frame(stored)
    locks = _cell(frame, "locks r8i4 b=2048", 524288, 1)
    fastest = min((r for r in stored if r["cell"]["context_tokens"] == 524288 and r["cell"]["budget_tokens"] is None),
                  key=lambda r: r["tpot_ms"]["mean"])
    assert locks["dense_arm"] == fastest["cell"]["arm"]
    assert locks["speedup"] == pytest.approx(fastest["tpot_ms"]["mean"] / locks["tpot_mean"])
    notes = md.Notes()
    table = render_ladder(frame, notes)
    rendered = notes.render()
    assert "single-prefill context: TTFT is the engine's only prefill (n = 1" in rendered
    assert "around the measured prefill (single-prefill context)" in rendered
    small = next(r for r in stored if r["cell"]["arm"] == "locks" and r["cell"]["context_tokens"] == 16384)
    each = [e["build_ms"] for e in small["ttft_ms"]["build_counters_each"]]
    assert len(each) == 3 and f"| {np.mean(each):.0f} ± {np.std(each, ddof=1):.0f}[^" in table
    series = bytes_series(frame)
    row = series[(series["arm_label"] == "locks r8i4 b=2048") & (series["context_tokens"] == 524288)].iloc[0]
    assert row["attention_bytes"] == locks["bytes_locks"] < locks["bytes_dense"] / 9
    ttft = ttft_series(frame).set_index(["arm_label", "context_tokens"])
    # below 128K the steady mean, from 128K the one prefill; the build kernel ms rides along for Locks
    assert ttft.loc[("fa3", 16384), "ttft_kind"] == "steady" and ttft.loc[("fa3", 524288), "ttft_kind"] == "single prefill"
    assert ttft.loc[("fa3", 524288), "ttft_ms"] == pytest.approx(_cell(frame, "fa3", 524288, 1)["ttft_first"])
    assert ttft.loc[("locks r8i4 b=2048", 16384), "build_kernel_mean"] == pytest.approx(np.mean(each))


def test_own_frontiers_compare_each_arm_at_its_largest_batch_that_ran():
    """At 128K the fixture's Locks runs bs16 where both dense arms OOM: its own frontier (bs16) is compared
    with the best dense throughput at the dense arms' own frontier (bs8), not at an equal batch."""
    from locks_toolkit.reports.grid import own_frontiers

    stored = records("decode")
    tput = {(r["cell"]["arm"], r["cell"]["context_tokens"], r["cell"]["batch_size"]): r.get("throughput_tok_s")
            for r in stored if r["status"] == "ok"}
    row = own_frontiers(decode_frame(stored)).set_index("context_tokens").loc[131072]
    assert (row["frontier_batch"], row["dense_frontier_batch"]) == (16, 8)
    best_dense = max(tput[("fa3", 131072, 8)], tput[("flashinfer", 131072, 8)])
    assert row["ratio"] == pytest.approx(tput[("locks", 131072, 16)] / best_dense)
    assert row["dense_frontier_arm"] == max(("fa3", "flashinfer"), key=lambda arm: tput[(arm, 131072, 8)])


def test_grid_heat_map_series_holds_the_speedups_labels_and_own_frontier():
    from locks_toolkit.reports.plots import grid_series

    frame = decode_frame(records("decode"))
    (panel,) = grid_series(frame)
    assert panel["arm"] == "locks r8i4 b=2048" and panel["batches"] == [1, 8, 16, 32]
    i, j = panel["contexts"].index(131072), panel["batches"].index(8)
    assert panel["speedup"][i][j] == pytest.approx(_cell(frame, "locks r8i4 b=2048", 131072, 8)["speedup"])
    assert panel["text"][i][panel["batches"].index(16)] == "dense\nOOM"  # Locks ran where no dense arm fit
    assert panel["speedup"][i][panel["batches"].index(16)] is None
    assert panel["frontier"][131072] == 16 and panel["frontier"][32768] == 32
    assert grid_series(frame[frame["batch_size"] == 1]) == []  # no batched cell: no heat map


def test_microscope_plot_series_is_the_fidelity_table():
    from locks_toolkit.reports.microscope import fidelity_table, microscope_frame
    from locks_toolkit.reports.plots import microscope_series

    frame = microscope_frame(records("microscope"))
    series = microscope_series(frame)
    assert series.equals(fidelity_table(frame)) and len(series) > 0
    assert microscope_series(frame.iloc[0:0]).empty


def test_microscope_report_pools_samples_and_needle_counts_as_the_terminal_table_does():
    """Two records of one (budget, selector) with 10 and 30 samples: pooled γ is 0.8 (the plain mean would
    be 0.7) and needle kept 1 of 4 eligible pages (the mean of the records' ratios would be 0.5)."""
    from locks_toolkit.reports.microscope import fidelity_table, microscope_frame

    def record(rid, samples, gamma, kept, eligible, p50):
        return {"schema": "locks.microscope/1", "kind": "microscope", "status": "ok",
                "cell": {"selector": "locks", "format": "r8i4", "budget_tokens": 256, "layer": 5, "record_id": rid,
                         "model": "m", "context_tokens": 4096, "combine": "share_average"},
                "metrics": {"samples": samples, "gamma": gamma, "gamma_c": gamma, "recall": gamma,
                            "needle_kept": kept, "needle_eligible": eligible, "needle_retention": kept / eligible,
                            "score_err_p50": p50}}

    table = fidelity_table(microscope_frame([record("a", 10, 0.5, 1, 1, 0.1), record("b", 30, 0.9, 0, 3, 0.3)]))
    (row,) = table.to_dict("records")
    assert row["gamma"] == pytest.approx(0.8) and row["recall"] == pytest.approx(0.8)
    assert row["needle_retention"] == pytest.approx(0.25)
    assert row["score_err_p50"] == pytest.approx(0.2)  # a per-record percentile: the record mean, labelled so
    assert "Score err p50 (record mean)" in render_microscope(microscope_frame([record("a", 10, 0.5, 1, 1, 0.1)]), md.Notes())


def test_paired_gaps_compare_each_prompt_with_fullkv_on_the_same_prompt():
    from locks_toolkit.reports.quality import paired_gap_table, render_paired_gaps

    rec = _eval_record
    rng = random.Random(7)
    fullkv = {f"t/{i}": rng.random() for i in range(40)}  # prompts of very different difficulty
    rows = [rec("t", key, "fullkv", None, score) for key, score in fullkv.items()]
    rows += [rec("t", key, "locks", 64, score - 0.05) for key, score in fullkv.items()]  # 0.05 below, every prompt
    rows += [rec("t", "t/99", "locks", 64, 0.0)]  # a prompt FullKV did not run: no pair
    gap = paired_gap_table(eval_frame(rows)).set_index(["budget_sort", "arm_label"]).loc[(64.0, "locks")]
    assert gap["n"] == 40 and gap["mean"] == pytest.approx(-0.05)
    assert gap["high"] - gap["low"] < 1e-9  # paired: the prompts' spread is gone; the means' CIs apart are wide
    means = quality_table(eval_frame(rows)).set_index(["task", "arm_label", "budget_sort"])
    assert means.loc[("t", "locks", 64.0)]["high"] - means.loc[("t", "locks", 64.0)]["low"] > 0.1
    assert "-0.05 [-0.05, -0.05] (n=40)" in render_paired_gaps(eval_frame(rows))
