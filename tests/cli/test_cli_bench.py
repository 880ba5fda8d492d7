"""`locks bench decode` through typer's CliRunner: every command path, plus the end-of-run summary
(the decode sections of `locks report` for the cells of the run)."""

import json
import sys

import pytest
from locks_toolkit.harness import runner as harness_runner
from locks_toolkit.harness.store import append_record, read_records
from locks_toolkit.locks_cli.main import app
from locks_toolkit.reports.render import render_decode_run
from typer.testing import CliRunner

cli = CliRunner()


def _invoke(*args):
    return cli.invoke(app, ["bench", "decode", *args])


def test_dry_run_lists_the_ladder(tmp_path):
    result = _invoke("--arms", "fa3,flashinfer", "--contexts", "16k,32k,128k", "--layers", "40",
                     "--out", str(tmp_path / "b.jsonl"), "--dry-run")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == f"output {tmp_path / 'b.jsonl'}"
    assert [line.split()[1:3] for line in lines[1:]] == [
        ["fa3", "1q1s16k"], ["flashinfer", "1q1s16k"], ["fa3", "1q1s32k"], ["flashinfer", "1q1s32k"],
        ["fa3", "1q1s128k"], ["flashinfer", "1q1s128k"]]
    # each rung's engine is sized for its own rung (16K + 258 decode tokens, rounded up to a page)
    assert [line.split()[4] for line in lines[1::2]] == ["max_model_len=16656", "max_model_len=33040",
                                                        "max_model_len=131344"]
    assert all(line.endswith("(full protocol)") for line in lines[1:])


def test_dry_run_names_the_single_prefill_rungs(tmp_path):
    result = _invoke("--arms", "fa3", "--contexts", "128k,256k", "--out", str(tmp_path / "b.jsonl"), "--dry-run")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()[1:]
    assert lines[0].endswith("(full protocol)") and lines[1].endswith("(1 prefill)")
    # at 256K the ramp (256) and the timed windows (2 + 3 x 64) ride on the same requests: 256 + 194 + 2
    assert "max_model_len=262608" in lines[1]


def test_dry_run_json_marks_stored_cells(tmp_path):
    out = tmp_path / "b.jsonl"
    args = ["--arms", "locks,fa3", "--contexts", "16k", "--budget", "1024,2048", "--out", str(out), "--dry-run", "--json"]
    first = json.loads(_invoke(*args).stdout)
    assert [(c["arm"], c["budget_tokens"]) for c in first["cells"]] == [("locks", 1024), ("locks", 2048), ("fa3", None)]
    assert not any(c["stored"] for c in first["cells"])
    cell = {k: v for k, v in first["cells"][1].items() if k != "stored"}
    append_record(out, {"schema": "locks.bench.decode/1", "cell": cell, "status": "ok"})
    second = json.loads(_invoke(*args).stdout)
    assert [c["stored"] for c in second["cells"]] == [False, True, False]


@pytest.mark.parametrize("args,message", [
    (["--budget", "2001", "--arms", "locks"], "not a multiple of the page size 16"),
    (["--arms", "fa3,sdpa"], "arm 'sdpa' unknown"),
    (["--contexts", "300k", "--max-model-len", "256k"], "exceeds max_model_len 262144"),
    (["--graph-mode", "nope"], "graph mode 'nope' unknown"),
    (["/no/such/plan.yaml"], "plan file /no/such/plan.yaml not found"),
])
def test_config_errors_are_one_line_with_a_hint(args, message):
    result = _invoke(*args, "--dry-run")
    assert result.exit_code == 2
    assert message in result.stderr.replace("\n", " ")
    assert "hint:" in result.stderr and "Traceback" not in result.output


def test_model_dir_without_config_json(tmp_path):
    result = _invoke("--model", str(tmp_path), "--dry-run")
    assert result.exit_code == 2 and "has no config.json" in result.stderr.replace("\n", " ")


def test_no_gpu_for_a_cuda_arm(monkeypatch, tmp_path):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = _invoke("--arms", "fa3", "--contexts", "16k", "--out", str(tmp_path / "b.jsonl"))
    assert result.exit_code == 2
    assert "need a CUDA GPU" in result.stderr and "--arms cpu" in result.stderr
    assert not (tmp_path / "b.jsonl").exists()


def test_vllm_missing(monkeypatch, tmp_path):
    real = harness_runner.importlib.util.find_spec
    monkeypatch.setattr(harness_runner.importlib.util, "find_spec", lambda name: None if name == "vllm" else real(name))
    result = _invoke("--arms", "cpu", "--model", "tiny-llama", "--contexts", "256", "--out", str(tmp_path / "b.jsonl"))
    assert result.exit_code == 2
    assert "vLLM is not installed" in result.stderr and "hint:" in result.stderr


def test_missing_peer_plugin(monkeypatch, tmp_path):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    from dataclasses import replace

    from locks_toolkit.harness.arms import ARMS

    monkeypatch.setitem(ARMS, "locks-kv", replace(ARMS["locks-kv"], plugin_distribution="locks-kv-not-installed-here"))
    result = _invoke("--arms", "locks-kv", "--contexts", "16k", "--out", str(tmp_path / "b.jsonl"))
    assert result.exit_code == 2
    assert "needs the locks-kv-not-installed-here plugin" in result.stderr.replace("\n", " ")


WEIGHT_BYTES, KV_BYTES, BANDWIDTH = 1.6e10, 2.7e9, 4.0e12  # step floor (1.6e10 + 2.7e9) / 4e12 s = 4.675 ms


def _fake_record(cell, status="ok", mean=8.0, reason=""):
    """A decode record in the shape the harness writes now (weights in the step floor, build_method, raw windows)."""
    record = {"schema": "locks.bench.decode/2", "kind": "decode", "cell": cell, "status": status, "reason": reason,
              "sparse": cell.get("budget_tokens") is not None}
    window = {"step_ms": [mean] * 4, "lockstep_ok": True, "clean": True, "discard_reason": None,
              "throttle": {"available": True, "ok": True, "reasons_seen": [], "sm_clock_min_mhz": 1980,
                           "sm_clock_max_mhz": 1980}}
    if status == "ok":
        record.update(tpot_ms={"mean": mean, "sd": mean * 0.02, "cv": 0.02, "p50": mean, "p99": mean * 1.1, "n": 192},
                      throughput_tok_s=1000 / mean, ttft_ms={"steady_mean": 1400.0, "steady_sd": 10.0},
                      bytes_per_step={"dense": KV_BYTES, "locks": None, "weights": WEIGHT_BYTES,
                                      "bandwidth_bytes_per_s": BANDWIDTH},
                      floor_ms=KV_BYTES / BANDWIDTH * 1e3, step_floor_ms=(WEIGHT_BYTES + KV_BYTES) / BANDWIDTH * 1e3,
                      build_ms=None, build_method="dense arm: no summaries to build", step_floor_basis="recorded",
                      windows=[window] * 3,
                      guards={"clean_windows": 3, "windows": 3, "lockstep": "pass", "throttle": "pass",
                              "deployed": "not_applicable"})
    return record


def _fake_run(statuses):
    """A stand-in for run_plan that writes one record per cell through the real store."""

    def run_plan(plan, command=None, on_event=None):
        for i, arm in enumerate(plan.arms):
            cell = harness_runner.cell_identity(plan, arm, plan.contexts[0], 1, None, 40, True)
            reason = "" if statuses[i] == "ok" else f"{arm} engine died: {statuses[i]}"
            record = _fake_record(cell, statuses[i], 8.0 + i, reason)
            append_record(plan.output, record)
            on_event("job", {"arm": arm, "context": plan.contexts[0], "budget": None, "batches": [1]})
            on_event("record", record)

    return run_plan


@pytest.fixture
def fake_engine(monkeypatch):
    monkeypatch.setattr(harness_runner, "preflight", lambda plan: None)

    def install(statuses):
        monkeypatch.setattr(harness_runner, "run_plan", _fake_run(statuses))

    return install


def _rows(text: str, first_column: str) -> list[list[str]]:
    """The cells of every markdown table row whose first column is `first_column`."""
    return [[c.strip() for c in line.strip("|").split(" | ")] for line in text.splitlines()
            if line.startswith(f"| {first_column} |")]


def _section(text: str, title: str) -> str:
    """The body of the `## title` section (up to the next `## `)."""
    assert f"\n## {title}\n" in text, f"the closing summary has no section {title!r}"
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


LADDER, NOISE, GRID = ("Decode-efficiency ladder (batch 1)", "Decode noise (TPOT sd/mean per arm)",
                       "Batched grid (speedup vs the faster dense arm)")


def _notes(text: str) -> str:
    return _section(text, "Notes")


def test_run_prints_the_report_ladder_and_the_noise_table(fake_engine, tmp_path):
    fake_engine(["ok", "ok"])
    out = tmp_path / "b.jsonl"
    result = _invoke("--arms", "fa3,flashinfer", "--contexts", "32k", "--out", str(out))
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert str(out) in text.splitlines()[0]  # the title names the result file
    assert "| Context | Arm | TPOT ms (mean ± sd) |" in text and "Build ms (Δ TTFT vs dense)" in text
    ladder = _rows(_section(text, LADDER), "32k")
    assert [row[1] for row in ladder] == ["fa3", "flashinfer"]
    assert ladder[0][2:5] == ["8.00 ± 0.16", "192", "1.00×"] and ladder[1][2:5] == ["9.00 ± 0.18", "192", "0.89×"]
    assert ladder[0][9] == "58%" and ladder[1][9] == "52%"  # Floor: 4.675 ms of weights + KV over the TPOT
    noise = {row[0]: row[1:] for arm in ("fa3", "flashinfer") for row in _rows(_section(text, NOISE), arm)}
    assert noise == {"fa3": ["1", "2.0%", "2.0%", "32k bs1"], "flashinfer": ["1", "2.0%", "2.0%", "32k bs1"]}
    assert len(read_records(out)) == 2


def test_run_shows_failed_cells_with_their_reasons_and_exits_1(fake_engine, tmp_path):
    fake_engine(["ok", "error", "refused"])
    result = _invoke("--arms", "fa3,flashinfer,cpu", "--contexts", "32k", "--out", str(tmp_path / "b.jsonl"))
    assert result.exit_code == 1
    ladder = {row[1]: row for row in _rows(_section(result.stdout, LADDER), "32k")}
    assert set(ladder) == {"fa3", "flashinfer", "cpu"}
    assert ladder["flashinfer"][2].startswith("error[^") and ladder["cpu"][2].startswith("refused[^")
    notes = _notes(result.stdout)
    for arm, status in (("flashinfer", "error"), ("cpu", "refused")):
        marker = ladder[arm][2][len(status):]
        assert f"{marker}: decode " in notes and f"{arm} engine died: {status}" in notes
    assert "1 cell(s) failed" in result.stderr and "rerun the same command" in result.stderr


def test_run_json_and_error_exit(fake_engine, tmp_path):
    fake_engine(["ok", "error"])
    result = _invoke("--arms", "fa3,flashinfer", "--contexts", "32k", "--out", str(tmp_path / "b.jsonl"), "--json")
    assert result.exit_code == 1
    records = json.loads(result.stdout)
    assert [r["status"] for r in records] == ["ok", "error"]
    assert "1 cell(s) failed" in result.stderr and "rerun the same command" in result.stderr


def test_closing_summary_orders_cells_keeps_the_newest_record_and_footnotes_every_failure():
    base = {"model": "glm-4-9b-chat-1m", "num_layers": 40, "graph_mode": "full_decode_only", "batch_size": 1,
            "budget_tokens": None}
    fa3_128k = {**base, "arm": "fa3", "context_tokens": 131072}
    fi_16k = {**base, "arm": "flashinfer", "context_tokens": 16384}
    locks_16k = {**base, "arm": "locks", "context_tokens": 16384, "budget_tokens": 2048}
    fa3_128k_bs8 = {**fa3_128k, "batch_size": 8}
    refusal = "deployed path, window 0: 3 dense | fallback rows"
    records = [_fake_record(fa3_128k, "error", reason="boom"), _fake_record(fa3_128k, mean=10.5),
               _fake_record(locks_16k, "refused", reason=refusal), _fake_record(fi_16k, mean=7.2),
               _fake_record(fa3_128k_bs8, "oom", reason="CUDA out of memory at batch 8"),
               {"schema": "locks.eval/1", "cell": {}}]
    text = render_decode_run(records)
    rows = _rows(_section(text, LADDER), "16k") + _rows(_section(text, LADDER), "128k")
    assert [row[:2] for row in rows] == [["16k", "flashinfer"], ["16k", "locks b=2048"], ["128k", "fa3"]]
    assert rows[1][2].startswith("refused[^") and rows[2][2] == "10.50 ± 0.21"  # the newer ok record replaced the error
    assert rows[0][4] == "1.00×" and rows[2][4] == "1.00×"
    assert rows[2][-1].startswith("rerun (3/3)[^")
    notes = _notes(text)
    assert refusal in notes and "CUDA out of memory at batch 8" in notes  # the batched OOM is not dropped
    assert "boom" not in notes and "1 older record(s) of this cell superseded" in notes
    assert _rows(_section(text, GRID), "128k")[0][2].startswith("—[^")  # the bs8 column: fa3's OOM
    assert [row[0] for row in _rows(_section(text, NOISE), "fa3") + _rows(_section(text, NOISE), "flashinfer")] == [
        "fa3", "flashinfer"]
    fa3_16k = _fake_record({**base, "arm": "fa3", "context_tokens": 16384}, mean=9.0)
    sparse_16k = _fake_record(locks_16k, mean=6.0)
    rows = _rows(_section(render_decode_run(records + [fa3_16k, sparse_16k]), LADDER), "16k")
    assert [row[1] for row in rows] == ["fa3", "flashinfer", "locks b=2048"]
    assert rows[0][4] == "0.80×" and rows[2][4] == "1.20×"  # vs flashinfer's 7.2 ms, the faster dense arm
    assert render_decode_run([]) == render_decode_run(records[-1:]) == "_no decode records_\n"


@pytest.mark.parametrize("args, hint", [
    (["trace", "--arm", "fa3", "--context", "1k"], "trace --arm cpu"),
    (["tp-check", "--arms", "fa3,locks"], "--arms cpu,locks-cpu"),
])
def test_gpu_only_commands_refuse_without_a_gpu_before_any_engine(monkeypatch, args, hint):
    import torch
    from locks_toolkit.harness.lab import step_trace, tp_check

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for module, name in ((step_trace, "trace_arm"), (tp_check, "main")):
        monkeypatch.setattr(module, name, lambda *a, **k: pytest.fail("an engine path was entered"))
    result = CliRunner().invoke(app, ["bench", *args])
    text = " ".join(result.stderr.split())
    assert result.exit_code == 2 and "need a CUDA GPU and none is visible" in text and hint in text


def test_a_store_that_cannot_be_written_is_refused_before_any_engine(tmp_path):
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    result = _invoke("--arms", "cpu", "--contexts", "128", "--out", str(blocker / "b.jsonl"))
    assert result.exit_code == 2 and "Traceback" not in result.output
    said = " ".join(result.stderr.split())
    assert f"cannot write the store {blocker / 'b.jsonl'}: {blocker} is a file, not a folder" in said
    assert "pass --out a path in a folder you can write" in said
    result = _invoke("--arms", "cpu", "--contexts", "128", "--out", "/sys/locks-no-such/b.jsonl")  # a read-only file system
    assert result.exit_code == 2 and "cannot write the store /sys/locks-no-such/b.jsonl" in " ".join(result.stderr.split())


def test_a_disk_that_fills_mid_run_keeps_finished_cells_and_says_how_to_resume(monkeypatch, tmp_path):
    """The second record's append fails with ENOSPC: one error naming the cause and the way out, the first
    record intact, nothing half-written (the store reads back whole)."""
    import errno

    from locks_toolkit.harness import store as harness_store

    real_append, calls = harness_store.append_record, []

    def filling_append(path, record):
        calls.append(record)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real_append(path, record)

    monkeypatch.setattr(harness_runner, "preflight", lambda plan: None)
    monkeypatch.setattr(sys.modules[__name__], "append_record", filling_append)
    monkeypatch.setattr(harness_runner, "run_plan", _fake_run(["ok", "ok"]))
    store = tmp_path / "b.jsonl"
    result = _invoke("--arms", "fa3,flashinfer", "--contexts", "16k", "--out", str(store))
    assert result.exit_code == 2 and "Traceback" not in result.output
    said = " ".join(result.stderr.split())
    assert "writing the run's files failed: No space left on device" in said and "1 cell(s) of this run are stored" in said
    assert "then rerun the same command: finished cells are kept" in said
    assert [r["cell"]["arm"] for r in read_records(store)] == ["fa3"]
