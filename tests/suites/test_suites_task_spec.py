"""Task YAML loading: every packaged task loads, specs are frozen, malformed entries name the fix."""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import pytest
from locks_toolkit.suites.task_spec import TaskSpecError, list_tasks, load_task, load_task_file

RULER_TASKS = {
    "niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
    "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2",
}  # fmt: skip


def test_packaged_suites_load_with_the_expected_tasks():
    assert set(list_tasks("ruler")) == RULER_TASKS
    assert {"passkey", "number_string", "kv_retrieval", "longbook_qa_eng"} <= set(list_tasks("infinitebench"))
    assert {"longbench_hotpotqa", "longbench_gov_report", "longbench_trec", "longbench_lcc"} <= set(
        list_tasks("longbench")
    )
    assert set(list_tasks("math")) == {"math500", "aime24", "aime25"}
    for name in list_tasks():
        spec = load_task(name)
        assert (spec.generator is None) != (spec.loader is None)
        assert spec.max_new_tokens < min(spec.lengths)


def test_ruler_task_facts_follow_the_benchmark():
    assert load_task("niah_multikey_1").args["num_keys"] == 4
    assert load_task("niah_multikey_3").args["key_type"] == "uuids"
    assert (load_task("vt").max_new_tokens, load_task("cwe").max_new_tokens, load_task("qa_1").max_new_tokens) == (
        30,
        120,
        32,
    )
    assert load_task("qa_2").scorer == "string_match_part" and load_task("niah_single_1").scorer == "string_match_all"
    assert load_task("qa_2").args["dataset"] == "hotpotqa"  # the YAML merge key kept the other fields of qa_1
    assert load_task("qa_2").template == load_task("qa_1").template


def test_specs_are_frozen():
    spec = load_task("niah_single_1")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.seed = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        spec.args["haystack"] = "essay"  # type: ignore[index]


def _write(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "custom.yaml"
    path.write_text(textwrap.dedent(body))
    return path


GOOD_TASK = """
suite: ruler
defaults: {lengths: [4096], template: "{context}", max_new_tokens: 8, scorer: string_match_all, version: 1}
tasks:
  mine:
"""


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("    generator: niah\n    loader: longbench_jsonl\n    data_file: x.jsonl\n", "exactly one"),
        ("    max_new_tokens: 1\n", "exactly one"),
        ("    generator: niah\n    scorer: bleu\n", "unknown scorer 'bleu'"),
        ("    generator: niah\n    lenghts: [1]\n", "unknown keys \\['lenghts'\\]"),
        ("    loader: longbench_jsonl\n", "needs `data_file:`"),
        ("    generator: niah\n    max_new_tokens: 4096\n", "leaves no room"),
        ("    generator: niah\n    lengths: []\n", "non-empty list"),
        ("    generator: niah\n    template: no fields\n", "str.format"),
    ],
)
def test_malformed_tasks_name_the_fix(tmp_path, entry, message):
    with pytest.raises(TaskSpecError, match=message) as error:
        load_task_file(_write(tmp_path, GOOD_TASK + entry))
    assert "custom.yaml" in str(error.value) and "'mine'" in str(error.value)


def test_a_well_formed_custom_file_loads(tmp_path):
    spec = load_task_file(_write(tmp_path, GOOD_TASK + "    generator: niah\n    args: {haystack: noise}\n"))["mine"]
    assert (spec.suite, spec.generator, spec.lengths, spec.args["haystack"]) == ("ruler", "niah", (4096,), "noise")


def test_missing_keys_and_unknown_names_are_reported(tmp_path):
    with pytest.raises(TaskSpecError, match="missing \\['version'\\]"):
        load_task_file(_write(tmp_path, GOOD_TASK.replace(", version: 1", "") + "    generator: niah\n"))
    with pytest.raises(TaskSpecError, match="unknown suite"):
        load_task_file(_write(tmp_path, GOOD_TASK.replace("suite: ruler", "suite: helm") + "    generator: niah\n"))
    with pytest.raises(TaskSpecError, match="unknown task 'niah_single_9'; known tasks: .*niah_single_1"):
        load_task("niah_single_9")
