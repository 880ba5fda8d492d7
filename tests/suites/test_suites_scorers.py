"""Scorers against hand-computed cases (each expected value is worked out in the comment beside it)."""

from __future__ import annotations

import dataclasses

import pytest
from locks_toolkit.suites import scorers
from locks_toolkit.suites.catalog import score
from locks_toolkit.suites.math_answers import boxed_equiv_score, last_boxed
from locks_toolkit.suites.task_spec import load_task

NO_META: dict = {}


def test_string_match_all_gives_partial_credit_case_insensitively():
    # 2 of the 3 references occur (one in another case) -> 2/3
    got = scorers.string_match_all("The values are 1234567 and ABC-def.", ["1234567", "abc-DEF", "7654321"], NO_META)
    assert got == pytest.approx(2 / 3)


def test_string_match_part_is_all_or_nothing():
    assert scorers.string_match_part("It is Paris, France.", ["London", "paris"], NO_META) == 1.0
    assert scorers.string_match_part("It is Lyon.", ["London", "Paris"], NO_META) == 0.0


def test_qa_f1_normalizes_and_takes_the_best_reference():
    # "The cat sat on the mat." -> [cat, sat, on, mat]; "a cat on a mat" -> [cat, on, mat]
    # common 3: precision 3/4, recall 1 -> F1 = 2 * 0.75 / 1.75 = 6/7
    assert scorers.qa_f1("The cat sat on the mat.", ["a cat on a mat"], NO_META) == pytest.approx(6 / 7)
    # a second reference that matches exactly wins
    assert scorers.qa_f1("The cat sat on the mat.", ["dog", "cat sat on mat"], NO_META) == pytest.approx(1.0)
    assert scorers.qa_f1("nothing shared", ["cat"], NO_META) == 0.0


def test_qa_f1_chars_counts_characters():
    # prediction chars 北京市 (punctuation dropped), reference 北京: common 2, P 2/3, R 1 -> F1 = 0.8
    assert scorers.qa_f1_chars("北京市。", ["北京"], NO_META) == pytest.approx(0.8)


def test_rouge_l_of_a_known_pair():
    # LCS("a b c d", "a c e") = "a c": precision 2/4, recall 2/3 -> F = 2PR/(P+R) = 4/7
    assert scorers.rouge_l("a b c d", ["a c e"], NO_META) == pytest.approx(4 / 7, abs=1e-6)
    assert scorers.rouge_lsum("a b c d", ["a c e"], NO_META) == pytest.approx(4 / 7, abs=1e-6)
    assert scorers.rouge_l("", ["a c e"], NO_META) == 0.0


def test_classification_drops_class_names_inside_the_true_one():
    meta = {"all_classes": ["animal", "plant", "animal species"]}
    # "animal" is found but is part of the true class "animal species": only the true class counts -> 1
    assert scorers.classification("animal species", ["animal species"], meta) == 1.0
    # two classes named, the true one among them -> 1/2
    assert scorers.classification("animal or plant", ["animal"], meta) == 0.5
    assert scorers.classification("plant", ["animal"], meta) == 0.0
    with pytest.raises(KeyError, match="all_classes"):
        scorers.classification("animal", ["animal"], NO_META)


def test_retrieval_and_count_score_the_share_of_right_numbers():
    # numbers 12 and 3, one of them right -> 1/2
    assert scorers.retrieval("Paragraph 12, or maybe paragraph 3", ["Paragraph 12"], NO_META) == 0.5
    assert scorers.count("7 paragraphs, maybe 8", ["7"], NO_META) == 0.5
    assert scorers.count("no idea", ["7"], NO_META) == 0.0


def test_code_sim_scores_the_first_code_line():
    # "x = foo(1)" vs "x = foo(2)": 20 characters, indel distance 2 -> ratio 1 - 2/20 = 0.9
    assert scorers.code_sim("```python\nx = foo(1)\n```", ["x = foo(2)"], NO_META) == pytest.approx(0.9)
    assert scorers.code_sim("# a comment\nreturn a", ["return a"], NO_META) == 1.0


def test_infinitebench_matchers():
    assert scorers.first_int_match("The pass key is 01234.", ["01234"], NO_META) == 1.0
    assert scorers.first_int_match("The pass key is 1234, not 01234", ["01234"], NO_META) == 0.0
    assert scorers.word_match('The value is "ab-12".', ["ab-12"], NO_META) == 1.0
    assert scorers.last_int("so the result is 42.", ["42"], NO_META) == 1.0
    assert scorers.last_int("42 is not the end", ["42"], NO_META) == 0.0
    assert scorers.first_number("The largest is 3.5, then 2", ["3.5"], NO_META) == 1.0
    assert scorers.name_match("It is probably Alice.", ["ALICE"], NO_META) == 1.0
    assert scorers.choice_letter("B", ["B", "option text"], NO_META) == 1.0
    assert scorers.choice_letter("I think the answer is: C", ["C", "x"], NO_META) == 1.0
    assert scorers.choice_letter("I think the answer is: D", ["C", "x"], NO_META) == 0.0
    assert scorers.code_debug("The answer is: parse_header", ["A", "parse_header"], NO_META) == 1.0


def test_last_boxed_matches_nested_braces_and_takes_the_last():
    text = r"first \boxed{1} then \boxed{\frac{\sqrt{3}}{2}} done"
    assert last_boxed(text) == r"\frac{\sqrt{3}}{2}"
    assert last_boxed(r"\fbox{x^{2}}") == "x^{2}"
    assert last_boxed(r"so $\boxed 5$") == "5"
    assert last_boxed(r"\boxed{\frac{1}{2}") is None  # unclosed
    assert last_boxed("no answer here") is None


def test_boxed_equivalence_uses_math_verify():
    assert boxed_equiv_score(r"... so the answer is \boxed{0.5}", [r"\frac{1}{2}"]) == 1.0
    assert boxed_equiv_score(r"\boxed{2\sqrt{2}}", [r"\sqrt{8}"]) == 1.0
    assert boxed_equiv_score(r"\boxed{3}", ["4"]) == 0.0
    assert boxed_equiv_score("the answer is 4", ["4"]) == 0.0  # nothing boxed


def test_first_line_only_is_applied_by_the_task():
    spec = load_task("longbench_triviaqa")
    assert spec.first_line_only
    # first line "Paris" -> F1 1; whole text [paris, london, is, wrong] -> P 1/4, R 1 -> F1 0.4
    assert score(spec, "Paris\nLondon is wrong", ["Paris"]) == 1.0
    assert score(
        dataclasses.replace(spec, first_line_only=False), "Paris\nLondon is wrong", ["Paris"]
    ) == pytest.approx(0.4)


def test_every_scorer_is_registered_under_its_name():
    public = {name for name, value in vars(scorers).items() if callable(value) and name in scorers.SCORERS}
    assert public == set(scorers.SCORERS)
    assert all(scorers.SCORERS[name] is getattr(scorers, name) for name in scorers.SCORERS)
