"""The quality run: tasks x lengths x instances x (arm, budget) cells -> one `locks.eval/1` record each.

    config = EvalConfig(suite="ruler", tasks=("niah_single_1",), lengths=(4096,), samples=3,
                        budgets=(64, 128), arms=parse_arms(["fullkv", "locks:r8i4"]), model="gemma3-270m",
                        out=Path("runs/eval.jsonl"))
    run_eval(config, engine, on_progress)

Dense arms (fullkv) run once per instance (budget null); sparse arms once per budget. Cells already
stored with a final status are skipped, so an interrupted run resumes where it stopped. Each record
carries `fullkv_correct` (did FullKV solve this instance?) so a table can be restricted to the
instances the model itself can do.
"""

from __future__ import annotations

import concurrent.futures
import logging
import multiprocessing
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol

import yaml

from ..harness import provenance as prov
from ..harness.record_schemas import EVAL
from ..harness.store import append_record, cell_key, finished_keys, read_records
from ..kernels.config import ConfigError, SelectionConfig
from . import catalog
from .arms import Arm, parse_arms
from .engine_hf import Generation, StopRule, Stops, load_engine
from .instances import Instance
from .length_fit import LengthError
from .task_spec import SUITES, TaskSpec, list_tasks, load_task

logger = logging.getLogger(__name__)

SCHEMA = EVAL
DEFAULT_BUDGETS = (64, 128, 256, 512, 1024, 2048)
_MAX_NEW_TOKENS_ROOM = 1024  # tokens past the longest context a vLLM engine is sized for (generation, template)
ENGINES = ("transformers", "vllm")
_LENGTH_RE = re.compile(r"^(?P<n>\d+)(?P<unit>[kK]?)$")


class EvalConfigError(ValueError):
    """A run setting is invalid (unknown task, bad budget or length); the message names the fix."""


@dataclass(frozen=True)
class Request:
    """One decode of an instance: an arm and its budget (None for dense arms)."""

    arm: Arm
    budget_tokens: int | None


@dataclass(frozen=True)
class EvalConfig:
    """Everything one `locks eval run` does; validated at construction."""

    suite: str
    tasks: tuple[str, ...]
    lengths: tuple[int, ...]
    samples: int
    budgets: tuple[int, ...]
    arms: tuple[Arm, ...]
    model: str
    out: Path
    seed: int | None = None  # None: each task's YAML seed
    data_dir: Path = Path("data")
    max_new_tokens: int | None = None  # cap on the task's max_new_tokens (CPU runs); None = the task's
    stop_at_newline: bool = True
    combine: str = "share_average"
    engine: str = "transformers"
    dummy_weights: bool = False  # vLLM only: random weights, a plumbing check (recorded)
    skip_unfit: bool = False  # run the (task, length) pairs that fit and log the others, instead of stopping
    # Instances per (task, length) in each round of the run: every pair's first `round_size` instances go before
    # any pair's next ones, so a run cut short (a lease's end) holds about the same count in every cell.
    round_size: int = 10
    gpu_memory: float | None = None  # vLLM only: the engine's gpu_memory_utilization (None: the engine's default)

    def __post_init__(self) -> None:
        if self.suite not in SUITES:
            raise EvalConfigError(f"unknown suite {self.suite!r}; use one of {', '.join(SUITES)}")
        known = list_tasks(self.suite)
        unknown = [task for task in self.tasks if task not in known]
        if unknown or not self.tasks:
            raise EvalConfigError(f"unknown {self.suite} task(s) {unknown or '(none given)'}; known: {', '.join(known)}")
        if self.samples < 1:
            raise EvalConfigError(f"samples must be >= 1 (got {self.samples})")
        if self.round_size < 1:
            raise EvalConfigError(f"round_size must be >= 1 instances per (task, length) (got {self.round_size})")
        if self.gpu_memory is not None and not 0.0 < self.gpu_memory <= 1.0:
            raise EvalConfigError(f"gpu_memory is vLLM's fraction of GPU memory, in (0, 1] (got {self.gpu_memory}); "
                                  "pass e.g. --gpu-memory 0.6")  # fmt: skip
        if not self.lengths or any(n <= 0 for n in self.lengths):
            raise EvalConfigError(f"lengths must be positive token counts (got {self.lengths}); pass e.g. 4k,8k")
        if self.engine not in ENGINES:
            raise EvalConfigError(f"unknown engine {self.engine!r}; use one of {', '.join(ENGINES)}")
        if self.engine == "vllm":  # every arm now, not when its group comes up after others already ran
            from .engine_vllm import check_backend_arms

            try:
                check_backend_arms(self.arms)
            except ValueError as error:
                raise EvalConfigError(str(error)) from None
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise EvalConfigError(f"max_new_tokens must be >= 1 (got {self.max_new_tokens})")
        for task in self.tasks:
            spec = load_task(task)
            generated = min(spec.max_new_tokens, self.max_new_tokens or spec.max_new_tokens)
            short = [n for n in self.lengths if n <= generated]
            if short:
                raise EvalConfigError(
                    f"task {task} generates up to {generated} tokens, so a context of {short[0]} tokens leaves no room "
                    f"for its prompt; pass --lengths {','.join(map(str, spec.lengths))} (the task's own) or "
                    f"--max-new-tokens below {short[0]}")
        for budget in self.budgets:
            try:
                SelectionConfig(budget_tokens=budget, combine=self.combine)
            except ConfigError as error:
                raise EvalConfigError(str(error)) from None
        if any(arm.sparse for arm in self.arms) and not self.budgets:
            raise EvalConfigError("sparse arms need budgets; pass e.g. --budgets 64,128,256,512")

    def requests(self) -> tuple[Request, ...]:
        """Dense arms first (their score decides fullkv_correct), then each sparse arm per budget."""
        dense = [Request(arm, None) for arm in self.arms if not arm.sparse]
        sparse = [Request(arm, budget) for arm in self.arms if arm.sparse for budget in self.budgets]
        return tuple(dense + sparse)


def _split(value: str | Iterable[Any]) -> list[str]:
    """A comma string or a YAML list -> its items as stripped strings (blanks kept)."""
    items = value.split(",") if isinstance(value, str) else list(value)
    return [str(item).strip() for item in items]


def parse_lengths(text: str | Iterable[Any]) -> tuple[int, ...]:
    """`4k,8k` / `4096` / [4096, "8k"] -> (4096, 8192): k = 1024 tokens."""
    lengths = []
    for item in _split(text):
        match = _LENGTH_RE.match(item)
        if match is None:
            raise EvalConfigError(f"length {item!r} is not a token count; pass e.g. 4k,8k or 4096,8192")
        lengths.append(int(match["n"]) * (1024 if match["unit"] else 1))
    return tuple(lengths)


def parse_ints(text: str | Iterable[Any], what: str) -> tuple[int, ...]:
    try:
        return tuple(int(item) for item in _split(text) if item)
    except ValueError:
        raise EvalConfigError(f"{what} must be comma-separated integers (got {text!r}); pass e.g. 64,128,256") from None


def config_from_mapping(raw: Mapping[str, Any], source: str = "config") -> EvalConfig:
    """An EvalConfig from a YAML mapping / CLI values (keys as the CLI options, lists or comma strings)."""
    known = {"suite", "tasks", "lengths", "samples", "budgets", "arms", "model", "out", "seed", "data_dir",
             "max_new_tokens", "stop_at_newline", "combine", "engine", "dummy_weights", "skip_unfit", "round_size",
             "gpu_memory"}  # fmt: skip
    unknown = sorted(set(raw) - known)
    if unknown:
        raise EvalConfigError(f"{source}: unknown keys {unknown}; allowed: {sorted(known)}")
    missing = [key for key in ("suite", "tasks", "lengths", "arms", "model", "out") if raw.get(key) in (None, "", [])]
    if missing:
        raise EvalConfigError(f"{source}: missing {missing}")

    def names(value: Any) -> tuple[str, ...]:
        return tuple(item for item in _split(value) if item)

    try:
        arms = parse_arms(names(raw["arms"]))
    except ValueError as error:
        raise EvalConfigError(str(error)) from None
    optional = {key: raw[key] for key in ("seed", "max_new_tokens", "stop_at_newline", "combine", "engine", "dummy_weights",
                                          "skip_unfit", "round_size", "gpu_memory") if raw.get(key) is not None}  # fmt: skip
    return EvalConfig(
        suite=str(raw["suite"]),
        tasks=names(raw["tasks"]),
        lengths=parse_lengths(raw["lengths"]),
        samples=int(raw["samples"]) if raw.get("samples") is not None else 1,
        budgets=parse_ints(raw.get("budgets") or "", "budgets"),
        arms=arms,
        model=str(raw["model"]),
        out=Path(raw["out"]),
        data_dir=Path(raw.get("data_dir") or "data"),
        **optional,
    )


def load_config_file(path: Path, overrides: Mapping[str, Any] | None = None) -> EvalConfig:
    """A YAML run file (keys as `config_from_mapping`), with CLI overrides on top."""
    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as error:
        raise EvalConfigError(f"cannot read run file {path}: {error}") from None
    if not isinstance(raw, Mapping):
        raise EvalConfigError(f"{path}: expected a mapping of run settings at the top level")
    return config_from_mapping({**raw, **{k: v for k, v in (overrides or {}).items() if v is not None}}, str(path))


class Engine(Protocol):
    """What the runner needs from an evaluation engine (transformers or vLLM)."""

    name: str  # "transformers" | "vllm"
    model_name: str
    source: str

    def count_tokens(self, text: str) -> int: ...

    def run(self, instances: Sequence[Instance], requests: Mapping[str, Sequence[Request]],
            stops: Stops) -> Iterator[tuple[Instance, Request, Generation, float]]:  # fmt: skip
        """Decode every instance under its pending requests (keyed by instance_id) and stop rule (one, or one per
        instance_id); yields (instance, request, generation, prefill seconds) as each decode finishes."""


def make_cell(config: EvalConfig, spec: TaskSpec, length: int, instance: Instance, request: Request) -> dict:
    arm = request.arm
    return {
        "suite": spec.suite,
        "task": spec.name,
        "arm": arm.name,
        "format": arm.fmt.name if arm.fmt is not None else None,
        "budget_tokens": request.budget_tokens,
        "context_tokens": length,
        "record_id": instance.instance_id,
        "model": config.model,
    }


@dataclass
class Progress:
    """Counts the runner reports after each cell (the CLI turns them into a bar with ETA)."""

    total: int
    done: int = 0
    skipped: int = 0
    errors: int = 0
    last: str = ""
    started: float = field(default_factory=time.perf_counter)


def _stop_rule(config: EvalConfig, spec: TaskSpec) -> StopRule:
    limit = spec.max_new_tokens if config.max_new_tokens is None else min(spec.max_new_tokens, config.max_new_tokens)
    return StopRule(max_new_tokens=limit, newline=config.stop_at_newline)


def plan_instances(config: EvalConfig, count_tokens: Callable[[str], int],
                   workers: int | None = None) -> list[tuple[TaskSpec, int, list[Instance]]]:  # fmt: skip
    """(task, length, instances) groups; the catalog raises clear errors for missing data files.

    Fitting prompts to lengths tokenizes every candidate prompt (minutes for a full RULER grid), so the
    groups are planned in `workers` forked processes (default: one per core, at most one per group); the
    instances are the same as in one process. A task whose fixed text does not fit a length with this
    tokenizer (a one-shot example, a question's gold documents) stops the run with every such pair named,
    before anything runs, unless `skip_unfit`: then those pairs are logged and left out, and the rest runs."""
    pairs = [(task, length) for task in config.tasks for length in config.lengths]
    workers = min(workers or os.cpu_count() or 1, len(pairs))
    started = time.perf_counter()
    if workers > 1 and "fork" in multiprocessing.get_all_start_methods():
        _PLANNING[0] = (config, count_tokens)  # inherited by the forked workers
        try:
            with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
                planned = list(pool.map(_plan_pair, pairs))
        finally:
            _PLANNING[0] = None
    else:
        planned = [_plan_group(config, count_tokens, task, length) for task, length in pairs]
    groups = [group for group in planned if not isinstance(group, str)]
    unfit = [group for group in planned if isinstance(group, str)]
    if unfit and not config.skip_unfit:
        raise LengthError("; ".join(unfit) + ". Drop those tasks or lengths, or pass --skip-unfit to run the rest")
    for reason in unfit:
        logger.warning("left out: %s", reason)
    logger.info("planned %d instances of %d (task, length) pairs in %.1f s (%d process%s)",
                sum(len(g[2]) for g in groups), len(pairs), time.perf_counter() - started, workers,
                "es" if workers > 1 else "")  # fmt: skip
    return groups


_PLANNING: list[tuple[EvalConfig, Callable[[str], int]] | None] = [None]  # what forked planners plan
# Specs and instances hold read-only mappings; planners send them back to the parent as plain dicts.
ForkingPickler.register(MappingProxyType, lambda proxy: (_read_only, (dict(proxy),)))


def _read_only(mapping: dict[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(mapping)


def _plan_pair(pair: tuple[str, int]) -> tuple[TaskSpec, int, list[Instance]] | str:
    config, count_tokens = _PLANNING[0]
    return _plan_group(config, count_tokens, *pair)


def _plan_group(config: EvalConfig, count_tokens: Callable[[str], int], task: str,
                length: int) -> tuple[TaskSpec, int, list[Instance]] | str:  # fmt: skip
    """One (task, length) group, or the reason it does not fit."""
    spec = load_task(task)
    try:
        return spec, length, list(catalog.iter_instances(spec, length, config.samples, count_tokens, config.seed,
                                                         data_dir=config.data_dir))  # fmt: skip
    except LengthError as error:
        return str(error)


def load_eval_engine(config: EvalConfig) -> Engine:
    """The engine `config.engine` names, loaded for `config.model` (minutes on CPU; vLLM imported only when named)."""
    if config.engine == "vllm":
        from .engine_vllm import load_vllm_engine, position_limit
        from .model_source import resolve_model_source, vllm_model_dir

        source = resolve_model_source(config.model)
        model = config.model if source.kind == "preset" else str(vllm_model_dir(source))
        limit = None if source.kind == "preset" else position_limit(model)
        if limit is not None and max(config.lengths) > limit:
            raise EvalConfigError(f"length {max(config.lengths)} is past the {limit} positions {config.model} holds; "
                                  f"pass --lengths up to {limit}")  # fmt: skip
        # One engine for every (task, length) group of the run: sized once for the longest context.
        return load_vllm_engine(model, combine=config.combine, dummy_weights=config.dummy_weights,
                                max_model_len=max(config.lengths) + _MAX_NEW_TOKENS_ROOM, gpu_memory=config.gpu_memory)
    return load_engine(config.model, combine=config.combine)


def check_model(config: EvalConfig) -> None:
    """Fail fast (before data or weights are read) when `config.model` names nothing the engine loads."""
    from .model_source import resolve_model_source

    try:
        source = resolve_model_source(config.model)
    except ValueError as error:
        raise EvalConfigError(str(error)) from None
    if config.engine == "transformers" and not source.real_weights:
        raise EvalConfigError(f"preset {config.model} has dummy weights only, which the transformers engine does not "
                              "load; use --engine vllm or a model with weights (gemma3-270m, a .gguf file, a folder)")


def check_data_files(config: EvalConfig) -> None:
    """Fail fast (before loading a model) when a file-backed task's JSONL file is missing or malformed."""
    for task in config.tasks:
        spec = load_task(task)
        if not spec.synthetic:
            next(iter(catalog.iter_instances(spec, max(config.lengths), 1, seed=config.seed, data_dir=config.data_dir)), None)


def run_eval(config: EvalConfig, engine: Engine, on_progress: Callable[[Progress], None] | None = None,
             command: str | None = None) -> Progress:  # fmt: skip
    """Run every pending cell of `config` with `engine`, appending records to `config.out`."""
    command = command if command is not None else prov.reproduce_command()
    provenance = prov.collect(command)
    provenance["schema_version"] = SCHEMA
    stored = read_records(config.out)
    done_keys = finished_keys(stored)
    fullkv_scores = {
        (r["cell"]["task"], r["cell"]["context_tokens"], r["cell"]["record_id"]): r.get("score")
        for r in stored
        if r.get("status") == "ok" and r.get("cell", {}).get("arm") == "fullkv" and r["cell"].get("model") == config.model
    }
    groups = plan_instances(config, engine.count_tokens)
    requests = config.requests()
    work = []
    total = skipped = 0
    for spec, length, instances in groups:
        pending: dict[str, list[Request]] = {}
        for instance in instances:
            todo = [r for r in requests if cell_key(make_cell(config, spec, length, instance, r)) not in done_keys]
            skipped += len(requests) - len(todo)
            if todo:
                pending[instance.instance_id] = todo
                total += len(todo)
        work.append((spec, length, [(n, i) for n, i in enumerate(instances) if i.instance_id in pending], pending))
    progress = Progress(total=total, skipped=skipped)
    logger.info("%d cells to run, %d already stored in %s", total, skipped, config.out)
    if on_progress:
        on_progress(progress)
    # One engine call for the whole run, in rounds (`round_size`): a batching engine runs every task and length
    # side by side, and the records of a run cut short are spread evenly over its cells.
    batch = sorted(((n // config.round_size, length, t, n, spec, instance)  # n: the instance's index in its pair
                    for t, (spec, length, instances, _) in enumerate(work) for n, instance in instances),
                   key=lambda item: item[:4])  # fmt: skip
    where = {instance.instance_id: (spec, length) for _, length, _, _, spec, instance in batch}
    pending = {key: todo for _, _, _, group in work for key, todo in group.items()}
    stops = {key: _stop_rule(config, spec) for key, (spec, _) in where.items()}
    if batch:
        for instance, request, generation, prefill_seconds in engine.run([item[5] for item in batch], pending, stops):
            spec, length = where[instance.instance_id]
            record = _record(config, spec, length, instance, request, generation, prefill_seconds, engine)
            record.update(provenance=provenance, command=command)
            key = (spec.name, length, instance.instance_id)
            if not request.arm.sparse and request.arm.name == "fullkv":
                fullkv_scores[key] = record["score"]
            fullkv = fullkv_scores.get(key)
            record["fullkv_correct"] = None if fullkv is None else bool(fullkv >= 1.0)
            append_record(config.out, record)
            progress.done += 1
            progress.last = f"{spec.name} {length} {request.arm.label} b={request.budget_tokens} score={record['score']}"
            if on_progress:
                on_progress(progress)
    return progress


def _record(config: EvalConfig, spec: TaskSpec, length: int, instance: Instance, request: Request,
            generation: Generation, prefill_seconds: float, engine: Engine) -> dict:  # fmt: skip
    return {
        "schema": SCHEMA,
        "kind": "eval",
        "cell": make_cell(config, spec, length, instance, request),
        "status": "ok",
        "reason": "",
        "score": catalog.score(spec, generation.text, instance.answers, instance.meta),
        "generation": generation.text,
        "reference": "; ".join(instance.answers),
        "answers": list(instance.answers),
        "engine": engine.name,
        "selection": getattr(engine, "selection", None),
        "dummy_weights": config.dummy_weights,
        "model_source": engine.source,
        "combine": config.combine,
        "prompt_tokens": instance.meta.get("prompt_tokens"),
        "generated_tokens": len(generation.token_ids),
        "max_new_tokens": _stop_rule(config, spec).max_new_tokens,
        "stop_reason": generation.stop_reason,
        "prefill_s": round(prefill_seconds, 3),
        "decode_s": round(generation.seconds, 3),
        "pages_built": generation.pages_built,
    }


def summary_table(records: Iterable[dict], config: EvalConfig | None = None) -> str:
    """Markdown: mean score (n) per (task, context, budget) row x arm column, `ok` records only."""
    cells: dict[tuple, dict[str, list[float]]] = {}
    arms: list[str] = []
    for record in records:
        cell = record.get("cell") or {}
        if record.get("schema") != SCHEMA or record.get("status") != "ok":
            continue
        if config is not None and (cell.get("task") not in config.tasks or cell.get("model") != config.model
                                   or cell.get("context_tokens") not in config.lengths):  # fmt: skip
            continue
        label = cell["arm"] if not cell.get("format") else f"{cell['arm']}:{cell['format']}"
        if label not in arms:
            arms.append(label)
        budget = cell.get("budget_tokens")
        row = (cell["task"], cell["context_tokens"], "dense" if budget is None else budget)
        cells.setdefault(row, {}).setdefault(label, []).append(float(record["score"]))
    dense_arms = [a for a in arms if any(a in v for k, v in cells.items() if k[2] == "dense")]
    sparse_arms = [a for a in arms if a not in dense_arms]
    lines = ["| task | context | budget | " + " | ".join(dense_arms + sparse_arms) + " |",
             "|---|---:|---:|" + "---:|" * len(dense_arms + sparse_arms)]  # fmt: skip
    tasks = sorted({(k[0], k[1]) for k in cells})
    for task, context in tasks:
        dense = {a: cells.get((task, context, "dense"), {}).get(a, []) for a in dense_arms}
        budgets = sorted(b for (t, c, b) in cells if t == task and c == context and b != "dense")
        for budget in budgets or ["dense"]:
            row = cells.get((task, context, budget), {})
            values = [_mean(dense[a]) for a in dense_arms] + [_mean(row.get(a, [])) for a in sparse_arms]
            lines.append(f"| {task} | {context} | {budget} | " + " | ".join(values) + " |")
    return "\n".join(lines)


def _mean(scores: list[float]) -> str:
    return f"{sum(scores) / len(scores):.2f} (n={len(scores)})" if scores else "—"
