"""The backend's configuration, read once from vLLM's `additional_config={"locks": {...}}`.

    LLM(model, attention_backend="CUSTOM",
        additional_config={"locks": {"format": "r8i4", "budget": 2048, "scorer": "locks"}})

Every key is optional; unknown keys and bad values raise `ConfigError` naming the fix.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..config import (
    SCORER_KERNELS,
    SELECT_CHOICES,
    ConfigError,
    LocksConfig,
    SelectionConfig,
    SummaryFormat,
    check_combine_rule,
)

from .crossover import CrossoverRule

logger = logging.getLogger(__name__)

ADDITIONAL_CONFIG_KEY = "locks"
# Scorers the backend runs in one engine. "locks" reads packed summaries (fast path); the others
# read the paged keys themselves (quality comparisons, eager only).
BACKEND_SCORERS: tuple[str, ...] = ("locks", "oracle", "quest", "centroid")
KEY_READING_SCORERS: frozenset[str] = frozenset({"oracle", "quest", "centroid"})
# The logits processor that switches an engine to per-request selection (request_settings.py), by the
# "module:Class" name vLLM's `logits_processors` accepts.
REQUEST_SETTINGS_PROCESSOR = "locks_toolkit.kernels.vllm_backend.request_settings:RequestSettings"
_KEYS = ("format", "budget", "combine", "scorer", "select", "scorer_kernel", "crossover", "debug_capture_layers")


@dataclass(frozen=True)
class BackendSettings:
    """The Locks method config plus backend-only switches.

    select: which Triton selection kernels follow the score kernel (config.SELECT_PATHS), or "auto" (the
    default: the merge path, `config.select_path_for`); the pages are the same on
    every path, only launches and time differ.
    scorer_kernel: the score kernel's code path (config.SCORER_KERNELS): "cuda" (production: the CUDA kernel
    where it serves the call, r8i4 / d=128 / bf16 / G <= 16 on sm_90, else "transposed"), "transposed" (the
    Triton kernel with query heads as the dots' M), or "pages" (the Triton kernel that serves every format).
    crossover: when a decode step runs exact dense attention because it is cheaper there (`crossover.py`);
    off by default. It applies to engine-wide selection, not to per-request selection (each request's own
    settings decide there).
    debug_capture_layers: layer indices whose per-step decode inputs/outputs are kept for checks
    (eager only; see `debug.py`). Empty in production.
    """

    locks: LocksConfig = field(default_factory=LocksConfig)
    select: str = SELECT_CHOICES[0]
    scorer_kernel: str = SCORER_KERNELS[0]
    crossover: CrossoverRule = field(default_factory=CrossoverRule)
    debug_capture_layers: tuple[int, ...] = ()

    @property
    def reads_keys(self) -> bool:
        """True when the scorer reads keys directly (no summaries; not CUDA-graph safe)."""
        return self.locks.scorer in KEY_READING_SCORERS

    def describe(self) -> str:
        sel = self.locks.selection
        return (
            f"scorer={self.locks.scorer} format={self.locks.summary} budget={sel.budget_tokens} "
            f"(k={sel.page_budget} pages of {sel.page_size}) combine={sel.combine} select={self.select} "
            f"scorer_kernel={self.scorer_kernel} crossover={self.crossover.describe()} "
            f"debug_capture_layers={list(self.debug_capture_layers)}"
        )


def parse_settings(raw: Mapping[str, Any] | None) -> BackendSettings:
    """The dict under additional_config["locks"] (or None) -> validated BackendSettings."""
    if raw is None:
        return BackendSettings()
    if not isinstance(raw, Mapping):
        raise ConfigError(f'additional_config["locks"] must be a dict, got {type(raw).__name__}; pass e.g. {{"budget": 2048}}')
    unknown = sorted(set(raw) - set(_KEYS))
    if unknown:
        raise ConfigError(f'unknown key(s) {unknown} in additional_config["locks"]; allowed: {", ".join(_KEYS)}')
    fmt = raw.get("format", "r8i4")
    if not isinstance(fmt, str):
        raise ConfigError(f"format must be a string like 'r8i4', got {fmt!r}")
    budget = raw.get("budget", SelectionConfig().budget_tokens)
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise ConfigError(f"budget must be an integer number of tokens (e.g. 2048), got {budget!r}")
    combine = check_combine_rule(raw.get("combine", "share_average"))
    scorer = raw.get("scorer", "locks")
    if scorer not in BACKEND_SCORERS:
        raise ConfigError(f"scorer {scorer!r} is not served by the vLLM backend; use one of {', '.join(BACKEND_SCORERS)}")
    select = raw.get("select", SELECT_CHOICES[0])
    if select not in SELECT_CHOICES:
        raise ConfigError(f"select {select!r} unknown; use one of {', '.join(SELECT_CHOICES)} (the selection kernels' launches)")
    scorer_kernel = raw.get("scorer_kernel", SCORER_KERNELS[0])
    if scorer_kernel not in SCORER_KERNELS:
        raise ConfigError(f"scorer_kernel {scorer_kernel!r} unknown; use one of {', '.join(SCORER_KERNELS)} (the score kernel's code path)")
    crossover = CrossoverRule.parse(raw.get("crossover"))
    layers = raw.get("debug_capture_layers", ())
    if not isinstance(layers, (list, tuple)) or not all(isinstance(i, int) and i >= 0 for i in layers):
        raise ConfigError(f"debug_capture_layers must be a list of layer indices, got {layers!r}")
    locks = LocksConfig(
        summary=SummaryFormat.parse(fmt),
        selection=SelectionConfig(budget_tokens=budget, combine=combine),
        scorer=scorer,
    )
    return BackendSettings(locks=locks, select=select, scorer_kernel=scorer_kernel, crossover=crossover,
                           debug_capture_layers=tuple(layers))


def settings_from_vllm_config(vllm_config: Any) -> BackendSettings:
    """VllmConfig -> BackendSettings, from `vllm_config.additional_config["locks"]`."""
    additional = getattr(vllm_config, "additional_config", None) or {}
    if not isinstance(additional, Mapping):
        raise ConfigError("additional_config must be a dict to carry Locks settings; pass additional_config={'locks': {...}}")
    return parse_settings(additional.get(ADDITIONAL_CONFIG_KEY))


def per_request_enabled(vllm_config: Any) -> bool:
    """True when the engine lists the per-request RequestSettings processor (by class or "module:Class" name)."""
    listed = getattr(getattr(vllm_config, "model_config", None), "logits_processors", None) or ()
    return any((p if isinstance(p, str) else f"{p.__module__}:{p.__qualname__}") == REQUEST_SETTINGS_PROCESSOR
               for p in listed)  # fmt: skip
