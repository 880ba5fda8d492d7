"""The evaluation arms: which page scorer (if any) picks the pages each decode step attends.

    parse_arm("locks:r8i4")  -> Arm(name="locks", scorer="locks", fmt=r8i4)
    parse_arm("fullkv")      -> Arm(name="fullkv", scorer=None)   # stock dense attention

Every sparse arm uses the same selection (sink + recent + top-(k-2), GQA share-average) and differs
only in the scorer of `kernels/score/selectors.py`, so a quality gap is the scorer's alone.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..kernels.build.reference import PageSummaries
from ..kernels.config import ConfigError, SummaryFormat
from ..kernels.score.selectors import PageScorer, SharedBasisGlobalScorer, fit_shared_basis, make_scorer, scorer_names

logger = logging.getLogger(__name__)

DENSE_ARM = "fullkv"
# Arms whose scorer reads a summary format (rank and precision); the others ignore a format.
_FORMAT_ARMS = {"locks": SummaryFormat(), "shared_basis_sequence": SummaryFormat(8, None),
                "shared_basis_global": SummaryFormat(8, None)}  # fmt: skip
FORMAT_SCORERS: tuple[str, ...] = tuple(_FORMAT_ARMS)
ARM_NAMES: tuple[str, ...] = (DENSE_ARM, *scorer_names())


class ArmError(ValueError):
    """An arm name or format is unknown; the message lists the valid ones."""


@dataclass(frozen=True)
class Arm:
    """One evaluation arm. scorer None = dense attention (FullKV); fmt only for summary scorers."""

    name: str
    scorer: str | None
    fmt: SummaryFormat | None = None

    @property
    def sparse(self) -> bool:
        return self.scorer is not None

    @property
    def label(self) -> str:
        """`locks:r8i4`, `quest`, `fullkv`: what the CLI accepts and tables show."""
        return f"{self.name}:{self.fmt.name}" if self.fmt is not None else self.name

    def make_scorer(self) -> PageScorer:
        if self.scorer is None:
            raise ArmError(f"arm {self.label} is dense; it has no page scorer")
        return make_scorer(self.scorer, fmt=self.fmt)


def parse_arm(text: str) -> Arm:
    """`name` or `name:format` (format rNiM / rNfp, only for locks and the shared-basis sketches)."""
    name, _, fmt_text = text.strip().partition(":")
    name = name.strip().lower()
    if name not in ARM_NAMES:
        raise ArmError(f"unknown arm {text!r}; use one of {', '.join(ARM_NAMES)} (e.g. locks:r8i4)")
    if name == DENSE_ARM:
        if fmt_text:
            raise ArmError(f"arm {text!r}: fullkv takes no format; pass plain `fullkv`")
        return Arm(name=name, scorer=None)
    if name not in _FORMAT_ARMS:
        if fmt_text:
            raise ArmError(f"arm {text!r}: {name} takes no summary format; pass plain `{name}`")
        return Arm(name=name, scorer=name)
    try:
        fmt = SummaryFormat.parse(fmt_text) if fmt_text else _FORMAT_ARMS[name]
    except ConfigError as error:
        raise ArmError(f"arm {text!r}: {error}") from None
    return Arm(name=name, scorer=name, fmt=fmt)


def parse_arms(texts: Sequence[str]) -> tuple[Arm, ...]:
    """Parse and de-duplicate (first occurrence wins), keeping the order given."""
    arms: dict[str, Arm] = {}
    for text in texts:
        arm = parse_arm(text)
        arms.setdefault(arm.label, arm)
    if not arms:
        raise ArmError("no arms given; pass e.g. --arms fullkv,oracle,locks:r8i4,quest,centroid")
    return tuple(arms.values())


def prompt_scorer(arm: Arm, prompt_keys: torch.Tensor) -> PageScorer:
    """The scorer an arm uses for one prompt. prompt_keys [L, Hkv, P, B, d]: the prompt's full pages
    of every selected layer. Only shared_basis_global looks at them: its one basis is fitted on all
    layers and KV heads pooled (Loki-style one sketch for the model; no calibration set ships here)."""
    if arm.scorer == "shared_basis_global":
        rank = arm.fmt.rank if arm.fmt else 8
        return SharedBasisGlobalScorer(fmt=arm.fmt, basis=fit_shared_basis(prompt_keys, rank))
    return arm.make_scorer()


def continuation_scorer(scorer: PageScorer, first_state: Any) -> PageScorer:
    """The scorer for pages that fill during decode. A shared-basis sketch keeps the basis it fitted
    on the prompt (refitting on one new page would give that page its own exact basis); every other
    scorer summarizes each page on its own, so it is reused as is."""
    if scorer.name.startswith("shared_basis") and isinstance(first_state, PageSummaries):
        return SharedBasisGlobalScorer(fmt=getattr(scorer, "fmt", None), basis=first_state.basis[..., 0, :, :])
    return scorer
