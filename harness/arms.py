"""Arms: the attention backends a matched pair compares, found by name in a registry.

An arm says which vLLM attention backend to select, which device it needs, whether it is sparse
(then the budget is part of its cells and its deployed path is checked through backend counters),
what extra engine config or environment activates it, and which plugin distribution must be present.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata

from ..kernels.config import PAGE_SIZE, SCORER_KERNELS, SELECT_CHOICES, ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SparseKnobs:
    """The Locks knobs a sparse arm receives per engine (budget varies along the ladder)."""

    budget_tokens: int
    summary_format: str = "r8i4"
    scorer: str = "locks"
    combine: str = "share_average"


# vLLM general-plugin entry-point names (VLLM_PLUGINS allowlist): each engine loads only its arm's
# plugin, so the peer's plugin cannot touch the FA3, FlashInfer or Locks engines of a pair (and ours
# not the peer's). Ours is declared in pyproject.toml; the peer's (`locks-kv` 0.1.4) is `locks`.
OUR_PLUGIN = "locks_toolkit"
_CPU_ENGINE_DEFAULTS = {"VLLM_CPU_KVCACHE_SPACE": "1", "TORCHDYNAMO_DISABLE": "1"}
PEER_PLUGIN = "locks"


@dataclass(frozen=True)
class Arm:
    name: str
    backend: str  # vLLM AttentionBackendEnum member
    device: str = "cuda"  # "cuda" or "cpu"
    sparse: bool = False
    block_size: int = 16
    description: str = ""
    plugin_distribution: str | None = None  # must be installed for the arm to run
    counters: str | None = None  # "module:function" returning the deployed-path counters
    additional_config: Callable[[SparseKnobs], dict] | None = None
    env: Callable[[SparseKnobs | None, str | None], dict[str, str]] | None = None
    vllm_plugins: str = OUR_PLUGIN  # the only vLLM plugins this arm's engine loads
    # Its prefill runs a backend that prefill_attention skip wraps (kernels/vllm_backend/prefill_attention.py)
    prefill_skippable: bool = True

    def engine_kwargs(self, knobs: SparseKnobs | None) -> dict:
        kwargs: dict = {"attention_config": {"backend": self.backend}, "block_size": self.block_size}
        if self.additional_config is not None and knobs is not None:
            kwargs["additional_config"] = self.additional_config(knobs)
        return kwargs

    def environment(self, knobs: SparseKnobs | None, peer_config: str | None) -> dict[str, str]:
        extra = dict(self.env(knobs, peer_config)) if self.env is not None else {}
        if self.device == "cpu":
            # The CPU platform's KV cache takes most of the host's memory unless told (the CI machine has 24 GiB),
            # and its sampler would compile for ~12 s.
            extra.update({name: os.environ.get(name, default) for name, default in _CPU_ENGINE_DEFAULTS.items()})
        return {"VLLM_PLUGINS": self.vllm_plugins, **extra}

    def missing_plugin(self) -> str | None:
        """The plugin distribution this arm needs but that is not installed, else None."""
        if self.plugin_distribution is None:
            return None
        try:
            metadata.version(self.plugin_distribution)
        except metadata.PackageNotFoundError:
            return self.plugin_distribution
        return None

    def read_counters(self) -> dict | None:
        """Current deployed-path counters, or None when this arm has none (or they are not importable)."""
        if self.counters is None:
            return None
        module_name, _, func_name = self.counters.partition(":")
        try:
            func = getattr(importlib.import_module(module_name), func_name)
        except (ImportError, AttributeError) as exc:
            log.debug("counters %s unavailable: %s", self.counters, exc)
            return None
        return dict(func())


ARMS: dict[str, Arm] = {}


def register_arm(arm: Arm) -> Arm:
    if arm.name in ARMS:
        raise ValueError(f"arm {arm.name!r} is registered twice")
    ARMS[arm.name] = arm
    return arm


# The parametric form `locks[select=chunked,scorer_kernel=pages]`: a Locks arm with kernel settings other than the
# defaults (the same pages through other launches), timed beside `locks` in one run. The keys are the
# backend's kernel settings (kernels/vllm_backend/settings.py); each maps a text value to the setting.
KERNEL_SETTINGS: dict[str, tuple[str, ...]] = {
    "select": SELECT_CHOICES,
    "scorer_kernel": SCORER_KERNELS,
}
PARAMETRIC_BASES = ("locks", "locks-cpu")
ARM_FORM = "locks[select=chunked,scorer_kernel=pages]"
_PARAMETRIC: dict[str, Arm] = {}


def split_arm_list(text: str) -> list[str]:
    """'fa3,locks[select=chunked,scorer_kernel=pages]' -> ['fa3', 'locks[select=chunked,scorer_kernel=pages]']: commas inside brackets
    belong to the arm."""
    items, depth, current = [], 0, ""
    for char in text:
        depth += (char == "[") - (char == "]")
        if char == "," and depth == 0:
            items.append(current.strip())
            current = ""
        else:
            current += char
    items.append(current.strip())
    return [item for item in items if item]


def arm_file_stem(name: str) -> str:
    """An arm name as a file-name part: 'locks[select=chunked,scorer_kernel=pages]' -> 'locks-select-chunked-scorer_kernel-pages'
    (brackets, commas and '=' travel badly through copies and shells)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-")


def _parametric_arm(name: str) -> Arm:
    base_name, _, rest = name.partition("[")
    if base_name not in PARAMETRIC_BASES or not rest.endswith("]"):
        raise ConfigError(f"arm {name!r} is not of the form {ARM_FORM} (bases: {', '.join(PARAMETRIC_BASES)})")
    if not rest[:-1].strip():
        raise ConfigError(f"arm {name!r} sets nothing; use {base_name!r} itself or e.g. {ARM_FORM}")
    settings: dict = {}
    for item in (part.strip() for part in rest[:-1].split(",")):
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip().lower()
        if not eq or key not in KERNEL_SETTINGS:
            raise ConfigError(f"arm {name!r}: {item!r} is not KEY=VALUE with KEY one of {', '.join(KERNEL_SETTINGS)}; "
                              f"e.g. {ARM_FORM}")
        if value not in KERNEL_SETTINGS[key]:
            raise ConfigError(f"arm {name!r}: {key}={value!r} unknown; use one of {', '.join(KERNEL_SETTINGS[key])}")
        if key in settings:
            raise ConfigError(f"arm {name!r} sets {key} twice; give each setting once")
        settings[key] = value
    base = ARMS[base_name]
    shown = ", ".join(f"{key}={value}" for key, value in settings.items())
    return Arm(name, base.backend, device=base.device, sparse=True, block_size=base.block_size,
               description=f"{base.description} with {shown} (the same pages, other launches)",
               counters=base.counters, additional_config=_locks_variant(**settings), env=base.env,
               vllm_plugins=base.vllm_plugins)


def get_arm(name: str) -> Arm:
    """A registered arm by name, or the parametric form `locks[KEY=VALUE,...]` (KERNEL_SETTINGS)."""
    if name in ARMS:
        return ARMS[name]
    if "[" in name:
        if name not in _PARAMETRIC:
            _PARAMETRIC[name] = _parametric_arm(name)
        return _PARAMETRIC[name]
    raise ConfigError(f"arm {name!r} unknown; use one of {', '.join(sorted(ARMS))}, or {ARM_FORM}") from None


def _locks_additional_config(knobs: SparseKnobs) -> dict:
    # Keys of kernels/vllm_backend/settings.py (it rejects unknown ones).
    return {
        "locks": {
            "budget": knobs.budget_tokens,
            "format": knobs.summary_format,
            "scorer": knobs.scorer,
            "combine": knobs.combine,
        }
    }


def _locks_variant(**kernel_settings) -> Callable[[SparseKnobs], dict]:
    """additional_config of a Locks arm that differs from `locks` only in kernel settings (same pages)."""

    def config(knobs: SparseKnobs) -> dict:
        base = _locks_additional_config(knobs)
        return {"locks": {**base["locks"], **kernel_settings}}

    return config


def _locks_kv_env(knobs: SparseKnobs | None, peer_config: str | None) -> dict[str, str]:
    """The peer reads its whole configuration from LOCKS_CONFIG (its README, 0.1.4). Its `budget_pages`
    counts the selected pages EXCLUDING one sink and one recent page, and its `budget` is a fraction,
    so b tokens map to budget_pages = ceil(b / 16) - 2: the same k pages attended as our arm."""
    if peer_config is not None:
        return {"LOCKS_CONFIG": peer_config}
    if knobs is None:
        raise ValueError("the locks-kv arm needs a budget (--budget) or --peer-config")
    page_budget = -(-knobs.budget_tokens // PAGE_SIZE)
    config = {"variant": "fast", "budget_pages": page_budget - 2, "sink_pages": 1, "window_pages": 1}
    return {"LOCKS_CONFIG": json.dumps(config, sort_keys=True)}


register_arm(Arm("fa3", "FLASH_ATTN", description="vLLM FlashAttention 3 (dense)"))
register_arm(Arm("flashinfer", "FLASHINFER", description="vLLM FlashInfer (dense)"))
register_arm(
    Arm(
        "locks",
        "CUSTOM",
        sparse=True,
        description="Locks sparse decode (this toolkit's vLLM backend)",
        counters="locks_toolkit.kernels.vllm_backend.counters:snapshot",
        additional_config=_locks_additional_config,
    )
)
register_arm(
    Arm(
        "locks-kv",
        "FLASH_ATTN",  # the peer patches vLLM's selector so that a FlashAttention pick gets its backend
        sparse=True,
        description="the locks-kv peer plugin (activated by LOCKS_CONFIG; its own selector)",
        plugin_distribution="locks-kv",
        env=_locks_kv_env,
        vllm_plugins=PEER_PLUGIN,
        prefill_skippable=False,  # its backend is its own
    )
)
register_arm(Arm("cpu", "CPU_ATTN", device="cpu", description="vLLM CPU attention, dense (tests, CI)"))
register_arm(
    Arm(
        "locks-cpu",
        "CPU_ATTN",  # the CPU platform ignores a requested backend; the plugin overrides CPU_ATTN on opt-in
        device="cpu",
        sparse=True,
        description="Locks on vLLM's CPU platform through the reference ops (tests, CI)",
        counters="locks_toolkit.kernels.vllm_backend.counters:snapshot",
        additional_config=_locks_additional_config,
        env=lambda knobs, peer_config: {"LOCKS_VLLM_CPU": "1"},
    )
)
