"""RULER's 13 synthetic tasks, generated offline, seeded and fitted to a token length.

Five generators cover them (task knobs come from `tasks/ruler.yaml`, after NVIDIA/RULER's
`synthetic.yaml`; the phrasing of needles, noise and templates follows RULER's `constants.py`):

- `niah`: needles "One of the special magic {numbers|uuids|words} for {key} is: {value}." hidden in a
  haystack of `noise` (the grass-is-green sentences, one per line), `essay` (Paul Graham essays,
  needles inserted between sentences at depths drawn from 40 evenly spaced percentages) or `needle`
  (distractor needles with random keys). Keys are adjective-noun words, 7-digit numbers or UUIDs.
- `variable_tracking`: chains "VAR ABCDE = 12345", "VAR FGHIJ = VAR ABCDE " ... among noise lines,
  after one short solved example; answer = every variable of the first chain.
- `common_words`: a numbered list where 10 words repeat 30x (6x below 4K) and the rest 3x (1x),
  after one short solved example; answer = the 10 common words.
- `freq_words`: 6-letter coded words drawn by a zeta(alpha) law; the top word is replaced by "..."
  noise; answer = the next three most frequent.
- `qa`: a SQuAD (qa_1) or HotpotQA (qa_2) question among distractor documents "Document i:\n...".

Differences from the reference scripts, all deliberate: filler amount is fitted per instance by a
monotone search (not a fixed increment), sentence splitting is a regex (no nltk download), needle
keys of one instance are distinct, and qa questions are a seeded draw rather than the first N.
"""

from __future__ import annotations

import math
import random
import re
import string
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from .instances import Instance, Rendered, fitted_instances
from .length_fit import CountTokens
from .task_spec import TaskSpec
from .text_sources import NOISE_SENTENCES, essay_words, haystack_source, qa_dataset, split_sentences, word_lists

DEPTHS_PERCENT = tuple(round(100 * i / 39) for i in range(40))  # RULER: 40 evenly spaced depths
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
DOCUMENT = "Document {i}:\n{document}"


def _draw(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    if kind == "words":
        lists = word_lists()
        return f"{rng.choice(lists.adjectives)}-{rng.choice(lists.nouns)}"
    raise ValueError(f"unknown needle type {kind!r}; use numbers, uuids or words")


def _singular(text: str) -> str:
    """RULER's wording when exactly one value is asked for ("A special magic number is ...")."""
    for plural, single in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
        text = re.sub(rf"\b{plural}\b", single, text)
    return text


def _insert(lines: list[str], items: list[str], fractions: list[float]) -> list[str]:
    """Insert items[i] at relative position fractions[i] of `lines` (fractions ascending, 0 = start, 1 = end)."""
    out = list(lines)
    for offset, (fraction, item) in enumerate(zip(fractions, items)):
        out.insert(int(fraction * len(lines)) + offset, item)
    return out


# ---------------------------------------------------------------- niah


@dataclass(frozen=True)
class _NiahState:
    needles: tuple[str, ...]
    depths: tuple[float, ...]  # fraction of the haystack before each needle, ascending
    query: str
    answers: tuple[str, ...]
    distractor_seed: int


def niah(
    spec: TaskSpec, length_tokens: int, num_samples: int, count_tokens: CountTokens, seed: int
) -> Iterator[Instance]:
    """Needle(s) in a haystack.

    args: haystack (noise|essay|needle), key_type / value_type (words|numbers|uuids), num_keys, num_values,
    num_queries.
    """
    a = spec.args
    haystack, key_type, value_type = a["haystack"], a["key_type"], a["value_type"]
    num_values, num_queries = a.get("num_values", 1), a.get("num_queries", 1)
    num_keys = max(a.get("num_keys", 1), num_queries)
    single = num_values * num_queries == 1
    template, prefix = (
        (_singular(spec.template), _singular(spec.answer_prefix)) if single else (spec.template, spec.answer_prefix)
    )
    needle_kind = value_type[:-1] if single else value_type
    essay = essay_words() if haystack == "essay" else ()

    def prepare(rng: random.Random, index: int) -> _NiahState:
        keys: list[str] = []
        while len(keys) < num_keys:
            key = _draw(rng, key_type)
            if key not in keys:
                keys.append(key)
        values = [[_draw(rng, value_type) for _ in range(num_values)] for _ in keys]
        needles = [NEEDLE.format(type_needle_v=value_type, key=k, value=v) for k, vs in zip(keys, values) for v in vs]
        rng.shuffle(needles)
        if haystack == "essay":
            depths = sorted(d / 100 for d in rng.sample(DEPTHS_PERCENT, len(needles)))
        else:
            depths = sorted(rng.random() for _ in needles)
        asked = rng.sample(range(num_keys), num_queries)
        names = [keys[i] for i in asked]
        query = names[0] if len(names) == 1 else ", ".join(names[:-1]) + ", and " + names[-1]
        answers = tuple(v for i in asked for v in values[i])
        return _NiahState(tuple(needles), tuple(depths), query, answers, rng.getrandbits(64))

    def render(state: _NiahState, n: int) -> Rendered:
        if haystack == "essay":
            sentences = split_sentences(" ".join(essay[:n]))
            context = " ".join(_insert(sentences, list(state.needles), list(state.depths)))
        else:
            if haystack == "noise":
                lines = [NOISE_SENTENCES] * n
            else:  # distractor needles: a prefix of one seeded stream, so more filler only appends
                drng = random.Random(state.distractor_seed)
                lines = [
                    NEEDLE.format(type_needle_v=value_type, key=_draw(drng, key_type), value=_draw(drng, value_type))
                    for _ in range(n)
                ]
            context = "\n".join(_insert(lines, list(state.needles), list(state.depths)))
        fields = {"type_needle_v": needle_kind, "context": context, "query": state.query}
        meta = {
            "needles": state.needles,  # lets an engine find the needles' token spans (carrier pages)
            "needle_depths": state.depths,
            "haystack": haystack_source() if haystack == "essay" else haystack,
        }
        return Rendered(template.format(**fields), prefix.format(**fields), state.answers, meta)

    highest = len(essay) if haystack == "essay" else 4 * length_tokens
    return fitted_instances(spec, length_tokens, num_samples, count_tokens, seed, prepare, render, highest)


# ---------------------------------------------------------------- variable tracking


def _variables(rng: random.Random, count: int, letters: int) -> list[str]:
    names: list[str] = []
    while len(names) < count:
        name = "".join(rng.choices(string.ascii_uppercase, k=letters))
        if name not in names:
            names.append(name)
    return names


def _chains(
    rng: random.Random, num_chains: int, num_hops: int, letters: int
) -> tuple[list[list[str]], list[list[str]]]:
    names = _variables(rng, num_chains * (num_hops + 1), letters)
    groups = [names[i : i + num_hops + 1] for i in range(0, len(names), num_hops + 1)]
    chains = []
    for group in groups:
        chain = [f"VAR {group[0]} = {rng.randint(10000, 99999)}"]
        chain += [f"VAR {group[j + 1]} = VAR {group[j]} " for j in range(num_hops)]
        chains.append(chain)
    return groups, chains


def _vt_text(
    template: str, prefix: str, chains: list[list[str]], fractions: list[list[float]], n: int, num_hops: int
) -> tuple[str, str]:
    """(user message, answer prefix) with the chains spread over n noise lines."""
    lines = [NOISE_SENTENCES + "\n"] * n
    for chain, where in zip(chains, fractions):
        lines = _insert(lines, chain, where)
    context = " ".join(lines).replace(". \n", ".\n")
    fields = {"context": context, "query": chains[0][0].split("=")[-1].strip(), "num_v": num_hops + 1}
    return template.format(**fields), prefix.format(**fields)


def variable_tracking(
    spec: TaskSpec, length_tokens: int, num_samples: int, count_tokens: CountTokens, seed: int
) -> Iterator[Instance]:
    """Variable tracking (vt). args: num_chains, num_hops, example_noise_lines (the solved example's filler)."""
    num_chains, num_hops = spec.args.get("num_chains", 1), spec.args.get("num_hops", 4)
    example_lines = spec.args.get("example_noise_lines", 16)

    def prepare(rng: random.Random, index: int):
        example_vars, example_chains = _chains(rng, num_chains, num_hops, letters=3)
        example_where = [sorted(rng.random() for _ in c) for c in example_chains]
        user, prefix = _vt_text(
            spec.template, spec.answer_prefix, example_chains, example_where, example_lines, num_hops
        )
        example = f"{user}{prefix} {' '.join(example_vars[0])}\n\n"
        groups, chains = _chains(rng, num_chains, num_hops, letters=5)
        where = [sorted(rng.random() for _ in c) for c in chains]
        return example, groups[0], chains, where

    def render(state, n: int) -> Rendered:
        example, answers, chains, where = state
        user, prefix = _vt_text(spec.template, spec.answer_prefix, chains, where, n, num_hops)
        return Rendered(example + user, prefix, tuple(answers), {"haystack": "noise"})

    return fitted_instances(
        spec, length_tokens, num_samples, count_tokens, seed, prepare, render, highest=4 * length_tokens
    )


# ---------------------------------------------------------------- common / frequent words


def _numbered(words: list[str]) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def common_words(
    spec: TaskSpec, length_tokens: int, num_samples: int, count_tokens: CountTokens, seed: int
) -> Iterator[Instance]:
    """Common words extraction (cwe). args: freq_cw, freq_ucw, num_cw; below 4096 tokens RULER uses 6x/1x."""
    lists = word_lists()
    vocabulary = sorted(set(lists.nouns + lists.adjectives + lists.verbs))
    num_common = spec.args.get("num_cw", 10)
    short = length_tokens < 4096
    common_repeats, rare_repeats = (6, 1) if short else (spec.args.get("freq_cw", 30), spec.args.get("freq_ucw", 3))
    example_words, example_common, example_rare = (20, 3, 1) if short else (40, 10, 3)

    def listing(words: list[str], common: int, rare: int, shuffle_seed: int) -> str:
        items = words[:num_common] * common + words[num_common:] * rare
        random.Random(shuffle_seed).shuffle(items)
        return _numbered(items)

    def prepare(rng: random.Random, index: int):
        example = rng.sample(vocabulary, example_words)
        example_context = listing(example, example_common, example_rare, rng.getrandbits(64))
        solved = (
            spec.template.format(context=example_context, query="")
            + spec.answer_prefix
            + " "
            + _numbered(example[:num_common])
        )
        order = rng.sample(vocabulary, len(vocabulary))  # the first n words of this order are used
        return solved, order, rng.getrandbits(64)

    def render(state, n: int) -> Rendered:
        solved, order, shuffle_seed = state
        words = order[: num_common + n]
        user = (
            solved
            + "\n"
            + spec.template.format(context=listing(words, common_repeats, rare_repeats, shuffle_seed), query="")
        )
        return Rendered(user, spec.answer_prefix, tuple(words[:num_common]), {"num_distinct_words": len(words)})

    highest = len(vocabulary) - num_common
    return fitted_instances(spec, length_tokens, num_samples, count_tokens, seed, prepare, render, highest)


def _zeta(alpha: float, terms: int = 10_000) -> float:
    """Riemann zeta for alpha > 1: partial sum plus the integral tail (error < terms**-alpha)."""
    return math.fsum(k**-alpha for k in range(1, terms + 1)) + terms ** (1 - alpha) / (alpha - 1) - 0.5 * terms**-alpha


def freq_words(
    spec: TaskSpec, length_tokens: int, num_samples: int, count_tokens: CountTokens, seed: int
) -> Iterator[Instance]:
    """Frequent words extraction (fwe). args: alpha (zeta exponent), word_length, vocab_size (default length // 50)."""
    alpha = float(spec.args.get("alpha", 2.0))
    word_length = spec.args.get("word_length", 6)
    vocab_size = spec.args.get("vocab_size") or max(length_tokens // 50, 8)
    zeta = _zeta(alpha)

    def prepare(rng: random.Random, index: int):
        vocab: set[str] = set()
        while len(vocab) < vocab_size:
            vocab.add("".join(rng.choices(string.ascii_lowercase, k=word_length)))
        ranked = sorted(vocab)
        rng.shuffle(ranked)
        ranked[0] = "..."  # the most frequent "word" is noise the prompt tells the model to ignore
        return ranked, rng.getrandbits(64)

    def render(state, n: int) -> Rendered:
        ranked, shuffle_seed = state
        words = [w for rank, w in enumerate(ranked, start=1) for _ in range(int(n * rank**-alpha / zeta))]
        random.Random(shuffle_seed).shuffle(words)
        fields = {"context": " ".join(words), "query": ""}
        meta = {"num_words": len(words)}
        return Rendered(spec.template.format(**fields), spec.answer_prefix.format(**fields), tuple(ranked[1:4]), meta)

    return fitted_instances(
        spec, length_tokens, num_samples, count_tokens, seed, prepare, render, highest=8 * length_tokens, lowest=20
    )


# ---------------------------------------------------------------- qa


def qa(
    spec: TaskSpec, length_tokens: int, num_samples: int, count_tokens: CountTokens, seed: int
) -> Iterator[Instance]:
    """Question answering among distractor documents. args: dataset (squad|hotpotqa)."""
    name = spec.args["dataset"]
    questions, documents = qa_dataset(name)
    picked = random.Random(f"{seed}:{spec.name}:questions").sample(
        range(len(questions)), min(num_samples, len(questions))
    )

    def prepare(rng: random.Random, index: int):
        item = questions[picked[index]]
        related = list(item.related_docs)
        rng.shuffle(related)
        taken = set(item.gold_docs) | set(related)
        others = [i for i in rng.sample(range(len(documents)), len(documents)) if i not in taken]
        return item, list(item.gold_docs) + related + others, rng.getrandbits(64)

    def render(state, n: int) -> Rendered:
        item, ranked_docs, shuffle_seed = state
        chosen = ranked_docs[: max(n, len(item.gold_docs))]
        random.Random(shuffle_seed).shuffle(chosen)
        context = "\n\n".join(DOCUMENT.format(i=i + 1, document=documents[d]) for i, d in enumerate(chosen))
        fields = {"context": context, "query": item.question}
        meta = {
            "dataset": name,
            "num_documents": len(chosen),
            "gold_positions": [chosen.index(g) + 1 for g in item.gold_docs],
        }
        return Rendered(spec.template.format(**fields), spec.answer_prefix.format(**fields), item.answers, meta)

    if num_samples > len(questions):
        raise ValueError(f"{spec.name}: {num_samples} samples requested but {name} has {len(questions)} questions")
    return fitted_instances(
        spec, length_tokens, num_samples, count_tokens, seed, prepare, render, highest=len(documents), lowest=1
    )


GENERATORS = {
    "niah": niah,
    "variable_tracking": variable_tracking,
    "common_words": common_words,
    "freq_words": freq_words,
    "qa": qa,
}
