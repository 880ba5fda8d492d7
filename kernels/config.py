"""Typed configuration of the Locks method: summary format and selection rule.

One frozen object, validated once at the edge (CLI, vLLM additional_config, YAML), shared by the
reference, the Triton kernels, the vLLM backend and the evaluation engines.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Literal, get_args

PAGE_SIZE = 16  # tokens per KV page (vLLM block size); the method is defined for B = 16

CombineRule = Literal["share_average", "group_max", "group_mass"]
COMBINE_RULES: tuple[str, ...] = get_args(CombineRule)  # one list of names, for checks and messages

_FORMAT_RE = re.compile(r"^r(?P<rank>\d+)(?P<prec>fp|i4|i8)$")


def cdiv(a: int, b: int) -> int:
    """Ceiling of a / b for integers (b > 0), e.g. pages needed for a tokens at b tokens a page."""
    return -(-a // b)


def scored_pages(seq_len: int, page_size: int = PAGE_SIZE) -> int:
    """Pages whose scores enter each head's softmax normalizer: every page before the recent one.

    The recent page (the one holding the newest token) is always kept, so it never competes. Leaving
    it out even when it is full lets a page's summary be built one step after the page completes
    (one launch for every layer, instead of one per layer inside the step that completes it).
    """
    return max(seq_len - 1, 0) // page_size


class ConfigError(ValueError):
    """A configuration value is invalid; the message says what to pass instead."""


def check_combine_rule(rule: str) -> str:
    """Return `rule` if it names a GQA combine rule; else raise ConfigError listing the valid ones."""
    if rule not in COMBINE_RULES:
        raise ConfigError(f"combine rule {rule!r} unknown; use one of {', '.join(COMBINE_RULES)}")
    return rule


@dataclass(frozen=True)
class SummaryFormat:
    """Rank and basis precision of the page summaries: `rNiM` (int-M basis) or `rNfp` (unquantized).

    Coefficients and centroid are int8 whenever the basis is quantized; `basis_bits=None` means fp.
    """

    rank: int = 8
    basis_bits: int | None = 4

    def __post_init__(self) -> None:
        if not 1 <= self.rank <= PAGE_SIZE - 1:
            raise ConfigError(
                f"rank {self.rank} is outside 1..{PAGE_SIZE - 1} (a centered page of {PAGE_SIZE} keys "
                f"has rank at most {PAGE_SIZE - 1}); pass e.g. --format r8i4"
            )
        if self.basis_bits not in (None, 4, 8):
            raise ConfigError(f"basis bits {self.basis_bits} unsupported; use 4, 8 or fp (e.g. r8i4, r8i8, r8fp)")

    @property
    def quantized(self) -> bool:
        return self.basis_bits is not None

    @property
    def name(self) -> str:
        return f"r{self.rank}{'fp' if self.basis_bits is None else f'i{self.basis_bits}'}"

    @classmethod
    def parse(cls, text: str) -> "SummaryFormat":
        match = _FORMAT_RE.match(text.strip().lower())
        if match is None:
            raise ConfigError(f"summary format {text!r} is not rNiM or rNfp; pass e.g. r8i4, r8i8, r4i4 or r8fp")
        prec = match["prec"]
        return cls(rank=int(match["rank"]), basis_bits=None if prec == "fp" else int(prec[1:]))

    def __str__(self) -> str:  # so f-strings and records show "r8i4"
        return self.name


# The Triton selection kernels after the score kernel (kernels/score/pages.ScoreTuning.select_path): "merge"
# (each chunk's top-(k-2), merged by the pair's last program: select/merge.py) and "chunked" (keys, gather,
# resolve over chunks of the table: select/chunked.py; also where merge declines a budget its candidate tile
# cannot hold). Both select the same pages.
SELECT_PATHS: tuple[str, ...] = ("merge", "chunked")
# The backend's `select` setting: a path, or "auto" (the default), the merge path at every block-table width.
# Alone on the H100 (kernel bench, GLM-4-9B geometry) it took 9.8 / 10.9 µs at 16K / 32K bs1 against 11.7 /
# 11.9 for the one-launch path auto ran there before, and 20.6 against 36.4 for the chunked launches at 1M bs1
# (docs/decisions.md).
SELECT_CHOICES: tuple[str, ...] = ("auto",) + SELECT_PATHS


def select_path_for(select: str) -> str:
    """The selection path that `select` (SELECT_CHOICES) runs."""
    return "merge" if select == "auto" else select


# The score kernel's code paths by name (`triton.score_select.SCORER_KERNELS`), the production one first:
# "cuda" (kernels/score/score_t.cu: every operand built in its mma's register layout; r8i4, d = 128, bf16 q,
# G <= 16 on sm_90, the transposed kernel elsewhere; H200 128K bs1: -0.49 ms per step), "transposed" (query
# heads as the dots' M, V^T q never leaves registers, 2-page tiles: `triton/score_t.py`; -0.25 ms), "pages"
# (pages x basis columns as M: `triton/score_select.py`, the one that serves every format and head size).
SCORER_KERNELS: tuple[str, ...] = ("cuda", "transposed", "pages")


@dataclass(frozen=True)
class SelectionConfig:
    """How pages are chosen each decode step, per (sequence, layer, KV head).

    budget_tokens: the per-(layer, KV head) token budget b; the page budget is k = ceil(b / B).
    The sink page (page 0) and the most recent page count inside the budget.
    """

    budget_tokens: int = 2048
    combine: CombineRule = "share_average"
    page_size: int = PAGE_SIZE

    def __post_init__(self) -> None:
        if self.page_size != PAGE_SIZE:
            raise ConfigError(f"page size {self.page_size} unsupported; Locks is defined for block_size={PAGE_SIZE}")
        if self.budget_tokens < 2 * self.page_size:
            raise ConfigError(
                f"budget {self.budget_tokens} tokens leaves no room for the sink and recent pages; "
                f"pass a budget of at least {2 * self.page_size} tokens"
            )
        if self.budget_tokens % self.page_size:
            raise ConfigError(
                f"budget {self.budget_tokens} is not a multiple of the page size {self.page_size}; "
                f"pass e.g. {self.page_size * math.ceil(self.budget_tokens / self.page_size)}"
            )
        check_combine_rule(self.combine)

    @property
    def page_budget(self) -> int:
        """k = ceil(b / B): pages attended per (sequence, layer, KV head), sink and recent included."""
        return math.ceil(self.budget_tokens / self.page_size)


@dataclass(frozen=True)
class LocksConfig:
    """Everything that defines a Locks arm: summary format, selection, and the scorer that ranks pages."""

    summary: SummaryFormat = field(default_factory=SummaryFormat)
    selection: SelectionConfig = field(default_factory=SelectionConfig)
    scorer: str = "locks"  # a name in kernels.reference.selectors (oracle, locks, quest, centroid, ...)

    def with_budget(self, budget_tokens: int) -> "LocksConfig":
        return replace(self, selection=replace(self.selection, budget_tokens=budget_tokens))
