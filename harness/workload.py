"""Workload strings: `32q1s32k` = 32 requests, 1 query token each, 32K tokens of context.

The grammar follows vLLM's attention benchmarks (`batch_spec.py`): `[B]q<Q>s<S>`, where B (default 1)
is the batch, Q the query tokens per request per step (1 for decode) and S the context length. Sizes
take a `k` (x1024) or `m` (x1024^2) suffix, so `128k` is 131072 tokens and `1m` is 1048576.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..kernels.config import ConfigError

_SIZE_RE = re.compile(r"^(?P<num>\d+)(?P<unit>[km]?)$")
_WORKLOAD_RE = re.compile(r"^(?P<batch>\d*)q(?P<query>\d+[km]?)s(?P<context>\d+[km]?)$")
_UNITS = {"": 1, "k": 1024, "m": 1024 * 1024}


def parse_size(text: str | int) -> int:
    """`"32k"` -> 32768, `"1m"` -> 1048576, `"4000"` -> 4000; ints pass through."""
    if isinstance(text, int):
        value = text
    else:
        match = _SIZE_RE.match(str(text).strip().lower())
        if match is None:
            raise ConfigError(f"size {text!r} is not a number with an optional k/m suffix; pass e.g. 16k, 128k or 1m")
        value = int(match["num"]) * _UNITS[match["unit"]]
    if value <= 0:
        raise ConfigError(f"size {text!r} must be positive")
    return value


def format_size(tokens: int) -> str:
    """Inverse of `parse_size` where exact: 32768 -> "32k", 1048576 -> "1m", 1000 -> "1000"."""
    if tokens % _UNITS["m"] == 0:
        return f"{tokens // _UNITS['m']}m"
    if tokens % _UNITS["k"] == 0:
        return f"{tokens // _UNITS['k']}k"
    return str(tokens)


def parse_size_list(text: str) -> tuple[int, ...]:
    """`"16k,32k,128k"` -> (16384, 32768, 131072); order kept, duplicates rejected."""
    items = [item for item in (part.strip() for part in text.split(",")) if item]
    if not items:
        raise ConfigError(f"empty list {text!r}; pass comma-separated sizes such as 16k,32k")
    sizes = tuple(parse_size(item) for item in items)
    if len(set(sizes)) != len(sizes):
        raise ConfigError(f"list {text!r} repeats a value; give each size once")
    return sizes


@dataclass(frozen=True)
class Workload:
    """One decode batch: `batch` requests, `query_tokens` new tokens per step, `context` tokens each."""

    batch: int
    query_tokens: int
    context: int

    def __post_init__(self) -> None:
        if self.batch < 1 or self.query_tokens < 1 or self.context < 1:
            raise ConfigError(f"workload {self} needs batch, query tokens and context >= 1")

    @property
    def name(self) -> str:
        return f"{self.batch}q{format_size(self.query_tokens)}s{format_size(self.context)}"

    @classmethod
    def parse(cls, text: str) -> "Workload":
        match = _WORKLOAD_RE.match(text.strip().lower())
        if match is None:
            raise ConfigError(
                f"workload {text!r} is not [batch]q<query>s<context>; pass e.g. 1q1s32k or 8q1s128k"
            )
        batch = int(match["batch"]) if match["batch"] else 1
        return cls(batch=batch, query_tokens=parse_size(match["query"]), context=parse_size(match["context"]))

    def __str__(self) -> str:
        return self.name
