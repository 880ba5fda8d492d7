"""The eval runner and `locks eval run` without a model: a fake engine answers from the instance."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from locks_toolkit.harness.store import read_records
from locks_toolkit.kernels.config import PAGE_SIZE
from locks_toolkit.locks_cli.main import app
from locks_toolkit.suites import eval_runner
from locks_toolkit.suites.arms import ArmError, parse_arm, parse_arms
from locks_toolkit.suites.engine_hf import Generation
from locks_toolkit.suites.eval_runner import EvalConfig, EvalConfigError, config_from_mapping, run_eval, summary_table
from locks_toolkit.suites.length_fit import approx_count_tokens
from typer.testing import CliRunner


class FakeEngine:
    """Answers correctly when budget is None or >= `solves_from`, else says something wrong."""

    name = "fake"
    model_name = "fake"
    source = "fake model"

    def __init__(self, solves_from: int = 128) -> None:
        self.solves_from = solves_from
        self.calls: list[tuple[str, str, int | None]] = []

    def count_tokens(self, text: str) -> int:
        return approx_count_tokens(text)

    def run(self, instances, requests, stop):
        for instance in instances:
            for request in requests[instance.instance_id]:
                self.calls.append((instance.instance_id, request.arm.label, request.budget_tokens))
                good = request.budget_tokens is None or request.budget_tokens >= self.solves_from
                text = " ".join(instance.answers) if good else "no idea"
                yield instance, request, Generation([1, 2], text, "newline", 0.0), 0.0


def _config(out: Path, **over) -> EvalConfig:
    raw = {"suite": "ruler", "tasks": "niah_single_1", "lengths": "1k", "samples": 2, "budgets": "64,128",
           "arms": "fullkv,oracle,locks:r8i4", "model": "fake", "out": str(out), "max_new_tokens": 8, **over}  # fmt: skip
    return config_from_mapping(raw)


def test_records_scores_and_resume(tmp_path):
    out = tmp_path / "eval.jsonl"
    config = _config(out)
    engine = FakeEngine(solves_from=128)
    progress = run_eval(config, engine, command="locks eval run ...")
    records = read_records(out)
    assert progress.done == len(records) == 2 * (1 + 2 * 2)  # instances x (fullkv + 2 sparse arms x 2 budgets)
    for record in records:
        cell = record["cell"]
        assert record["schema"] == "locks.eval/1" and record["status"] == "ok"
        assert set(cell) == {"suite", "task", "arm", "format", "budget_tokens", "context_tokens", "record_id", "model"}
        assert record["score"] == (0.0 if cell["budget_tokens"] == 64 else 1.0)
        assert record["fullkv_correct"] is True
        assert record["provenance"]["git_commit"] is not None or record["provenance"]["git_commit"] is None
        assert record["max_new_tokens"] == 8
    assert {r["cell"]["format"] for r in records if r["cell"]["arm"] == "locks"} == {"r8i4"}
    assert all(r["cell"]["budget_tokens"] is None for r in records if r["cell"]["arm"] == "fullkv")

    # Drop the last two records (as after a crash): resume runs exactly those cells again.
    lines = out.read_text().splitlines()
    out.write_text("\n".join(lines[:-2]) + "\n")
    missing = {(r["cell"]["record_id"], r["cell"]["arm"], r["cell"]["budget_tokens"]) for r in map(json.loads, lines[-2:])}
    again = FakeEngine()
    progress = run_eval(config, again, command="x")
    assert {(i, label.split(":")[0], b) for i, label, b in again.calls} == missing
    assert progress.skipped == len(records) - 2
    assert len(read_records(out)) == len(records)
    assert run_eval(config, FakeEngine(), command="x").done == 0


class WordyEngine(FakeEngine):
    """Counts three tokens per word, so cwe's fixed text (a solved example of ~190 words) outgrows 1K."""

    def count_tokens(self, text: str) -> int:
        return 3 * approx_count_tokens(text)


def test_a_task_that_does_not_fit_a_length_stops_the_run_unless_skip_unfit(tmp_path):
    from locks_toolkit.suites.length_fit import LengthError

    out = tmp_path / "eval.jsonl"
    config = _config(out, tasks="niah_single_1,cwe", lengths="1k,16k", samples=1, arms="fullkv", budgets="")
    with pytest.raises(LengthError, match=r"cwe: length 1024 .*--skip-unfit"):
        run_eval(config, WordyEngine(), command="x")
    assert not out.exists()  # nothing ran
    engine = WordyEngine()
    run_eval(_config(out, tasks="niah_single_1,cwe", lengths="1k,16k", samples=1, arms="fullkv", budgets="",
                     skip_unfit=True), engine, command="x")  # fmt: skip
    ran = {(r["cell"]["task"], r["cell"]["context_tokens"]) for r in read_records(out)}
    assert ran == {("niah_single_1", 1024), ("niah_single_1", 16384), ("cwe", 16384)}


def test_fullkv_correct_false_when_fullkv_fails(tmp_path):
    out = tmp_path / "eval.jsonl"
    run_eval(_config(out, budgets="64", arms="fullkv,quest"), FakeEngine(solves_from=10**9), command="x")
    records = read_records(out)
    fullkv = [r for r in records if r["cell"]["arm"] == "fullkv"]
    assert all(r["score"] == 1.0 for r in fullkv)  # budget None solves in the fake
    assert all(r["fullkv_correct"] is True for r in records)
    out2 = tmp_path / "no_fullkv.jsonl"
    run_eval(_config(out2, budgets="64", arms="quest"), FakeEngine(), command="x")
    assert all(r["fullkv_correct"] is None for r in read_records(out2))


def test_summary_table_means(tmp_path):
    out = tmp_path / "eval.jsonl"
    config = _config(out)
    run_eval(config, FakeEngine(solves_from=128), command="x")
    table = summary_table(read_records(out), config)
    # the dense arm's mean repeats on every budget row as the reference column
    assert "| niah_single_1 | 1024 | 64 | 1.00 (n=2) | 0.00 (n=2) | 0.00 (n=2) |" in table
    assert "| niah_single_1 | 1024 | 128 | 1.00 (n=2) | 1.00 (n=2) | 1.00 (n=2) |" in table
    assert "dense" not in table
    assert table.splitlines()[0] == "| task | context | budget | fullkv | oracle | locks:r8i4 |"


@pytest.mark.parametrize(
    "over, fragment",
    [
        ({"budgets": "64,100"}, "not a multiple of the page size"),
        ({"tasks": "niah_single_1,nope"}, "unknown ruler task"),
        ({"lengths": "4q"}, "not a token count"),
        ({"samples": 0}, "samples must be >= 1"),
    ],
)
def test_config_errors(tmp_path, over, fragment):
    with pytest.raises(EvalConfigError, match=fragment):
        _config(tmp_path / "x.jsonl", **over)


def test_parse_arms():
    assert parse_arm("locks").fmt.name == "r8i4"
    assert parse_arm("locks:r4fp").label == "locks:r4fp"
    assert parse_arm("fullkv").sparse is False
    assert parse_arm("shared_basis_global").fmt.name == "r8fp"
    assert [a.label for a in parse_arms(["quest", "quest", "oracle"])] == ["quest", "oracle"]
    for bad in ("bogus", "quest:r8i4", "locks:r99i4", "fullkv:r8i4"):
        with pytest.raises(ArmError):
            parse_arm(bad)


def test_parse_lengths():
    assert eval_runner.parse_lengths("4k, 8192") == (4096, 8192)
    assert PAGE_SIZE == 16


runner = CliRunner()


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--arms", "fullkv,bogus"], "unknown arm 'bogus'"),
        (["--tasks", "niah_single_9"], "unknown ruler task"),
        (["--budgets", "64,100"], "not a multiple of the page size"),
    ],
)
def test_cli_argument_errors(tmp_path, args, fragment):
    base = ["eval", "run", "--suite", "ruler", "--tasks", "niah_single_1", "--lengths", "4k", "--budgets", "64",
            "--out", str(tmp_path / "o.jsonl")]  # fmt: skip
    result = runner.invoke(app, base + args)
    assert result.exit_code == 2, result.output
    assert fragment in " ".join(result.output.split())


def test_cli_missing_data_file(tmp_path):
    result = runner.invoke(app, ["eval", "run", "--suite", "longbench", "--tasks", "longbench_hotpotqa", "--lengths", "4k",
                                 "--arms", "fullkv", "--data-dir", str(tmp_path), "--out", str(tmp_path / "o.jsonl")])  # fmt: skip
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "error:" in text and "hint:" in text and "Expected" in text


def test_cli_missing_model_package(tmp_path, monkeypatch):
    from locks_toolkit.suites import model_source
    from locks_toolkit.suites.models import ModelMissingError

    def missing(source, dtype=None):
        raise ModelMissingError("the model needs the Python package 'gguf', which is not installed")

    monkeypatch.setattr(model_source, "load_transformers", missing)
    result = runner.invoke(app, ["eval", "run", "--suite", "ruler", "--tasks", "niah_single_1", "--lengths", "4k",
                                 "--arms", "fullkv", "--out", str(tmp_path / "o.jsonl")])  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "gguf" in result.output and "hint:" in result.output


def test_cli_vllm_without_vllm_is_one_clear_error_naming_the_install(tmp_path, monkeypatch):
    from locks_toolkit.suites import engine_vllm

    real_import = engine_vllm.importlib.import_module

    def no_vllm(name, *args, **kwargs):
        if name == "vllm":
            raise ImportError("No module named 'vllm'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(engine_vllm.importlib, "import_module", no_vllm)
    result = runner.invoke(app, ["eval", "run", "--suite", "ruler", "--tasks", "niah_single_1", "--lengths", "4k",
                                 "--arms", "locks", "--budgets", "64", "--engine", "vllm", "--model", "tiny-llama",
                                 "--out", str(tmp_path / "o.jsonl")])  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "vLLM is not installed" in " ".join(result.output.split()) and "locks-toolkit[gpu]" in result.output
    assert not (tmp_path / "o.jsonl").exists()


def test_yaml_run_file_with_cli_override(tmp_path):
    run_file = tmp_path / "run.yaml"
    run_file.write_text(
        "suite: ruler\ntasks: [niah_single_1, niah_single_2]\nlengths: [4k, 8192]\nsamples: 3\n"
        "budgets: [64, 128]\narms: [fullkv, locks:r8fp]\nmodel: gemma3-270m\nout: runs/x.jsonl\n"
    )
    config = eval_runner.load_config_file(run_file, {"samples": 1, "tasks": None})
    assert config.tasks == ("niah_single_1", "niah_single_2") and config.lengths == (4096, 8192)
    assert config.samples == 1 and [a.label for a in config.arms] == ["fullkv", "locks:r8fp"]
    run_file.write_text("suite: ruler\ntasks: [niah_single_1]\nbudgets: 64\nbogus: 1\n")
    with pytest.raises(EvalConfigError, match="unknown keys"):
        eval_runner.load_config_file(run_file)


def test_planning_in_worker_processes_gives_the_serial_plan():
    from locks_toolkit.suites.eval_runner import plan_instances

    config = _config(Path("unused.jsonl"), tasks="niah_single_1,vt,cwe", lengths="1k,2k", samples=3, skip_unfit=True)
    count = WordyEngine().count_tokens

    def flat(groups):
        return [(spec.name, length, [(i.instance_id, i.prompt, tuple(i.answers)) for i in instances])
                for spec, length, instances in groups]  # fmt: skip

    serial = flat(plan_instances(config, count, workers=1))
    assert flat(plan_instances(config, count, workers=2)) == serial
    planned = {(name, length) for name, length, _ in serial}
    assert ("cwe", 1024) not in planned and {("niah_single_1", 1024), ("cwe", 2048)} <= planned
    assert all(len(instances) == 3 for _, _, instances in serial)


class BatchingEngine(FakeEngine):
    """Records what each run call was handed."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[tuple[list[str], dict[str, int]]] = []

    def run(self, instances, requests, stops):
        self.batches.append(([i.instance_id for i in instances], {k: s.max_new_tokens for k, s in stops.items()}))
        yield from super().run(instances, requests, stops)


def test_the_engine_gets_the_whole_run_at_once_in_rounds_each_instance_with_its_tasks_stop_rule(tmp_path):
    out = tmp_path / "eval.jsonl"
    config = _config(out, tasks="niah_single_1,fwe,vt", lengths="1k,2k", samples=3, round_size=2, max_new_tokens=None)
    engine = BatchingEngine()
    run_eval(config, engine, command="x")
    assert len(engine.batches) == 1  # one call: every task and length side by side
    ids, stops = engine.batches[0]
    # round 0 (each pair's instances 0 and 1) at 1k then 2k, then round 1 (instance 2)
    order = [(i.split("/")[1], i.split("/")[0], i.split("/")[-1]) for i in ids]
    expect = [(f"L{n}", task, str(k)) for n in (1024, 2048) for task in ("niah_single_1", "fwe", "vt") for k in (0, 1)]
    expect += [(f"L{n}", task, "2") for n in (1024, 2048) for task in ("niah_single_1", "fwe", "vt")]
    assert order == expect
    limits = {i.split("/")[0]: stops[i] for i in ids}
    assert len(set(limits.values())) > 1  # the tasks' own output limits, per instance
    records = read_records(out)
    assert {(r["cell"]["task"], r["max_new_tokens"]) for r in records} == set(limits.items())


def test_a_resumed_run_rounds_by_each_instances_own_index(tmp_path):
    """Pairs cut at different counts even out: the next round is the same instance indices in every pair."""
    out = tmp_path / "eval.jsonl"
    run_eval(_config(out, tasks="niah_single_1,fwe", samples=1, arms="fullkv"), FakeEngine(), command="x")
    run_eval(_config(out, tasks="niah_single_1", samples=2, arms="fullkv"), FakeEngine(), command="x")
    engine = BatchingEngine()
    run_eval(_config(out, tasks="niah_single_1,fwe", samples=4, round_size=2, arms="fullkv"), engine, command="x")
    ids = [i.split("/")[0] + "/" + i.split("/")[-1] for i in engine.batches[0][0]]
    assert ids == ["fwe/1", "niah_single_1/2", "niah_single_1/3", "fwe/2", "fwe/3"]
