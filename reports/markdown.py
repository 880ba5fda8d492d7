"""Markdown building blocks with fixed number formatting, so the same records give the same bytes."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

DASH = "—"
STATUS_LABEL = {"refused": "refused", "oom": "OOM", "error": "error"}


def missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def fmt_num(value: Any, digits: int = 2) -> str:
    """Fixed-point number, or an em dash when absent."""
    return DASH if missing(value) else f"{float(value):.{digits}f}"


def fmt_pm(mean: Any, sd: Any, digits: int = 2) -> str:
    """`mean ± sd`; only the mean when sd is absent."""
    if missing(mean):
        return DASH
    return fmt_num(mean, digits) if missing(sd) else f"{float(mean):.{digits}f} ± {float(sd):.{digits}f}"


def fmt_ratio(value: Any, digits: int = 2) -> str:
    return DASH if missing(value) else f"{float(value):.{digits}f}×"


def fmt_pct(fraction: Any, digits: int = 0) -> str:
    return DASH if missing(fraction) else f"{100.0 * float(fraction):.{digits}f}%"


def fmt_bytes(value: Any) -> str:
    """Decimal units (kB, MB, GB), three significant figures or more."""
    if missing(value):
        return DASH
    value = float(value)
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.1f} {unit}"
    return f"{value:.0f} B"


def fmt_int(value: Any) -> str:
    return DASH if missing(value) else str(int(value))


def fmt_tokens(tokens: Any) -> str:
    """32768 -> 32k, 1048576 -> 1m (the workload-string spelling), others as digits."""
    if missing(tokens) or not tokens:  # 0: the record did not say
        return DASH
    tokens = int(tokens)
    if tokens % (1 << 20) == 0:
        return f"{tokens >> 20}m"
    if tokens % (1 << 10) == 0:
        return f"{tokens >> 10}k"
    return str(tokens)


def with_format(name: str, fmt: Any) -> str:
    """`locks r8i4`: the summary format appended to an arm or selector name that does not already carry it."""
    return name if not fmt or str(fmt) in name else f"{name} {fmt}"


def failures(group: Any, what: str) -> str:
    """`2 of 5 records <what>: OOM (1) — reason; ...` for the rows of `group` whose status is not ok, else ''."""
    failed = group[group["status"] != "ok"]
    if failed.empty:
        return ""
    parts = [f"{STATUS_LABEL.get(status, status)} ({len(rows)}) — {reason or 'no reason recorded'}"
             for (status, reason), rows in failed.groupby(["status", "reason"], sort=True)]
    return f"{len(failed)} of {len(group)} records {what}: " + "; ".join(parts)


def bold(text: str) -> str:
    return f"**{text}**"


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def table(header: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None) -> str:
    """A GitHub markdown table; `align` is one letter per column (l, r, c), default left then right."""
    align = align or "l" + "r" * (len(header) - 1)
    if len(align) != len(header):
        raise ValueError(f"align {align!r} has {len(align)} letters for {len(header)} columns")
    rule = {"l": ":---", "r": "---:", "c": ":---:"}
    lines = ["| " + " | ".join(map(_cell, header)) + " |", "| " + " | ".join(rule[a] for a in align) + " |"]
    lines += ["| " + " | ".join(map(_cell, row)) + " |" for row in rows]
    return "\n".join(lines)


class Notes:
    """Numbered footnotes in order of first use; the same text always gets the same number."""

    def __init__(self) -> None:
        self._numbers: dict[str, int] = {}

    def mark(self, text: str) -> str:
        """The `[^n]` marker for `text`, allocating the next number on first use."""
        number = self._numbers.setdefault(text, len(self._numbers) + 1)
        return f"[^{number}]"

    def status_marker(self, status: str, reason: str, where: str) -> str:
        """The marker of the note `where: OOM — reason` for a cell that produced no number."""
        return self.mark(f"{where}: {STATUS_LABEL.get(status, status)} — {reason or 'no reason recorded'}")

    def status_cell(self, status: str, reason: str, where: str) -> str:
        """`OOM[^n]`: the status in place of the number, with the reason as the note."""
        return STATUS_LABEL.get(status, status) + self.status_marker(status, reason, where)

    def __len__(self) -> int:
        return len(self._numbers)

    def render(self) -> str:
        return "\n".join(f"[^{n}]: {text}" for text, n in self._numbers.items())
