"""Decode noise per arm: sd/mean of the timed TPOT steps over the ok cells, with the noisiest cell named.

A sparse arm whose steps are much noisier than the dense arms of the same setup usually does work in
some steps only (a page-completion build), which a mean TPOT alone hides.
"""

from __future__ import annotations

import pandas as pd

from . import markdown as md
from .decode import SETUP_KEYS, setup_title

NOISE_HEADER = ["Arm", "ok cells", "median sd/mean", "max sd/mean", "max at"]
NOISE_LEGEND = ("sd/mean of the timed decode steps (clean windows) of each ok cell, over every context and batch "
                "of the arm; `max at` names the noisiest cell.")


def _arm_rows(group: pd.DataFrame) -> list[list[str]]:
    """One row per arm label of one setup, dense arms first."""
    rows = []
    arms = sorted(group.groupby("arm_label"), key=lambda item: (not item[1]["dense"].iloc[0], item[0]))
    for arm, cells in arms:
        worst = cells.loc[cells["tpot_cv"].idxmax()]
        rows.append([arm, str(len(cells)), md.fmt_pct(cells["tpot_cv"].median(), 1), md.fmt_pct(worst["tpot_cv"], 1),
                     f"{md.fmt_tokens(worst['context_tokens'])} bs{worst['batch_size']}"])
    return rows


def render_noise(frame: pd.DataFrame) -> str:
    """One table per setup of the decode frame; empty when no ok cell has a TPOT sd/mean."""
    ok = frame[(frame["status"] == "ok") & frame["tpot_cv"].notna()] if len(frame) else frame
    if ok.empty:
        return ""
    parts = ["## Decode noise (TPOT sd/mean per arm)", "", NOISE_LEGEND]
    for setup, group in ok.groupby(SETUP_KEYS, sort=True):
        parts += ["", f"### {setup_title(setup)}", "", md.table(NOISE_HEADER, _arm_rows(group), "lrrrl")]
    return "\n".join(parts)
