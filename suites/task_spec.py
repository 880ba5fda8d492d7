"""A quality task is data: one YAML entry (generator or loader, lengths, seed, template, scorer, version).

The YAML files live in `suites/tasks/` (package data), one file per suite:

    suite: ruler                # the suite every task of the file belongs to
    defaults: {seed: 42, ...}   # optional; merged under every task's own keys
    tasks:
      niah_single_1:
        generator: niah         # a seeded generator (synthetic tasks) ... or
        # loader: longbench_jsonl  (tasks read from a local JSONL file the user supplies)
        lengths: [4096, 8192]   # context lengths in tokens of the engine's tokenizer
        template: "...{context}...{query}..."
        answer_prefix: " The special magic ..."   # appended after the (chat-formatted) question
        max_new_tokens: 128
        scorer: string_match_all
        version: 1
        args: {haystack: noise} # generator/loader knobs; see the generator's docstring

`load_task(name)` returns a frozen `TaskSpec`; every mistake raises `TaskSpecError` naming the file,
the task and the fix.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from .scorers import SCORERS

logger = logging.getLogger(__name__)

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
SUITES = ("ruler", "infinitebench", "longbench", "math")
_REQUIRED = ("lengths", "template", "max_new_tokens", "scorer", "version")
_KNOWN = set(_REQUIRED) | {"generator", "loader", "seed", "answer_prefix", "args", "data_file", "first_line_only"}


class TaskSpecError(ValueError):
    """A task definition is malformed or unknown; the message says what to change."""


@dataclass(frozen=True)
class TaskSpec:
    """One quality task. Exactly one of `generator` / `loader` is set."""

    name: str
    suite: str
    generator: str | None
    loader: str | None
    lengths: tuple[int, ...]  # context lengths in tokens (prompt + max_new_tokens fits in each)
    seed: int
    template: str  # str.format template; fields depend on the generator/loader
    answer_prefix: str
    max_new_tokens: int
    scorer: str
    version: int
    data_file: str | None = None  # loaders only: path relative to the data directory
    first_line_only: bool = False  # LongBench trec/triviaqa/samsum: score the first line only
    args: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    source: str = ""  # the YAML file it came from

    @property
    def synthetic(self) -> bool:
        return self.generator is not None


def _fail(source: Path, task: str, message: str) -> TaskSpecError:
    return TaskSpecError(f"{source.name}: task {task!r}: {message}")


def _build(source: Path, suite: str, name: str, raw: Mapping[str, Any]) -> TaskSpec:
    unknown = sorted(set(raw) - _KNOWN)
    if unknown:
        raise _fail(source, name, f"unknown keys {unknown}; allowed keys are {sorted(_KNOWN)}")
    missing = [key for key in _REQUIRED if key not in raw]
    if missing:
        raise _fail(source, name, f"missing {missing}; add them to the task or to the file's defaults")
    if (raw.get("generator") is None) == (raw.get("loader") is None):
        raise _fail(source, name, "set exactly one of `generator:` (synthetic) or `loader:` (local JSONL file)")
    if raw.get("loader") is not None and not raw.get("data_file"):
        raise _fail(source, name, "a loader task needs `data_file:` (path relative to the data directory)")
    lengths = raw["lengths"]
    if not isinstance(lengths, list) or not lengths or not all(isinstance(n, int) and n > 0 for n in lengths):
        raise _fail(source, name, f"lengths must be a non-empty list of positive token counts, got {lengths!r}")
    max_new = raw["max_new_tokens"]
    if not isinstance(max_new, int) or max_new <= 0:
        raise _fail(source, name, f"max_new_tokens must be a positive int, got {max_new!r}")
    if max_new >= min(lengths):
        raise _fail(source, name, f"max_new_tokens {max_new} leaves no room for a prompt at length {min(lengths)}")
    if not isinstance(raw["template"], str) or "{" not in raw["template"]:
        raise _fail(source, name, "template must be a str.format string with at least one {field}")
    args = raw.get("args") or {}
    if not isinstance(args, Mapping):
        raise _fail(source, name, f"args must be a mapping, got {type(args).__name__}")
    if raw["scorer"] not in SCORERS:
        raise _fail(source, name, f"unknown scorer {raw['scorer']!r}; known: {sorted(SCORERS)}")
    return TaskSpec(
        name=name,
        suite=suite,
        generator=raw.get("generator"),
        loader=raw.get("loader"),
        lengths=tuple(lengths),
        seed=int(raw.get("seed", 0)),
        template=raw["template"],
        answer_prefix=str(raw.get("answer_prefix", "")),
        max_new_tokens=max_new,
        scorer=raw["scorer"],
        version=int(raw["version"]),
        data_file=raw.get("data_file"),
        first_line_only=bool(raw.get("first_line_only", False)),
        args=MappingProxyType(dict(args)),
        source=str(source),
    )


def load_task_file(path: Path) -> dict[str, TaskSpec]:
    """Parse one suite YAML file into {task name: TaskSpec}."""
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise TaskSpecError(f"{path.name}: not valid YAML ({error}); fix the syntax") from error
    if not isinstance(data, Mapping) or "tasks" not in data or "suite" not in data:
        raise TaskSpecError(f"{path.name}: expected top-level keys `suite:` and `tasks:`")
    suite = data["suite"]
    if suite not in SUITES:
        raise TaskSpecError(f"{path.name}: unknown suite {suite!r}; use one of {SUITES}")
    defaults = data.get("defaults") or {}
    specs = {}
    for name, raw in (data["tasks"] or {}).items():
        if not isinstance(raw, Mapping):
            raise _fail(path, name, "a task entry must be a mapping of keys")
        specs[name] = _build(path, suite, name, {**defaults, **raw})
    return specs


@lru_cache(maxsize=1)
def _all_tasks() -> MappingProxyType:
    specs: dict[str, TaskSpec] = {}
    for path in sorted(TASKS_DIR.glob("*.yaml")):
        for name, spec in load_task_file(path).items():
            if name in specs:
                raise TaskSpecError(f"task {name!r} is defined in both {Path(specs[name].source).name} and {path.name}")
            specs[name] = spec
    return MappingProxyType(specs)


def list_tasks(suite: str | None = None) -> list[str]:
    """Names of the packaged tasks, optionally of one suite, sorted."""
    if suite is not None and suite not in SUITES:
        raise TaskSpecError(f"unknown suite {suite!r}; use one of {SUITES}")
    return sorted(name for name, spec in _all_tasks().items() if suite is None or spec.suite == suite)


def load_task(name: str) -> TaskSpec:
    """The packaged task called `name` (e.g. `niah_single_1`, `longbench_hotpotqa`)."""
    tasks = _all_tasks()
    if name not in tasks:
        raise TaskSpecError(f"unknown task {name!r}; known tasks: {', '.join(sorted(tasks))}")
    return tasks[name]
