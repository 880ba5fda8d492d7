"""File-backed tasks (LongBench, InfiniteBench real text, MATH/AIME): truncation, subsets, schema errors."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from locks_toolkit.suites.catalog import iter_instances, score
from locks_toolkit.suites.jsonl import DataFileError
from locks_toolkit.suites.length_fit import approx_count_tokens
from locks_toolkit.suites.task_spec import load_task


def _write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in records) + "\n")


def _longbench_record(i: int, words: int = 3000) -> dict:
    context = f"HEADMARK{i} " + " ".join(f"filler{j}" for j in range(words)) + f" TAILMARK{i}"
    return {"input": f"Who is person {i}?", "context": context, "answers": [f"person {i}"], "length": words,
            "dataset": "hotpotqa", "language": "en", "all_classes": None, "_id": f"id{i}"}  # fmt: skip


def test_longbench_middle_truncates_the_context_to_fit(tmp_path):
    _write_jsonl(tmp_path / "longbench/hotpotqa.jsonl", [_longbench_record(i) for i in range(3)])
    spec = load_task("longbench_hotpotqa")
    instances = list(iter_instances(spec, 1024, None, approx_count_tokens, data_dir=tmp_path))
    assert [i.meta["record_id"] for i in instances] == ["id0", "id1", "id2"]
    for number, instance in enumerate(instances):
        assert instance.meta["truncated"]
        assert f"HEADMARK{number}" in instance.prompt and f"TAILMARK{number}" in instance.prompt
        assert "filler1500 " not in instance.prompt  # the middle went
        assert instance.prompt.endswith(f"Question: Who is person {number}?\nAnswer:")
        assert 1024 - spec.max_new_tokens - 5 <= approx_count_tokens(instance.prompt) <= 1024 - spec.max_new_tokens
        assert score(spec, f"Person {number}", instance.answers, instance.meta) == 1.0


def test_longbench_short_records_are_kept_whole_and_subsets_are_seeded(tmp_path):
    _write_jsonl(tmp_path / "longbench/hotpotqa.jsonl", [_longbench_record(i, words=50) for i in range(10)])
    spec = load_task("longbench_hotpotqa")

    def ids(seed: int) -> list[str]:
        return [
            i.meta["record_id"] for i in iter_instances(spec, 4096, 3, approx_count_tokens, seed, data_dir=tmp_path)
        ]

    assert ids(1) == ids(1) and len(ids(1)) == 3 and ids(1) != ids(2)
    whole = next(iter_instances(spec, 4096, None, approx_count_tokens, data_dir=tmp_path))
    assert not whole.meta["truncated"] and _longbench_record(0, words=50)["context"] in whole.prompt


def test_longbench_classification_passes_all_classes_through_meta(tmp_path):
    record = {"input": "What is a cat?", "context": "Q: What is a dog?\nType: Animal", "answers": ["Animal"],
              "all_classes": ["Animal", "Plant", "Location"], "_id": "t0"}  # fmt: skip
    _write_jsonl(tmp_path / "longbench/trec.jsonl", [record])
    spec = load_task("longbench_trec")
    instance = next(iter_instances(spec, 4096, None, approx_count_tokens, data_dir=tmp_path))
    # first line only: "Animal" -> 1; "Animal or Plant" on one line -> 1/2
    assert score(spec, "Animal\nPlant", instance.answers, instance.meta) == 1.0
    assert score(spec, "Animal or Plant", instance.answers, instance.meta) == 0.5


def test_a_missing_file_error_carries_the_schema(tmp_path):
    with pytest.raises(DataFileError, match=r"longbench/hotpotqa.jsonl not found.*\"answers\": \[str\]"):
        next(iter_instances(load_task("longbench_hotpotqa"), 4096, None, approx_count_tokens, data_dir=tmp_path))
    with pytest.raises(DataFileError, match=r"\"problem\": str"):
        next(iter_instances(load_task("math500"), 32768, None, approx_count_tokens, data_dir=tmp_path))
    with pytest.raises(DataFileError, match=r"\"options\": \[str\]"):
        next(iter_instances(load_task("longbook_qa_eng"), 32768, None, approx_count_tokens, data_dir=tmp_path))


def test_a_missing_field_names_the_record_and_the_schema(tmp_path):
    record = _longbench_record(0, words=10)
    del record["answers"]
    _write_jsonl(tmp_path / "longbench/hotpotqa.jsonl", [_longbench_record(1, words=10), record])
    with pytest.raises(DataFileError, match=r"record 1 has no field answers\. Expected .*\"context\": str"):
        list(iter_instances(load_task("longbench_hotpotqa"), 4096, None, approx_count_tokens, data_dir=tmp_path))


def test_infinitebench_choice_answers_become_letters(tmp_path):
    record = {"id": 0, "context": "A long book. " * 50, "input": "Who won?",
              "answer": ["the fox"], "options": ["the hare", "the fox", "the owl", "nobody"]}  # fmt: skip
    _write_jsonl(tmp_path / "infinitebench/longbook_choice_eng.jsonl", [record])
    spec = load_task("longbook_choice_eng")
    instance = next(iter_instances(spec, 32768, None, approx_count_tokens, data_dir=tmp_path))
    assert instance.answers == ("B", "the fox")
    assert "A. the hare\nB. the fox\nC. the owl\nD. nobody" in instance.prompt
    assert score(spec, "B", instance.answers) == 1.0 and score(spec, "C", instance.answers) == 0.0


def test_infinitebench_code_run_fills_the_function_call(tmp_path):
    record = {"id": 3, "context": "def func_1(x):\n    return x + 1\n", "input": "What is func_1(-4)?", "answer": -3}
    _write_jsonl(tmp_path / "infinitebench/code_run.jsonl", [record])
    spec = load_task("code_run")
    instance = next(iter_instances(spec, 32768, None, approx_count_tokens, data_dir=tmp_path))
    assert "called named func_1." in instance.prompt and "return value of func_1(-4)." in instance.prompt
    assert score(spec, "The value is -3", instance.answers) == 1.0


def test_math_problems_load_and_grade_by_boxed_equivalence(tmp_path):
    records = [{"problem": "What is $1/2 + 0$?", "answer": "\\frac{1}{2}", "unique_id": "a"},
               {"Problem": "Compute $2+2$.", "Answer": 4, "ID": "b"}]  # fmt: skip
    _write_jsonl(tmp_path / "math/aime24.jsonl", records)
    spec = load_task("aime24")
    instances = list(iter_instances(spec, 32768, None, approx_count_tokens, data_dir=tmp_path))
    assert [i.meta["record_id"] for i in instances] == ["a", "b"]
    assert instances[0].prompt.startswith("Question: What is $1/2 + 0$?\n") and "\\boxed{}" in instances[0].prompt
    assert score(spec, "so it is \\boxed{0.5}", instances[0].answers) == 1.0
    assert score(spec, "\\boxed{4}", instances[1].answers) == 1.0
    assert score(spec, "\\boxed{5}", instances[1].answers) == 0.0


def test_file_backed_prompts_carry_their_token_count_counted_once(tmp_path):
    _write_jsonl(tmp_path / "longbench/hotpotqa.jsonl", [_longbench_record(0), _longbench_record(1, words=40)])
    _write_jsonl(tmp_path / "infinitebench/longbook_qa_eng.jsonl",
                 [{"id": 5, "context": "A long book. " * 3000, "input": "Who won?", "answer": ["the fox"]}])  # fmt: skip
    _write_jsonl(tmp_path / "math/aime24.jsonl", [{"problem": "Compute $2+2$.", "answer": 4}])
    counted: Counter[str] = Counter()

    def count(text: str) -> int:
        counted[text] += 1
        return approx_count_tokens(text)

    for task, length in (("longbench_hotpotqa", 1024), ("longbook_qa_eng", 4096), ("aime24", 32768)):
        for instance in iter_instances(load_task(task), length, None, count, data_dir=tmp_path):
            assert instance.meta["prompt_tokens"] == approx_count_tokens(instance.prompt), task
            assert counted[instance.prompt] == 1, task  # the count of the fit, not a second pass
    assert max(counted.values()) == 1
