"""InfiniteBench: the three synthetic retrieval tasks regenerated offline, the real-text tasks from local JSONL.

Synthetic (after OpenBMB/InfiniteBench `data/construct_synthetic_dataset.py`): the noise line
"The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again." repeated,
with one answer line at a depth that sweeps evenly from the start (instance 0) to the end (last):
- `passkey`: "The pass key is {key}. Remember it. {key} is the pass key." with 5 random digits;
- `number_string`: the same with "The sequence of digits is ..." and 10 digits (5 random, 5 repeats);
- `kv_retrieval`: a JSON object of random UUID key/value pairs; the question names one key.

Real-text tasks read `data_dir / data_file`, one JSON object per line, the fields of the Hugging Face
`xinrongzhang2022/InfiniteBench` files:

    {"id": int, "context": str, "input": str, "answer": [str] | str, "options": [str]}

`options` is needed by longbook_choice_eng and code_debug only (answers become the option's letter
and text). The context is cut in the middle until the prompt and `max_new_tokens` fit the length.
"""

from __future__ import annotations

import functools
import random
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

from .instances import Instance, Rendered, fitted_instances, format_prompt, make_instance
from .jsonl import DataFileError, iter_records, require_field
from .length_fit import CountTokens, middle_truncate
from .task_spec import TaskSpec
from .text_sources import NOISE_SENTENCES

SCHEMA = (
    'one JSON object per line: {"id": int, "context": str, "input": str, "answer": [str] | str, '
    '"options": [str] (choice tasks only)}, as in the xinrongzhang2022/InfiniteBench files'
)
NOISE_LINE = NOISE_SENTENCES + "\n"
LETTERS = "ABCD"


def _depth(index: int, num_samples: int) -> float:
    return index / (num_samples - 1) if num_samples > 1 else 0.5


def _noise_instances(spec, length_tokens, num_samples, count_tokens, seed, draw_key, answer_line) -> Iterator[Instance]:
    def prepare(rng: random.Random, index: int):
        return draw_key(rng), _depth(index, num_samples)

    def render(state, n: int) -> Rendered:
        key, depth = state
        before = round(depth * n)
        context = (NOISE_LINE * before + answer_line.format(key=key) + NOISE_LINE * (n - before)).rstrip("\n")
        fields = {"context": context, "input": spec.args["question"]}
        return Rendered(spec.template.format(**fields), spec.answer_prefix.format(**fields), (key,), {"depth": depth})

    return fitted_instances(
        spec, length_tokens, num_samples, count_tokens, seed, prepare, render, highest=length_tokens
    )


def passkey(
    spec: TaskSpec, length_tokens: int, num_samples: int, count_tokens: CountTokens, seed: int
) -> Iterator[Instance]:
    """args: question."""
    line = "The pass key is {key}. Remember it. {key} is the pass key.\n"
    return _noise_instances(
        spec, length_tokens, num_samples, count_tokens, seed, lambda r: "".join(r.choices("0123456789", k=5)), line
    )


def _digit_string(rng: random.Random) -> str:
    """10 digits: 5 random ones, then 5 times a digit duplicated next to itself (InfiniteBench's recipe)."""
    digits = rng.choices("0123456789", k=5)
    for extra in range(5):
        position = rng.randint(0, 4 + extra)
        digits.insert(position, digits[position])
    return "".join(digits)


def number_string(
    spec: TaskSpec, length_tokens: int, num_samples: int, count_tokens: CountTokens, seed: int
) -> Iterator[Instance]:
    """args: question."""
    line = "The sequence of digits is {key}. Remember it. {key} is the sequence of digits.\n"
    return _noise_instances(spec, length_tokens, num_samples, count_tokens, seed, _digit_string, line)


def kv_retrieval(
    spec: TaskSpec, length_tokens: int, num_samples: int, count_tokens: CountTokens, seed: int
) -> Iterator[Instance]:
    """A JSON object of n UUID pairs; the asked key sits at a sweeping depth."""

    def prepare(rng: random.Random, index: int):
        return rng.getrandbits(64), _depth(index, num_samples)

    def render(state, n: int) -> Rendered:
        stream_seed, depth = state
        stream = random.Random(stream_seed)  # the first n pairs of one stream: more filler only appends
        pairs = [
            (
                str(uuid.UUID(int=stream.getrandbits(128), version=4)),
                str(uuid.UUID(int=stream.getrandbits(128), version=4)),
            )
            for _ in range(n)
        ]
        key, value = pairs[round(depth * (n - 1))]
        context = "JSON data:\n{" + ", ".join(f'"{k}": "{v}"' for k, v in pairs) + "}"
        fields = {"context": context, "input": f'Key: "{key}"\nThe value associated with the specified key is: '}
        return Rendered(
            spec.template.format(**fields),
            spec.answer_prefix.format(**fields),
            (value,),
            {"depth": depth, "num_pairs": n},
        )

    return fitted_instances(
        spec, length_tokens, num_samples, count_tokens, seed, prepare, render, highest=length_tokens
    )


def _fields(record: dict, path: Path, index: int) -> tuple[dict[str, str], tuple[str, ...]]:
    """Template fields and reference answers of one InfiniteBench record."""
    question = require_field(record, ("input",), path, index, SCHEMA)
    answer = require_field(record, ("answer",), path, index, SCHEMA)
    answers = [str(a) for a in answer] if isinstance(answer, list) else [str(answer)]
    fields = {"input": question, "question": question}
    options = record.get("options") or []
    for letter, option in zip(LETTERS, options):
        fields[f"OPTION_{letter}"] = option
    if options and answers[0] in options:  # choice tasks: score the letter (and the option text)
        answers = [LETTERS[options.index(answers[0])], answers[0]]
    call = re.search(r"func_[0-9]+\(-?[0-9]+\)", question)
    if call:  # code_run asks for the value of one call
        fields.update(func_call=call.group(0), func=call.group(0).split("(")[0])
    return fields, tuple(answers)


def infinitebench_jsonl(
    spec: TaskSpec, length_tokens: int, num_samples: int | None, count_tokens: CountTokens, seed: int, data_dir: Path
) -> Iterator[Instance]:
    """Real-text InfiniteBench records from `data_dir / spec.data_file`, context middle-truncated to fit."""
    path = data_dir / spec.data_file
    budget = length_tokens - spec.max_new_tokens
    for index, record in iter_records(path, SCHEMA, num_samples, seed, spec.name):
        context = require_field(record, ("context",), path, index, SCHEMA)
        fields, answers = _fields(record, path, index)
        if "OPTION_A" in spec.template and "OPTION_A" not in fields:
            raise DataFileError(
                f"{path}: record {index} needs a non-empty `options` list for {spec.name}. Expected {SCHEMA}"
            )
        count = functools.lru_cache(maxsize=None)(count_tokens)  # the fit's counts, reused for prompt_tokens
        kept = middle_truncate(context, budget, count, functools.partial(format_prompt, spec, **fields))
        rendered = Rendered(
            spec.template.format(context=kept, **fields),
            spec.answer_prefix,
            answers,
            {"record_id": record.get("id", index), "truncated": kept != context, "data_file": str(path)},
        )
        yield make_instance(spec, length_tokens, seed, index, rendered, prompt_tokens=count(rendered.prompt))


GENERATORS = {"passkey": passkey, "number_string": number_string, "kv_retrieval": kv_retrieval}
LOADERS = {"infinitebench_jsonl": infinitebench_jsonl}
