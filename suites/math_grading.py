"""MATH-500 / AIME: read local JSONL files, extract the last \\boxed{...}, check equivalence with math-verify.

Expected file (one JSON object per line; the names below are those of HuggingFaceH4/MATH-500 and
the AIME mirrors, any of the listed spellings is accepted):

    {"problem": "What is $1+1$?", "answer": "2", "unique_id": "test/algebra/1.json"}
    problem:  "problem" | "Problem" | "question"   (str, required)
    answer:   "answer"  | "Answer"                 (str or int, required; the bare final answer)
    id:       "unique_id" | "id" | "ID"            (optional; the line number otherwise)

Grading: `math_answers.boxed_equiv_score` (the last boxed answer against the reference, math-verify).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

from .instances import Instance, Rendered, make_instance
from .jsonl import iter_records, require_field
from .length_fit import CountTokens, LengthError
from .task_spec import TaskSpec

logger = logging.getLogger(__name__)

SCHEMA = (
    'one JSON object per line: {"problem": str, "answer": str|int, "unique_id": str (optional)}; '
    "accepted spellings: problem|Problem|question, answer|Answer, unique_id|id|ID"
)
def math_jsonl(
    spec: TaskSpec, length_tokens: int, num_samples: int | None, count_tokens: CountTokens, seed: int, data_dir: Path
) -> Iterator[Instance]:
    """Problems from `data_dir / spec.data_file`; a seeded subset when num_samples < the file's size."""
    path = data_dir / spec.data_file
    budget = length_tokens - spec.max_new_tokens
    for index, record in iter_records(path, SCHEMA, num_samples, seed, spec.name):
        problem = require_field(record, ("problem", "Problem", "question"), path, index, SCHEMA)
        answer = require_field(record, ("answer", "Answer"), path, index, SCHEMA)
        record_id = next((record[k] for k in ("unique_id", "id", "ID") if k in record), index)
        user = spec.template.format(problem=problem)
        prompt_tokens = count_tokens(user + spec.answer_prefix)
        if prompt_tokens > budget:
            raise LengthError(
                f"{spec.name}: problem {record_id} does not fit {length_tokens} tokens with "
                f"{spec.max_new_tokens} to generate; use a longer length"
            )
        rendered = Rendered(user, spec.answer_prefix, (str(answer),), {"record_id": record_id, "data_file": str(path)})
        yield make_instance(spec, length_tokens, seed, index, rendered, prompt_tokens=prompt_tokens)
