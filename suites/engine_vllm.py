"""Engine (b): vLLM with the Locks attention backend, every arm and budget in one engine.

One `LLM` per summary format serves every request of a run: the Locks backend with per-request selection
(`kernels/vllm_backend/request_settings.py`) and prefix caching. FullKV is `{"scorer": "dense"}` (stock
attention inside the same engine), each sparse arm `{"scorer", "budget"}`; the engine's own budget is the
largest of the run. Each instance's prompt is prefilled once (its first request), then every other
request of that instance reads its pages (and their summaries) from the prefix cache. Such an engine runs
eager; greedy decoding (temperature 0). With `dummy_weights` the weights are random (`load_format="dummy"`):
the records then test the plumbing only, and say so.

On a machine without CUDA the engine is vLLM's CPU platform with the Locks CPU backend (tests and CI).
`model` is a local model folder (its tokenizer is used) or a harness preset name (`tiny-llama`,
`qwen3-4b`, ...: harness/presets): a preset has a config only, so it runs with dummy weights and a
byte-level stand-in tokenizer, and needs no download at all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib
import json
import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from .engine_hf import Generation, StopRule, Stops, stop_for

logger = logging.getLogger(__name__)

# Scorers the backend serves in one engine (kernels/vllm_backend/settings.py BACKEND_SCORERS).
_BACKEND_SCORERS = ("locks", "oracle", "quest", "centroid")


# How every record of this engine selected its pages (stored in each record's `selection`).
SELECTION = "per-request: one engine per summary format, prefix caching, eager"

# Tokens an engine is sized past its longest request when the model allows it.
_SLACK_TOKENS = 16


class VllmUnavailableError(RuntimeError):
    """vLLM is missing; the message says what to install."""


def require_vllm() -> Any:
    """The vllm module, or one clear error naming the install command."""
    try:
        return importlib.import_module("vllm")
    except ImportError as error:
        raise VllmUnavailableError(f"vLLM is not installed ({error}); install with: pip install 'locks-toolkit[gpu]'") from None


def check_backend_arms(arms: Sequence[Any]) -> None:
    """Raise one ValueError naming the first sparse arm the backend does not serve (checked before any run)."""
    for arm in arms:
        if arm.sparse and arm.scorer not in _BACKEND_SCORERS:
            raise ValueError(f"arm {arm.label} is not served by the vLLM backend; use one of {', '.join(_BACKEND_SCORERS)} "
                             "or --engine transformers")  # fmt: skip


def request_settings(request: Any) -> dict:
    """The `SamplingParams.extra_args` that select `request`'s arm and budget in a per-request engine."""
    arm = request.arm
    if not arm.sparse:
        return {"locks": {"scorer": "dense"}}
    return {"locks": {"scorer": arm.scorer, "budget": request.budget_tokens}}


class ByteTokenizer:
    """Stand-in tokenizer for config-only (dummy-weight) models: one token per UTF-8 byte, id = 16 + byte."""

    offset = 16
    newline_id = offset + ord("\n")

    def encode(self, text: str) -> list[int]:
        return [self.offset + byte for byte in text.encode()]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i - self.offset for i in ids if self.offset <= i < self.offset + 256).decode(errors="replace")


class VllmEngine:
    """Batch greedy generation of every (arm, budget) request in one per-request Locks engine."""

    name = "vllm"

    def __init__(self, model: str, combine: str = "share_average", dummy_weights: bool = False,
                 max_model_len: int | None = None, gpu_memory_utilization: float = 0.85,
                 device: str | None = None) -> None:  # fmt: skip
        import torch

        from ..harness.presets import preset_names

        self.vllm = require_vllm()
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.preset = model in preset_names()
        self.model_name = model
        self.combine = combine
        self.dummy_weights = dummy_weights or self.preset
        self.max_model_len = max_model_len
        self.gpu_memory_utilization = gpu_memory_utilization
        if self.preset:
            self.tokenizer: Any = ByteTokenizer()
        else:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(model)
        note = ", dummy weights: plumbing only" if self.dummy_weights else ""
        note += ", byte tokenizer" if self.preset else ""
        note += ", CPU platform" if self.device == "cpu" else ""
        self.source = f"{model} (vllm {self.vllm.__version__}{note})"
        self.selection = SELECTION
        self._llm: tuple[str, int, Any] | None = None  # (summary format, max_model_len, engine) kept across calls

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text))

    def _llm_kwargs(self, summary_format: str, budget: int, max_len: int) -> tuple[dict, dict[str, str]]:
        """(LLM kwargs, environment of the engine's processes) of one per-request Locks engine: `budget` is its
        own (the largest of the run), `summary_format` its summaries'."""
        from ..harness.arms import SparseKnobs, get_arm
        from ..kernels.vllm_backend.settings import REQUEST_SETTINGS_PROCESSOR

        arm = get_arm("locks-cpu" if self.device == "cpu" else "locks")
        knobs = SparseKnobs(budget, summary_format=summary_format, combine=self.combine)
        kwargs: dict[str, Any] = {
            "model": self.model_name,
            "max_model_len": max_len,
            "block_size": 16,
            "seed": 0,
            "enable_prefix_caching": True,
            "enforce_eager": True,
            "logits_processors": [REQUEST_SETTINGS_PROCESSOR],
            **arm.engine_kwargs(knobs),
        }
        if self.device == "cpu":
            kwargs["dtype"] = "float32"
        else:
            kwargs["gpu_memory_utilization"] = self.gpu_memory_utilization
        if self.dummy_weights:
            kwargs["load_format"] = "dummy"
        if self.preset:
            from ..harness.presets import build_config, materialize_model

            kwargs["model"] = str(materialize_model(build_config(self.model_name, None, max_len)[0]))
            kwargs["skip_tokenizer_init"] = True
        return kwargs, arm.environment(knobs, None)

    def _sampling(self, stop: StopRule, request: Any) -> Any:
        if self.preset:  # no detokenizer in the engine: stop on the newline byte's id
            ending: dict[str, Any] = {"detokenize": False}
            if stop.newline:
                ending["stop_token_ids"] = [ByteTokenizer.newline_id]
        else:
            ending = {"stop": ["\n"] if stop.newline else None}
        return self.vllm.SamplingParams(temperature=0.0, max_tokens=stop.max_new_tokens,
                                        extra_args=request_settings(request), **ending)

    def run(self, instances: Sequence[Any], requests: Mapping[str, Sequence[Any]],
            stops: Stops) -> Iterator[tuple[Any, Any, Generation, float]]:  # fmt: skip
        """Every pending (instance, request) through one engine per summary format, each prompt prefilled once.

        Hand it every instance of a run at once: on the H200 a per-request decode step of 120 rows cost about the
        same at 4K as at 32K, a fixed cost per step that more rows share, so the engine is kept full (`_stream`)
        from the first cell to the last."""
        check_backend_arms([r.arm for rs in requests.values() for r in rs])
        by_format: dict[str, list[tuple[Any, Any]]] = {}
        for instance in instances:
            for request in requests[instance.instance_id]:
                fmt = request.arm.fmt.name if request.arm.fmt is not None else None
                by_format.setdefault(fmt, []).append((instance, request))
        # Dense and key-reading requests read no summaries: they join the first format's engine.
        formatless = by_format.pop(None, [])
        groups = list(by_format.items()) or [("r8i4", [])]
        groups[0] = (groups[0][0], formatless + groups[0][1])
        budgets = [r.budget_tokens for rs in requests.values() for r in rs if r.budget_tokens is not None]
        order = {instance.instance_id: n for n, instance in enumerate(instances)}
        # once per instance for every engine, not per cell: a 32K prompt takes ~30 ms to tokenize, a grid has 25
        # cells an instance
        ids = prompt_ids([i for i in instances if requests.get(i.instance_id)], self.tokenizer)
        for fmt, cells in groups:
            if not cells:
                continue
            cells.sort(key=lambda cell: order[cell[0].instance_id])  # stable: an instance's requests together
            need = max(len(ids[i.instance_id]) + stop_for(stops, i.instance_id).max_new_tokens for i, _ in cells)
            llm = self._llm_for(fmt, max(budgets, default=2048), need)
            yield from self._stream(llm, cells, ids, stops, _window(llm))

    def _engine_length(self, need: int) -> int:
        """The max_model_len of an engine whose longest request needs `need` tokens: the run's size or a little
        slack over `need` (`engine_length`)."""
        size = max(need + _SLACK_TOKENS, self.max_model_len or 0)
        return size if self.preset else engine_length(need, size, self.model_name)

    def _llm_for(self, summary_format: str, budget: int, need: int) -> Any:
        """The engine of `summary_format`, kept across calls (a run's task x length groups share it) while its
        context fits; a new format or a longer context starts a new one in its place."""
        if self._llm is not None:
            fmt, length, llm = self._llm
            if fmt == summary_format and length >= need:
                return llm
            self.close()
        max_len = self._engine_length(need)
        spawn_engine_processes()
        kwargs, env = self._llm_kwargs(summary_format, budget, max_len)
        with _environment(env):  # read by the engine's processes as they start
            llm = self.vllm.LLM(**kwargs)
        self._llm = (summary_format, kwargs["max_model_len"], llm)
        return llm

    def close(self) -> None:
        """Shut the kept engine down and free its memory."""
        if self._llm is not None:
            llm = self._llm[2]
            self._llm = None
            engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
            if engine_core is not None and hasattr(engine_core, "shutdown"):
                engine_core.shutdown()
            del llm
            _free_gpu()

    def _stream(self, llm: Any, cells: list[tuple[Any, Any]], ids: Mapping[str, list[int]], stops: Stops,
                window: StreamWindow) -> Iterator[tuple[Any, Any, Generation, float]]:  # fmt: skip
        """`cells` (an instance's requests together) through one engine that is never left to drain.

        An instance opens with its first request alone, which prefills the prompt; when that one finishes, its
        other requests go in and read the prompt's pages from the prefix cache. New instances open while the
        open ones stay within `window`, so prefills of the next instances run beside the decodes of the
        earlier ones, and only the run's last requests decode in a batch that empties.
        A record's seconds are the engine's wall time shared by the requests that finished in each step."""
        from vllm.inputs import TokensPrompt

        queue: list[tuple[Any, list[Any]]] = []
        for instance, request in cells:
            if queue and queue[-1][0].instance_id == instance.instance_id:
                queue[-1][1].append(request)
            else:
                queue.append((instance, [request]))
        queue.reverse()  # pop() takes the next instance
        running: dict[str, tuple[Any, Any]] = {}  # vLLM request id -> (instance, request)
        later: dict[str, list[Any]] = {}  # instance id -> its requests that wait for the prompt to be cached
        left: dict[str, int] = {}  # instance id -> its requests not finished yet
        held = 0  # prompt tokens of the open instances
        rows = 0  # requests of the open instances not finished yet

        engine, waited = llm.llm_engine, 0.0
        pace = StreamPace()

        def submit(instance: Any, batch: Sequence[Any]) -> None:
            stop = stop_for(stops, instance.instance_id)
            # the prompt's token ids, not its text: vLLM would tokenize it again for every arm and budget
            prompts = [TokensPrompt(prompt_token_ids=ids[instance.instance_id]) for _ in batch]
            added = llm.enqueue(prompts, [self._sampling(stop, request) for request in batch], use_tqdm=False)
            for request_id, request in zip(added, batch):
                # enqueue returns vLLM's internal id, "<the LLM's counter>-<8 random characters>"; outputs carry
                # the counter alone
                running[request_id.split("-", 1)[0]] = (instance, request)

        while queue or running:
            while queue and (not left or window.admits(held + len(ids[queue[-1][0].instance_id]), rows)):
                instance, batch = queue.pop()
                key = instance.instance_id
                held += len(ids[key])
                rows += len(batch)
                left[key], later[key] = len(batch), batch[1:]
                submit(instance, batch[:1])
            start = time.perf_counter()
            finished = [output for output in engine.step() if output.finished]
            seconds = time.perf_counter() - start
            waited += seconds
            for output in finished:
                if output.request_id not in running:
                    raise RuntimeError(f"vLLM finished request {output.request_id!r}, which this run did not send")
                instance, request = running.pop(output.request_id)
                key = instance.instance_id
                if later.get(key):
                    submit(instance, later.pop(key))
                left[key] -= 1
                rows -= 1
                if not left[key]:
                    del left[key]
                    held -= len(ids[key])
                generation = self._generation(output, waited / len(finished))
                pace.finished(len(generation.token_ids))
                yield instance, request, generation, 0.0
            if finished:
                waited = 0.0
            pace.step(seconds, open_instances=len(left), open_requests=rows)

    def _generation(self, output: Any, seconds: float) -> Generation:
        completion = output.outputs[0]
        token_ids = list(completion.token_ids)
        text = self.tokenizer.decode(token_ids) if self.preset else completion.text
        newline = completion.stop_reason in ("\n", ByteTokenizer.newline_id)
        reason = "max_new_tokens" if completion.finish_reason == "length" else ("newline" if newline else "eos")
        return Generation(token_ids, text, reason, seconds)


@dataclasses.dataclass
class StreamPace:
    """The stream's pace, logged once a `every` seconds of engine steps: cells and tokens a second, steps and
    their mean time, tokens per step (about the rows each step decodes) and what is open. It tells a run bound
    by a step's fixed cost (few tokens a step) from one bound by its rows."""

    every: float = 60.0
    steps: int = 0
    seconds: float = 0.0
    cells: int = 0
    tokens: int = 0

    def finished(self, tokens: int) -> None:
        self.cells, self.tokens = self.cells + 1, self.tokens + tokens

    def step(self, seconds: float, open_instances: int, open_requests: int) -> str | None:
        """Count one engine step; the line logged when `every` seconds have gathered (then start over)."""
        self.steps, self.seconds = self.steps + 1, self.seconds + seconds
        if self.seconds < self.every:
            return None
        line = (f"stream: {self.cells / self.seconds:.1f} cells/s, {self.tokens / self.seconds:.0f} tokens/s; "
                f"{self.steps} steps of {1e3 * self.seconds / self.steps:.1f} ms, {self.tokens / self.steps:.1f} "
                f"tokens a step; {open_instances} instances open, {open_requests} requests unfinished")  # fmt: skip
        logger.info("%s", line)
        self.steps, self.seconds, self.cells, self.tokens = 0, 0.0, 0, 0
        return line


@dataclasses.dataclass(frozen=True)
class StreamWindow:
    """How much of a run is open in the engine at once.

    tokens: prompt tokens of the open instances, at most (half the KV cache: an open prompt is never evicted
        before its requests have read it); None: no bound.
    rows: unfinished requests of the open instances below which the next instance opens (twice the engine's
        max_num_seqs: a full batch waits behind the running one). Without it a 10M-token H200 cache opened ~900
        instances at once, each with only its first request done when the lease ended.
    """

    tokens: int | None = None
    rows: int | None = None

    def admits(self, tokens: int, rows: int) -> bool:
        """Whether an instance that brings the open prompts to `tokens` opens beside `rows` unfinished requests."""
        return (self.tokens is None or tokens <= self.tokens) and (self.rows is None or rows < self.rows)


def _window(llm: Any) -> StreamWindow:
    """The stream window of an engine from its KV cache size and its scheduler's max_num_seqs."""
    held = _cache_tokens(llm)
    config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    seqs = getattr(getattr(config, "scheduler_config", None), "max_num_seqs", None)
    return StreamWindow(held // 2 if held else None, 2 * seqs if isinstance(seqs, int) and seqs > 0 else None)


def _cache_tokens(llm: Any) -> int | None:
    """Tokens the engine's KV cache holds (per layer group), None when the engine does not say."""
    engine = getattr(llm, "llm_engine", None)
    cache = getattr(getattr(engine, "vllm_config", None), "cache_config", None)
    blocks, size = getattr(cache, "num_gpu_blocks", None), getattr(cache, "block_size", None)
    return blocks * size if isinstance(blocks, int) and isinstance(size, int) and blocks > 0 else None


def spawn_engine_processes() -> None:
    """Start vLLM's engine processes by spawn unless the user chose otherwise.

    This process has touched CUDA before the engine starts (device checks, provenance), and a
    forked engine core then fails with "Cannot re-initialize CUDA in forked subprocess" (H200,
    2026-11-29); in-process engines instead keep each arm's memory until the next one starts.
    """
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")


def position_limit(model: str) -> int | None:
    """The model folder's `max_position_embeddings` (its text config's for multimodal configs), None if unknown."""
    path = Path(model) / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    value = config.get("max_position_embeddings", config.get("text_config", {}).get("max_position_embeddings"))
    return int(value) if value else None


def engine_length(need: int, size: int, model: str) -> int:
    """`size` (>= need) clamped to the positions `model`'s folder holds, since vLLM refuses a longer engine;
    one clear ValueError when even `need` (prompt + generation) does not fit."""
    limit = position_limit(model)
    if limit is None:
        return size
    if need > limit:
        raise ValueError(f"a request needs {need} tokens (prompt + generation) but {model} holds {limit} positions; "
                         "use shorter --lengths")  # fmt: skip
    return min(size, limit)


def prompt_ids(instances: Sequence[Any], tokenizer: Any) -> dict[str, list[int]]:
    """instance id -> its prompt's token ids: the instance's own when it has them, else its text tokenized, in
    one batch where the tokenizer is a fast (Rust) one, which encodes a batch on every core (2600 RULER prompts of
    4K-32K took 78 s one at a time on the H200 machine)."""
    ids = {i.instance_id: list(i.token_ids) for i in instances if getattr(i, "token_ids", None) is not None}
    texts = [i for i in instances if i.instance_id not in ids]
    if texts and getattr(tokenizer, "is_fast", False):
        encoded = tokenizer([i.prompt for i in texts], add_special_tokens=True)["input_ids"]
    else:
        encoded = [tokenizer.encode(i.prompt) for i in texts]
    ids.update((i.instance_id, list(e)) for i, e in zip(texts, encoded))
    return ids


@contextlib.contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _free_gpu() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def load_vllm_engine(model: str, combine: str = "share_average", dummy_weights: bool = False,
                     max_model_len: int | None = None, gpu_memory: float | None = None) -> VllmEngine:  # fmt: skip
    """The vLLM engine for a local model folder or a preset (weights random with dummy_weights); `gpu_memory` is
    its gpu_memory_utilization (None: 0.85), lower to share the GPU with another job."""
    return VllmEngine(model, combine=combine, dummy_weights=dummy_weights, max_model_len=max_model_len,
                      gpu_memory_utilization=0.85 if gpu_memory is None else gpu_memory)
