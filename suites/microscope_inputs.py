"""What the microscope and its audits take in: a selector row (`Arm`) and the paged cache one decode
step sees (`StepPages`). Its own module so that the audits (microscope_audit.py) and the microscope
(microscope.py) both import it and neither imports the other's caller."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.config import SummaryFormat


@dataclass(frozen=True)
class Arm:
    """One selector row: a registered scorer and, where it matters, its summary format."""

    scorer: str
    fmt: SummaryFormat | None = None

    @property
    def label(self) -> str:
        return self.scorer if self.fmt is None else f"{self.scorer} {self.fmt}"


@dataclass(frozen=True)
class StepPages:
    """The paged cache one decode step sees (fp64). keys/values [Hkv, P, B, d]; q [Hkv, G, d]."""

    q: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    token_counts: torch.Tensor  # int64 [P]
    full_pages: int  # F: the scored pages, every page before the recent one (all full, all summarized)

    @property
    def num_pages(self) -> int:
        return self.keys.shape[-3]

    def scored_mask(self) -> torch.Tensor:
        """bool [P]: pages with a summary (all full pages, sink included). Shares are normalized over
        these, exactly as the deployed kernel does; the partial recent page has no summary."""
        return torch.arange(self.num_pages) < self.full_pages

    def contested_mask(self) -> torch.Tensor:
        """bool [P]: pages competing for the k - 2 free slots (not the sink, not the recent page)."""
        ids = torch.arange(self.num_pages)
        return (ids > 0) & (ids < self.num_pages - 1)
