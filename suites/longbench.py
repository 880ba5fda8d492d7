"""LongBench-v1 (English datasets) from local JSONL files, middle-truncated, with the official metrics.

Each dataset is one file `data_dir / spec.data_file` (e.g. `longbench/hotpotqa.jsonl`), one JSON object
per line, the fields of the Hugging Face `THUDM/LongBench` files:

    {"input": str, "context": str, "answers": [str], "length": int, "dataset": str,
     "language": str, "all_classes": [str] | null, "_id": str}

Required: `input`, `context`, `answers`; `all_classes` for trec (classification). Prompts and
generation lengths are LongBench's `dataset2prompt.json` / `dataset2maxlen.json` (in
`tasks/longbench.yaml`). Like LongBench's `pred.py`, an over-long prompt keeps its head and tail
(we cut the context, which sits in the middle of every LongBench prompt); unlike it the limit is the
task length minus `max_new_tokens`, so the whole sequence fits the length. Scores are the best over
the reference answers; trec, triviaqa and samsum score only the first line of the generation
(`first_line_only` in the YAML).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

from .instances import Instance, Rendered, format_prompt, make_instance
from .jsonl import DataFileError, iter_records, require_field
from .length_fit import CountTokens, middle_truncate
from .task_spec import TaskSpec

SCHEMA = (
    'one JSON object per line: {"input": str, "context": str, "answers": [str], "length": int, '
    '"dataset": str, "language": str, "all_classes": [str] | null, "_id": str}, as in the THUDM/LongBench '
    "files (input, context, answers required; all_classes for trec)"
)


def longbench_jsonl(
    spec: TaskSpec, length_tokens: int, num_samples: int | None, count_tokens: CountTokens, seed: int, data_dir: Path
) -> Iterator[Instance]:
    """LongBench records from `data_dir / spec.data_file`; a seeded subset when num_samples < the file's size."""
    path = data_dir / spec.data_file
    budget = length_tokens - spec.max_new_tokens
    for index, record in iter_records(path, SCHEMA, num_samples, seed, spec.name):
        question = require_field(record, ("input",), path, index, SCHEMA)
        context = require_field(record, ("context",), path, index, SCHEMA)
        answers = require_field(record, ("answers",), path, index, SCHEMA)
        if not isinstance(answers, list) or not answers:
            raise DataFileError(f"{path}: record {index}: `answers` must be a non-empty list. Expected {SCHEMA}")
        if spec.scorer == "classification" and not record.get("all_classes"):
            raise DataFileError(f"{path}: record {index}: {spec.name} needs `all_classes`. Expected {SCHEMA}")
        count = functools.lru_cache(maxsize=None)(count_tokens)  # the fit's counts, reused for prompt_tokens
        kept = middle_truncate(context, budget, count, functools.partial(format_prompt, spec, input=question))
        meta = {
            "record_id": record.get("_id", index),
            "all_classes": record.get("all_classes") or [],
            "truncated": kept != context,
            "data_file": str(path),
        }
        rendered = Rendered(
            spec.template.format(context=kept, input=question), spec.answer_prefix, tuple(map(str, answers)), meta
        )
        yield make_instance(spec, length_tokens, seed, index, rendered, prompt_tokens=count(rendered.prompt))


LOADERS = {"longbench_jsonl": longbench_jsonl}
