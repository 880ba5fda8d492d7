"""Frozen task instances and the one loop that fits a seeded synthetic instance to a token length.

A synthetic generator is two functions: `prepare(rng, index) -> state` draws everything random about
one instance (needles, depths, shuffles) and `render(state, n) -> Rendered` lays it out with `n`
units of filler (words, sentences, documents...) and no further randomness. `fitted_instances`
searches the largest `n` whose prompt plus `max_new_tokens` fits the length, so the needle, the
question and the answers of instance i do not depend on the tokenizer, only the amount of filler.
"""

from __future__ import annotations

import functools
import logging
import random
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from .length_fit import CountTokens, LengthError, fit_largest
from .task_spec import TaskSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Instance:
    """One prompt and its reference answers; `meta` carries what scorers and the microscope need.

    `prompt` is the base-model text (user message + answer prefix). A chat engine formats
    `meta["user_message"]` with its chat template and appends `meta["answer_prefix"]` (RULER's rule).
    """

    task: str
    instance_id: str
    prompt: str
    answers: tuple[str, ...]
    meta: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True)
class Rendered:
    """A generator's output for one filler amount."""

    user_message: str
    answer_prefix: str
    answers: tuple[str, ...]
    meta: Mapping[str, Any]

    @property
    def prompt(self) -> str:
        return self.user_message + self.answer_prefix


def format_prompt(spec: TaskSpec, context: str, **fields: Any) -> str:
    """The base-model prompt of a file-backed task: template filled with `context` and fields, plus the prefix."""
    return spec.template.format(context=context, **fields) + spec.answer_prefix


def instance_rng(seed: int, task: str, length_tokens: int, index: int) -> random.Random:
    """The random stream of one instance: a pure function of (seed, task, length, index)."""
    return random.Random(f"{seed}:{task}:{length_tokens}:{index}")  # str seeds hash with sha512: stable


def make_instance(
    spec: TaskSpec, length_tokens: int, seed: int, index: int, rendered: Rendered, **meta: Any
) -> Instance:
    full_meta = {
        "suite": spec.suite,
        "task_version": spec.version,
        "length_tokens": length_tokens,
        "seed": seed,
        "index": index,
        "user_message": rendered.user_message,
        "answer_prefix": rendered.answer_prefix,
        **rendered.meta,
        **meta,
    }
    return Instance(
        task=spec.name,
        instance_id=f"{spec.name}/L{length_tokens}/s{seed}/{index}",
        prompt=rendered.prompt,
        answers=tuple(rendered.answers),
        meta=MappingProxyType(full_meta),
    )


def _fit_one(
    render_n: Callable[[int], Rendered],
    count_tokens: CountTokens,
    budget: int,
    lowest: int,
    highest: int,
    hint: int | None,
) -> tuple[int, Callable[[int], int]]:
    """Largest filler amount whose prompt has at most `budget` tokens (lowest - 1 when none fits), and
    the memoised prompt token count per filler amount (the answer's count is already in it)."""
    tokens = functools.lru_cache(maxsize=None)(lambda n: count_tokens(render_n(n).prompt))
    if hint is None:  # extrapolate from two small probes instead of rendering a huge first guess
        probe = min(highest, lowest + 32)
        per_unit = max((tokens(probe) - tokens(lowest)) / max(probe - lowest, 1), 1e-9)
        hint = int(lowest + (budget - tokens(lowest)) / per_unit)
    return fit_largest(lambda n: tokens(n) <= budget, lowest=lowest, highest=highest, hint=hint), tokens


def fitted_instances(
    spec: TaskSpec,
    length_tokens: int,
    num_samples: int,
    count_tokens: CountTokens,
    seed: int,
    prepare: Callable[[random.Random, int], Any],
    render: Callable[[Any, int], Rendered],
    highest: int,
    lowest: int = 1,
) -> Iterator[Instance]:
    """Yield `num_samples` instances, each with the most filler whose prompt fits `length_tokens - max_new_tokens`."""
    budget = length_tokens - spec.max_new_tokens
    hint = None
    for index in range(num_samples):
        state = prepare(instance_rng(seed, spec.name, length_tokens, index), index)
        render_n = functools.lru_cache(maxsize=None)(functools.partial(render, state))
        n, tokens = _fit_one(render_n, count_tokens, budget, lowest, highest, hint)
        if n < lowest:
            shortest = tokens(lowest) + spec.max_new_tokens
            raise LengthError(
                f"{spec.name}: length {length_tokens} cannot hold the smallest prompt ({shortest} tokens "
                f"including {spec.max_new_tokens} to generate); use a length of at least {shortest}"
            )
        hint = n
        best = render_n(n)
        prompt_tokens = tokens(n)
        if n == highest:
            logger.warning("%s: all %d filler units used; the prompt is %d tokens short of %d",
                           spec.name, n, budget - prompt_tokens, length_tokens)  # fmt: skip
        yield make_instance(spec, length_tokens, seed, index, best, filler_units=n, prompt_tokens=prompt_tokens)
