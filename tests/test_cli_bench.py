"""`locks bench decode` through typer's CliRunner: every command path, plus the end-of-run table."""

import json

import pytest
from typer.testing import CliRunner

from locks_toolkit.harness import runner as harness_runner
from locks_toolkit.harness.store import append_record, read_records
from locks_toolkit.locks_cli.main import app
from locks_toolkit.reports.decode_table import decode_table

cli = CliRunner()


def _invoke(*args):
    return cli.invoke(app, ["bench", "decode", *args])


def test_dry_run_lists_the_ladder(tmp_path):
    result = _invoke("--arms", "fa3,flashinfer", "--contexts", "16k,32k,128k", "--layers", "40",
                     "--out", str(tmp_path / "b.jsonl"), "--dry-run")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith("max_model_len 131344")
    assert [line.split()[1:3] for line in lines[1:]] == [
        ["fa3", "1q1s16k"], ["flashinfer", "1q1s16k"], ["fa3", "1q1s32k"], ["flashinfer", "1q1s32k"],
        ["fa3", "1q1s128k"], ["flashinfer", "1q1s128k"]]


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


def _fake_record(cell, status="ok", mean=8.0, reason=""):
    record = {"schema": "locks.bench.decode/1", "kind": "decode", "cell": cell, "status": status, "reason": reason}
    if status == "ok":
        record.update(tpot_ms={"mean": mean, "sd": mean * 0.02, "cv": 0.02, "p50": mean, "p99": mean * 1.1, "n": 192},
                      throughput_tok_s=1000 / mean, ttft_ms={"steady_mean": 1400.0, "steady_sd": 10.0},
                      bytes_per_step={"dense": 2.7e9, "locks": None}, floor_ms=0.64, build_ms=None,
                      guards={"clean_windows": 3, "windows": 3, "lockstep": "pass", "throttle": "pass",
                              "deployed": "not_applicable"})
    return record


def _fake_run(statuses):
    """A stand-in for run_plan that writes one record per cell through the real store."""

    def run_plan(plan, command=None, on_event=None):
        for i, arm in enumerate(plan.arms):
            cell = harness_runner.cell_identity(plan, arm, plan.contexts[0], 1, None, 40, True)
            record = _fake_record(cell, statuses[i], 8.0 + i, "" if statuses[i] == "ok" else "engine died")
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


def test_run_prints_the_markdown_table(fake_engine, tmp_path):
    fake_engine(["ok", "ok"])
    out = tmp_path / "b.jsonl"
    result = _invoke("--arms", "fa3,flashinfer", "--contexts", "32k", "--out", str(out))
    assert result.exit_code == 0, result.output
    table = [line for line in result.stdout.splitlines() if line.startswith("| glm")]
    assert len(table) == 2 and "| fa3 | ok | 8.00 ± 0.16 |" in table[0] and "| flashinfer |" in table[1]
    assert "median sd/mean" in result.stdout
    assert len(read_records(out)) == 2


def test_run_json_and_error_exit(fake_engine, tmp_path):
    fake_engine(["ok", "error"])
    result = _invoke("--arms", "fa3,flashinfer", "--contexts", "32k", "--out", str(tmp_path / "b.jsonl"), "--json")
    assert result.exit_code == 1
    records = json.loads(result.stdout)
    assert [r["status"] for r in records] == ["ok", "error"]
    assert "1 cell(s) failed" in result.stderr and "rerun the same command" in result.stderr


def test_decode_table_orders_cells_and_keeps_the_newest_record():
    base = {"model": "glm-4-9b-chat-1m", "num_layers": 40, "graph_mode": "full_decode_only", "batch_size": 1,
            "budget_tokens": None}
    fa3_128k = {**base, "arm": "fa3", "context_tokens": 131072}
    fi_16k = {**base, "arm": "flashinfer", "context_tokens": 16384}
    locks_16k = {**base, "arm": "locks", "context_tokens": 16384, "budget_tokens": 2048}
    records = [_fake_record(fa3_128k, "error", reason="boom"), _fake_record(fa3_128k, mean=10.5),
               _fake_record(locks_16k, "refused", reason="deployed path, window 0: 3 dense | fallback rows"),
               _fake_record(fi_16k, mean=7.2), {"schema": "locks.eval/1", "cell": {}}]
    lines = decode_table(records).splitlines()
    rows = [line for line in lines if line.startswith("| glm")]
    assert [row.split(" | ")[1:4] for row in rows] == [["16K", "1", "flashinfer"], ["16K", "1", "locks b=2048"],
                                                        ["128K", "1", "fa3"]]
    assert "refused: deployed path, window 0: 3 dense \\| fallback rows" in rows[1]
    assert "10.50 ± 0.21" in rows[2]  # the newer ok record replaced the error
    assert "| 1.00× |" in rows[0] and "| 1.00× |" in rows[2]
    fa3_16k = _fake_record({**base, "arm": "fa3", "context_tokens": 16384}, mean=9.0)
    sparse_16k = _fake_record(locks_16k, mean=6.0)
    rows = [line for line in decode_table(records + [fa3_16k, sparse_16k]).splitlines() if "| 16K |" in line]
    assert "| 0.80× |" in rows[0] and "| 1.20× |" in rows[2]  # vs flashinfer's 7.2 ms, the faster dense arm
    assert decode_table([]) == "_no decode records_\n"
