"""The decode plan: one frozen object holding every knob of a `locks bench decode` run.

Loaded from YAML (`harness/plans/default.yaml` unless a file is given), then CLI overrides, then
validated once; errors name the fix. `cells()` expands it into engine jobs and cells.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, fields, replace
from importlib import resources
from pathlib import Path

import yaml

from ..kernels.config import PAGE_SIZE, ConfigError, SelectionConfig, SummaryFormat
from ..kernels.vllm_backend.prefill_attention import MODES as PREFILL_ATTENTION_MODES
from .arms import get_arm, split_arm_list
from .presets import load_preset_config, preset_names, read_model_dir_config
from .workload import format_size, parse_size

log = logging.getLogger(__name__)

# name -> (vLLM compilation_config, enforce_eager); the same mode runs for every arm of a plan.
GRAPH_MODES: dict[str, tuple[dict, bool]] = {
    "full_decode_only": ({"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}, False),
    "eager": ({"mode": 0, "cudagraph_mode": "NONE"}, True),
    "compile": ({"cudagraph_mode": "FULL_AND_PIECEWISE"}, False),
}


BATCH_PREFILL_MODES = ("per_batch", "once")


@dataclass(frozen=True)
class DecodePlan:
    """All knobs of a decode ladder. Sizes are tokens; `max_model_len=None` means derived."""

    model: str = "glm-4-9b-chat-1m"  # preset name or a local HF model dir (real weights)
    arms: tuple[str, ...] = ("fa3", "flashinfer", "locks")
    contexts: tuple[int, ...] = (16384, 32768, 65536, 131072)
    batch_sizes: tuple[int, ...] = (1,)
    budgets: tuple[int, ...] = (2048,)
    summary_format: str = "r8i4"
    scorer: str = "locks"
    combine: str = "share_average"
    num_layers: int | None = None
    windows: int = 3
    steps_per_window: int = 64
    settle_steps: int = 2  # untimed decode steps between prefill and the first window
    ttft_repeats: int = 3
    ramp_min_steps: int = 16
    ramp_max_steps: int = 256
    ramp_clock_tolerance: float = 0.01
    graph_mode: str = "full_decode_only"
    # vLLM 0.24 turns async scheduling on by default (the host prepares step n+1 while the GPU runs step
    # n). Off, each step() returns its own token and TPOT includes every µs of per-step host work
    # (scheduler, metadata builders, graph launch): the earliest records' protocol. On: what a default
    # deployment runs; the decode loop then reads each token one call late.
    async_scheduling: bool = False
    max_model_len: int | None = None  # None: each context's engine gets that context + decode room
    # From this context on, a cell pays one prefill: the clock ramp decodes on the measured requests and
    # TTFT is that prefill alone (at 512K one prefill is ~3 min, at 1M ~11 min on an H200). None: never.
    single_prefill_from: int | None = 262144
    # Presets (dummy weights) only: let max_model_len pass the model's trained positions (a 1M rung needs 1M +
    # decode room on GLM-4-9B-Chat-1M's 1048576); positions past it cost the same time. Recorded in the cell.
    extend_positions: bool = False
    # "per_batch": every batch size gets its own prefill. "once": each engine prefills only the largest batch
    # that fits and measures the smaller ones on the first b of those requests (the rest aborted), largest
    # first, so a batch grid pays one prefill per engine; a smaller batch's requests carry the tokens decoded
    # by the cells before it (the record's `decoded_before_tokens`).
    batch_prefill: str = "per_batch"
    # "skip": prefill batches write the KV cache and skip their attention (kernels/vllm_backend/prefill_attention.py):
    # a 1M prefill then costs its GEMMs, not ~11 min of causal attention. Decode steps run untouched; the cells
    # carry no TTFT. Presets (dummy weights), tensor parallel 1, the FA3 / FlashInfer / Locks / CPU arms.
    prefill_attention: str = "exact"
    gpu_memory_utilization: float = 0.85
    kv_cache_memory_bytes: int | None = None
    max_num_batched_tokens: int = 16384
    dtype: str = "auto"
    seed: int = 0
    clock_sag_threshold: float = 0.25
    require_nvml: bool = False
    # The rate byte floors divide by. None: the engine's device copy bandwidth, measured at each engine boot
    # (harness/bandwidth.py), so a record's floors are its own card's; a number pins it (bytes/s).
    hbm_bytes_per_s: float | None = None
    output: str = "runs/bench.jsonl"
    model_cache_dir: str | None = None
    isolation: str = "process"  # "process" (one subprocess per engine) or "inline" (debugging)
    silence_timeout_s: float = 1200.0  # an engine process silent this long is killed; its cells become errors
    peer_config: str | None = None  # LOCKS_CONFIG value for the locks-kv peer
    tensor_parallel_size: int = 1  # vLLM TP: each of this many GPUs holds num_kv_heads / tp KV heads

    def __post_init__(self) -> None:
        for name in self.arms:
            get_arm(name)
        if not self.arms:
            raise ConfigError("no arms given; pass e.g. --arms fa3,flashinfer")
        if len(set(self.arms)) != len(self.arms):
            raise ConfigError(f"arms {','.join(self.arms)} repeat a name; give each arm once")
        if self.model not in preset_names():
            if not Path(self.model).is_dir():
                raise ConfigError(
                    f"model {self.model!r} is neither a preset ({', '.join(preset_names())}) nor a directory"
                )
            read_model_dir_config(self.model)  # raises when config.json is missing
        for budget in self.budgets:
            SelectionConfig(budget_tokens=budget)  # multiple of the page size, room for sink + recent
        SummaryFormat.parse(self.summary_format)
        if self.graph_mode not in GRAPH_MODES:
            raise ConfigError(f"graph mode {self.graph_mode!r} unknown; use one of {', '.join(GRAPH_MODES)}")
        cpu_arms = [name for name in self.arms if get_arm(name).device == "cpu"]
        if self.async_scheduling and cpu_arms:
            raise ConfigError(f"arms {', '.join(cpu_arms)} run on vLLM's CPU platform, which always schedules "
                              "synchronously; drop --async-scheduling (async_scheduling: false) for them")
        if self.batch_prefill not in BATCH_PREFILL_MODES:
            raise ConfigError(f"batch_prefill {self.batch_prefill!r} unknown; use one of {', '.join(BATCH_PREFILL_MODES)}")
        self._check_prefill_attention()
        if self.isolation not in ("process", "inline"):
            raise ConfigError(f"isolation {self.isolation!r} unknown; use process or inline")
        if self.silence_timeout_s <= 0:
            raise ConfigError(f"silence_timeout_s {self.silence_timeout_s} must be positive (seconds)")
        for name in ("windows", "steps_per_window", "ttft_repeats", "ramp_max_steps", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} is {getattr(self, name)}; it must be at least 1")
        if self.ramp_min_steps > self.ramp_max_steps:
            raise ConfigError(f"ramp_min_steps {self.ramp_min_steps} exceeds ramp_max_steps {self.ramp_max_steps}")
        if any(b < 1 for b in self.batch_sizes) or not self.batch_sizes:
            raise ConfigError(f"batch sizes {self.batch_sizes} must be positive; pass e.g. --batch 1,4,16")
        if not self.contexts:
            raise ConfigError("no contexts given; pass e.g. --contexts 16k,32k")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization {self.gpu_memory_utilization} must be in (0, 1]; e.g. 0.85")
        if not 0.0 < self.clock_sag_threshold < 1.0:
            raise ConfigError(f"clock_sag_threshold {self.clock_sag_threshold} must be in (0, 1); e.g. 0.25")
        if self.num_layers is not None and self.num_layers < 1:
            raise ConfigError(f"num_layers {self.num_layers} must be at least 1")
        if self.num_layers is not None and self.model not in preset_names():
            raise ConfigError("--layers applies to presets only; a local model dir keeps its own layer count")
        self._check_tensor_parallel()
        if self.single_prefill_from is not None and self.single_prefill_from < 1:
            raise ConfigError(f"single_prefill_from {self.single_prefill_from} must be a positive context (e.g. 256k) or null")
        self._check_positions()
        for context in self.contexts:
            limit, room = self.max_model_len_for(context), self.decode_tokens_for(context)
            if context + room > limit:
                raise ConfigError(
                    f"context {format_size(context)} ({context}) + {room} decode tokens "
                    f"exceeds max_model_len {limit}; pass --max-model-len {context + room} or a shorter ladder"
                )

    def _check_positions(self) -> None:
        """Every engine's max_model_len within the model's trained positions, unless a preset opts out."""
        preset = self.model in preset_names()
        config = load_preset_config(self.model) if preset else read_model_dir_config(self.model)
        trained = config.get("max_position_embeddings") or config.get("seq_length")
        if trained is None:
            return
        if self.extend_positions and not preset:
            raise ConfigError(f"extend_positions applies to presets (dummy weights) only; the real weights of "
                              f"{self.model} were trained for {trained} positions")
        for context in self.contexts:
            need = self.max_model_len_for(context)
            if need > trained and not self.extend_positions:
                fix = ("pass --extend-positions (dummy weights: positions past the trained range cost the same "
                       "time; the cell records it) or a shorter context" if preset else
                       f"pass contexts up to {trained - self.decode_tokens_for(context)} tokens")
                raise ConfigError(f"context {format_size(context)} needs max_model_len {need} (context + decode "
                                  f"room), beyond the {trained} positions {self.model} was trained for; {fix}")

    def _check_prefill_attention(self) -> None:
        """`skip` only where the engine process runs the model and the arm's prefill is a backend it wraps."""
        if self.prefill_attention not in PREFILL_ATTENTION_MODES:
            raise ConfigError(f"prefill_attention {self.prefill_attention!r} unknown; use one of "
                              f"{', '.join(PREFILL_ATTENTION_MODES)}")
        if self.prefill_attention == "exact":
            return
        if self.model not in preset_names():
            raise ConfigError(f"prefill_attention skip changes what the KV cache holds; it is for presets (dummy "
                              f"weights), not {self.model}: drop --prefill-attention skip")
        if self.tensor_parallel_size > 1:
            raise ConfigError("prefill_attention skip runs at tensor parallel 1 (the harness checks the skip in the "
                              "engine process); drop --tp or --prefill-attention skip")
        own = [name for name in self.arms if not get_arm(name).prefill_skippable]
        if own:
            raise ConfigError(f"arms {', '.join(own)} prefill in their own kernels, which prefill_attention skip does "
                              f"not reach; run them in a plan with --prefill-attention exact")

    def _check_tensor_parallel(self) -> None:
        """TP splits query and KV heads evenly over the ranks; vLLM would fail later and less clearly."""
        tp = self.tensor_parallel_size
        if tp < 1:
            raise ConfigError(f"tensor_parallel_size {tp} must be at least 1; e.g. --tp 2")
        if tp == 1:
            return
        config = load_preset_config(self.model) if self.model in preset_names() else read_model_dir_config(self.model)
        q_heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or q_heads)
        for what, heads in (("query", q_heads), ("KV", kv_heads)):
            if heads % tp:
                divisors = [d for d in range(1, kv_heads + 1) if q_heads % d == 0 and kv_heads % d == 0]
                raise ConfigError(
                    f"tensor_parallel_size {tp} does not divide the {heads} {what} heads of {self.model}; "
                    f"use one of {', '.join(map(str, divisors))}"
                )

    @property
    def cell_decode_steps(self) -> int:
        """Decode steps one cell runs on its requests after the prefill (and the ramp): settle + windows."""
        return self.settle_steps + self.windows * (self.lead_steps + self.steps_per_window)

    @property
    def decode_tokens_per_request(self) -> int:
        """Tokens one request may generate: the longer of the ramp and the timed windows, plus margins."""
        return max(self.ramp_max_steps, self.cell_decode_steps) + 2

    def decode_tokens_for(self, context: int) -> int:
        """Tokens one request may generate at `context`: at a single-prefill context the clock ramp and the
        timed windows run on the same requests; with batch_prefill once the survivors decode through every
        cell of the engine (the most over the cells, largest batch first)."""
        if self.batch_prefill == "once":
            cells = sorted(self.batch_sizes, reverse=True)
            return max(self.decode_tokens_held(context, index, batch) for index, batch in enumerate(cells))
        if not self.single_prefill(context):
            return self.decode_tokens_per_request
        return self.ramp_max_steps + self.cell_decode_steps + 2

    def decode_tokens_held(self, context: int, cells_before: int, batch: int = 1) -> int:
        """batch_prefill once: the most tokens a request of a `batch`-request cell has decoded by the end of the
        cell that follows `cells_before` cells on the same requests (the warm-up ramp of a full-protocol context
        runs on its own requests, so only a single-prefill context's ramp counts). A cell keeps the requests
        prefilled last; the first of them has also decoded one token a step while the others' chunks ran."""
        ramp = self.ramp_max_steps if self.single_prefill(context) else 0
        during_prefill = -(-(batch - 1) * context // self.max_num_batched_tokens) + 1 if batch > 1 else 0
        held = ramp + (cells_before + 1) * self.cell_decode_steps + 2 + during_prefill
        return held if self.single_prefill(context) else max(held, self.ramp_max_steps + 2)

    @property
    def lead_steps(self) -> int:
        """Untimed steps at the start of each window. Under async scheduling the first step() after a
        pause only collects a step the GPU finished during the pause: on the H200 it read 3.7-8.5 ms
        against ~8.9, a third of the sd/mean.
        The step after it waits for a full step, as every later one does."""
        return 1 if self.async_scheduling else 0

    @property
    def effective_max_model_len(self) -> int:
        """The longest max_model_len of any engine of the plan (the model's config must allow it)."""
        return max(self.max_model_len_for(context) for context in self.contexts)

    def max_model_len_for(self, context: int) -> int:
        """The given max_model_len, or `context` plus decode room rounded up to a page: each rung's engine is
        sized for its own rung, so a cell measures the same engine whichever rungs share its command (the
        block table's width picks Locks' selection path and sizes every arm's metadata)."""
        if self.max_model_len is not None:
            return self.max_model_len
        need = context + self.decode_tokens_for(context)
        return -(-need // PAGE_SIZE) * PAGE_SIZE

    def single_prefill(self, context: int) -> bool:
        """Whether cells at `context` pay one prefill (no warm-up prefill, no TTFT repeats)."""
        return self.single_prefill_from is not None and context >= self.single_prefill_from

    @property
    def sparse_knob_fields(self) -> dict:
        return {"summary_format": self.summary_format, "scorer": self.scorer, "combine": self.combine}


_SIZE_FIELDS = {"contexts", "budgets"}
_TUPLE_FIELDS = {"arms", "contexts", "batch_sizes", "budgets"}


def _coerce(name: str, value):
    """YAML/CLI value -> the field's type (sizes may be "32k"; lists may be comma strings)."""
    if name in _TUPLE_FIELDS:
        items = (split_arm_list(value) if name == "arms" else value.split(",")) if isinstance(value, str) \
            else list(value) if isinstance(value, (list, tuple)) else [value]
        items = [item.strip() if isinstance(item, str) else item for item in items if item != ""]
        if name in _SIZE_FIELDS:
            return tuple(parse_size(item) for item in items)
        if name == "batch_sizes":
            return tuple(int(item) for item in items)
        return tuple(str(item) for item in items)
    if name in ("max_model_len", "kv_cache_memory_bytes", "max_num_batched_tokens", "single_prefill_from") and isinstance(value, str):
        return parse_size(value)
    default = _DEFAULTS.get(name)
    try:
        if name == "hbm_bytes_per_s":
            if value is None:
                return None
            rate = float(value)
            if not math.isfinite(rate) or rate <= 0:
                raise ValueError
            return rate
        # YAML 1.1 reads `4.23e12` (no dot) as a string; numbers are coerced to the field's type here.
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise ValueError
        elif isinstance(default, float):
            return float(value)
        elif isinstance(default, int) or name in ("num_layers", "single_prefill_from"):
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return None if value is None else int(value)
    except (TypeError, ValueError):
        if name == "hbm_bytes_per_s":
            raise ConfigError(f"hbm_bytes_per_s = {value!r} is not a positive rate in bytes/s (e.g. 3.0e12), "
                              "or null to measure the device at engine boot") from None
        raise ConfigError(f"{name} = {value!r} is not a {type(default).__name__ if default is not None else 'number'}") from None
    return value


_DEFAULTS = {f.name: f.default for f in fields(DecodePlan)}


def default_plan_path():
    return resources.files(__package__).joinpath("plans", "default.yaml")


def load_plan(path: str | Path | None = None, overrides: dict | None = None) -> DecodePlan:
    """Read a YAML plan (default plan when None), apply non-None `overrides`, validate once."""
    source = default_plan_path() if path is None else Path(path)
    try:
        data = yaml.safe_load(source.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"plan file {path} not found; pass a YAML plan or omit it for the default") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"plan file {path} is not valid YAML ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"plan file {path} must hold a mapping of knobs")
    known = {f.name for f in fields(DecodePlan)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"plan file {path}: unknown knob(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    merged = {**data, **{k: v for k, v in (overrides or {}).items() if v is not None}}
    return DecodePlan(**{name: _coerce(name, value) for name, value in merged.items()})


def with_overrides(plan: DecodePlan, **overrides) -> DecodePlan:
    return replace(plan, **{k: _coerce(k, v) for k, v in overrides.items() if v is not None})
