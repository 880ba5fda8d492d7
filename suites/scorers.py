"""Scorers: (generation, reference answers, instance meta) -> score in [0, 1], by name.

Each follows the benchmark that defines it (scores are in [0, 1]; the benchmarks print x100):
- RULER (`eval/synthetic/constants.py`): `string_match_all` = share of references found in the
  generation (case-insensitive substring), `string_match_part` = 1 if any reference is found.
- LongBench-v1 (`LongBench/metrics.py`, best over references): `qa_f1` (SQuAD-normalized token F1),
  `rouge_l` (the `rouge` package's ROUGE-L F, as LongBench calls it), `classification` (needs
  meta["all_classes"]), `retrieval` ("Paragraph N"), `count`, `code_sim` (first code line, fuzzy
  ratio via rapidfuzz, rounded like fuzzywuzzy's).
- InfiniteBench (`src/compute_scores.py`): `first_int_match` (passkey, number_string), `word_match`
  (kv_retrieval), `qa_f1`, `qa_f1_chars` (Chinese, one character per token), `rouge_lsum`
  (rouge-score's ROUGE-Lsum, what HF `evaluate` computes), `choice_letter`, `code_debug`, `last_int`
  (code_run), `first_number` (math_find), `name_match` (longdialogue_qa_eng).
- MATH-500 / AIME: `boxed_equiv` (last \\boxed{...}, math-verify equivalence; see math_answers.py).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .math_answers import boxed_equiv_score

Scorer = Callable[[str, Sequence[str], Mapping[str, Any]], float]
SUITES_HINT = "pip install 'locks-toolkit[suites]'"


class ScorerDependencyError(ImportError):
    """A metric's library is not installed; the message names the install command."""


def _best(answers: Sequence[str], one: Callable[[str], float]) -> float:
    return max((one(a) for a in answers), default=0.0)


# ---------------------------------------------------------------- RULER


def string_match_all(generation: str, answers: Sequence[str], meta: Mapping[str, Any]) -> float:
    text = generation.lower()
    return sum(a.lower() in text for a in answers) / len(answers) if answers else 0.0


def string_match_part(generation: str, answers: Sequence[str], meta: Mapping[str, Any]) -> float:
    text = generation.lower()
    return float(any(a.lower() in text for a in answers))


# ---------------------------------------------------------------- token F1


def normalize_answer(text: str) -> str:
    """SQuAD normalization: lowercase, drop punctuation and articles, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def token_f1(prediction_tokens: Sequence[str], reference_tokens: Sequence[str]) -> float:
    common = sum((Counter(prediction_tokens) & Counter(reference_tokens)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(prediction_tokens), common / len(reference_tokens)
    return 2 * precision * recall / (precision + recall)


def qa_f1(generation: str, answers: Sequence[str], meta: Mapping[str, Any]) -> float:
    predicted = normalize_answer(generation).split()
    return _best(answers, lambda a: token_f1(predicted, normalize_answer(a).split()))


_ZH_PUNCTUATION = set(string.punctuation) | set(
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
)


def _zh_chars(text: str) -> list[str]:
    return [ch for ch in text.lower() if ch not in _ZH_PUNCTUATION and not ch.isspace()]


def qa_f1_chars(generation: str, answers: Sequence[str], meta: Mapping[str, Any]) -> float:
    predicted = _zh_chars(generation)
    return _best(answers, lambda a: token_f1(predicted, _zh_chars(a)))


# ---------------------------------------------------------------- ROUGE


def rouge_l(generation: str, answers: Sequence[str], meta: Mapping[str, Any]) -> float:
    """LongBench's ROUGE-L F (the `rouge` package); an empty or unscorable generation scores 0."""
    try:
        from rouge import Rouge
    except ImportError as error:
        raise ScorerDependencyError(f"rouge_l needs the PyPI package `rouge`; {SUITES_HINT}") from error

    def one(answer: str) -> float:
        try:
            return float(Rouge().get_scores([generation], [answer], avg=True)["rouge-l"]["f"])
        except (ValueError, RecursionError):  # empty hypothesis, or a pathological input
            return 0.0

    return _best(answers, one)


def rouge_lsum(generation: str, answers: Sequence[str], meta: Mapping[str, Any]) -> float:
    """InfiniteBench's ROUGE-Lsum F (rouge-score, sentences split on newlines, no stemming)."""
    try:
        from rouge_score import rouge_scorer
    except ImportError as error:
        raise ScorerDependencyError(f"rouge_lsum needs the PyPI package `rouge-score`; {SUITES_HINT}") from error
    scorer = rouge_scorer.RougeScorer(["rougeLsum"], use_stemmer=False)
    return _best(answers, lambda a: scorer.score(a, generation)["rougeLsum"].fmeasure)


# ---------------------------------------------------------------- LongBench others


def classification(generation: str, answers: Sequence[str], meta: Mapping[str, Any]) -> float:
    """1/k when the true class is among the k class names found (names inside the true one excluded)."""
    if "all_classes" not in meta:
        raise KeyError("classification needs meta['all_classes'] (the LongBench record's all_classes field)")

    def one(answer: str) -> float:
        found = [c for c in meta["all_classes"] if c in generation]
        found = [c for c in found if not (c in answer and c != answer)]
        return 1.0 / len(found) if answer in found else 0.0

    return _best(answers, one)


def _share_equal(numbers: list[str], wanted: str) -> float:
    return sum(n == wanted for n in numbers) / len(numbers) if numbers else 0.0


def retrieval(generation: str, answers: Sequence[str], meta: Mapping[str, Any]) -> float:
    """Share of the numbers in the generation that name the right paragraph ("Paragraph N")."""

    def one(answer: str) -> float:
        wanted = re.findall(r"Paragraph (\d+)", answer)
        return _share_equal(re.findall(r"\d+", generation), wanted[0]) if wanted else 0.0

    return _best(answers, one)


def count(generation: str, answers: Sequence[str], meta: Mapping[str, Any]) -> float:
    return _best(answers, lambda a: _share_equal(re.findall(r"\d+", generation), str(a)))


def code_sim(generation: str, answers: Sequence[str], meta: Mapping[str, Any]) -> float:
    """Fuzzy similarity of the first non-comment, non-fence line with the reference line."""
    try:
        from rapidfuzz import fuzz
    except ImportError as error:
        raise ScorerDependencyError(f"code_sim needs the PyPI package `rapidfuzz`; {SUITES_HINT}") from error
    line = next((x for x in generation.lstrip("\n").split("\n") if not any(m in x for m in ("`", "#", "//"))), "")
    # fuzzywuzzy (LongBench's library) returns the ratio rounded to an integer percentage
    return _best(answers, lambda a: round(fuzz.ratio(line, a)) / 100)


# ---------------------------------------------------------------- InfiniteBench


def first_int_match(generation: str, answers: Sequence[str], meta: Mapping[str, Any]) -> float:
    match = re.search(r"\d+", generation)
    return float(match is not None and match.group(0) in answers)


def _words(text: str, separators: str) -> list[str]:
    for ch in separators:
        text = text.replace(ch, " ")
    return text.split()


def word_match(generation: str, answers: Sequence[str], meta: Mapping[str, Any]) -> float:
    words = _words(generation, "\n:\"'.,?!{}")
    return float(any(a in words for a in answers))


def name_match(generation: str, answers: Sequence[str], meta: Mapping[str, Any]) -> float:
    words = [w.upper() for w in _words(generation, "\n:\"'.,?!{}")]
    return float(any(a.upper() in words for a in answers))


def choice_letter(generation: str, answers: Sequence[str], meta: Mapping[str, Any]) -> float:
    """Multiple choice: a leading letter, else the letter after "answer is" etc., else the first lone letter."""
    if generation[:1] in ("A", "B", "C", "D"):
        return float(generation[0] in answers)
    text = " ".join(_words(generation, "\n\"'.,?!{}"))
    for prefix in ("answer is:", "answer:", "answer is", "option is"):
        at = text.find(prefix)
        if at >= 0:
            after = text[at + len(prefix) + 1 :]
            return float(any(after.startswith(a) for a in answers))
    first = next((w for w in text.split() if w in ("A", "B", "C", "D")), None)
    return float(first is not None and first in answers)


def code_debug(generation: str, answers: Sequence[str], meta: Mapping[str, Any]) -> float:
    """answers = (letter, function name): a leading "B." / "B:", or either after "answer is:" / "is:" / "answer:"."""
    letter = answers[0]
    if generation[:2] in (f"{letter}.", f"{letter}:"):
        return 1.0
    text = " ".join(_words(generation.strip().replace("Option", " ").replace("option", " "), "\n`'\"-*"))
    for prefix in ("answer is:", "is:", "answer:"):
        at = text.find(prefix)
        if at >= 0:
            after = text[at + len(prefix) + 1 :]
            return float(any(after.startswith(a) for a in answers))
    return 0.0


def last_int(generation: str, answers: Sequence[str], meta: Mapping[str, Any]) -> float:
    words = _words(generation.strip(), "\n.`'\":")
    if not words or not re.fullmatch(r"[+-]?\d+", words[-1]):
        return 0.0
    return float(any(int(words[-1]) == int(a) for a in answers))


def first_number(generation: str, answers: Sequence[str], meta: Mapping[str, Any]) -> float:
    match = re.search(r"\d+\.\d+|\d+", generation)
    return float(match is not None and any(float(match.group(0)) == float(a) for a in answers))


def boxed_equiv(generation: str, answers: Sequence[str], meta: Mapping[str, Any]) -> float:
    return boxed_equiv_score(generation, answers)


SCORERS: dict[str, Scorer] = {
    "string_match_all": string_match_all,
    "string_match_part": string_match_part,
    "qa_f1": qa_f1,
    "qa_f1_chars": qa_f1_chars,
    "rouge_l": rouge_l,
    "rouge_lsum": rouge_lsum,
    "classification": classification,
    "retrieval": retrieval,
    "count": count,
    "code_sim": code_sim,
    "first_int_match": first_int_match,
    "word_match": word_match,
    "name_match": name_match,
    "choice_letter": choice_letter,
    "code_debug": code_debug,
    "last_int": last_int,
    "first_number": first_number,
    "boxed_equiv": boxed_equiv,
}
