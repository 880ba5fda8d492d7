"""The interface the evaluation engines call: `iter_instances` (task -> frozen instances) and `score`.

Generators and loaders are found by the name in the task's YAML, never by `if name == ...`.
Generations are scored after the fact from (task, generation, answers, meta), so stored records can
be re-scored without the engine.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

from . import infinitebench, longbench, math_grading, ruler
from .instances import Instance
from .length_fit import CountTokens, approx_count_tokens
from .scorers import SCORERS
from .task_spec import TaskSpec, TaskSpecError

GENERATORS = {**ruler.GENERATORS, **infinitebench.GENERATORS}
LOADERS = {**infinitebench.LOADERS, **longbench.LOADERS, "math_jsonl": math_grading.math_jsonl}
DEFAULT_DATA_DIR = Path("data")


def iter_instances(
    task_spec: TaskSpec,
    length_tokens: int,
    num_samples: int | None,
    count_tokens: CountTokens = approx_count_tokens,
    seed: int | None = None,
    *,
    data_dir: Path | str = DEFAULT_DATA_DIR,
) -> Iterator[Instance]:
    """Instances of one task at one length: `prompt` + `max_new_tokens` fit `length_tokens` tokens.

    `count_tokens` is the engine tokenizer's counter (the default approximates; use it for tests only).
    `seed` defaults to the task's YAML seed. Synthetic tasks need `num_samples`; file-backed tasks read
    `data_dir / data_file` and take a seeded subset of `num_samples` records (all when None).
    """
    seed = task_spec.seed if seed is None else seed
    if length_tokens <= task_spec.max_new_tokens:
        raise ValueError(
            f"{task_spec.name}: length {length_tokens} leaves no room after {task_spec.max_new_tokens} generated tokens"
        )
    if task_spec.generator is not None:
        if task_spec.generator not in GENERATORS:
            raise TaskSpecError(
                f"{task_spec.name}: unknown generator {task_spec.generator!r}; known: {sorted(GENERATORS)}"
            )
        if not num_samples or num_samples < 1:
            raise ValueError(f"{task_spec.name} is synthetic: pass num_samples >= 1")
        return GENERATORS[task_spec.generator](task_spec, length_tokens, num_samples, count_tokens, seed)
    if task_spec.loader not in LOADERS:
        raise TaskSpecError(f"{task_spec.name}: unknown loader {task_spec.loader!r}; known: {sorted(LOADERS)}")
    return LOADERS[task_spec.loader](task_spec, length_tokens, num_samples, count_tokens, seed, Path(data_dir))


def score(task_spec: TaskSpec, generation: str, answers: Sequence[str], meta: Mapping[str, Any] | None = None) -> float:
    """The task's metric for one generation, in [0, 1]; `meta` is the instance's (classification needs it)."""
    if task_spec.first_line_only:
        generation = generation.lstrip("\n").split("\n")[0]
    return SCORERS[task_spec.scorer](generation, list(answers), meta if meta is not None else MappingProxyType({}))
