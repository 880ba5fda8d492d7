"""The dense crossover: a decode step whose exact attention is cheap enough runs it instead of the sparse path.

The sparse path has a fixed cost per layer (score and select launches, the decode's split merge) that dense
decode does not pay, and saves the KV bytes it does not read. Below some amount of KV per step the saving is
smaller than the fixed cost: at 16K bs1 on the H200 (GLM-4-9B geometry) Locks was 4.75 µs a layer slower than
the faster dense arm, at 32K 0.75 µs slower, at 64K 3.75 µs faster (docs/results/efficiency.md). The saving
grows with the KV the step would read densely and the fixed cost does not, so the rule is one number of
bytes: a step whose dense attention reads at most `max_dense_mib` MiB of KV per layer (every live decode row's
pages, K and V, every KV head) runs dense. The choice is per step: every row of it goes the same way, since
the fixed cost is paid once per step and the cheaper side of a mixed batch is the side that holds its long rows.

A step that runs dense by this rule is counted as `crossover_dense_rows`, apart from `dense_fallback_rows`
(a row whose pages all fit the budget), so the deployed-path check can tell "chosen dense because cheaper"
from "fell back".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..config import PAGE_SIZE, ConfigError

MIB = 1 << 20
# Interpolated from the bs1 ladder above: the gap to the faster dense arm goes from +0.75 µs a layer at 32K to
# -3.75 µs at 64K, so it closes near 2390 pages a KV head (~38K tokens); 4 KV heads of 16 bf16 K+V tokens
# (8 KiB a page and head) read 74.7 MiB there. Not yet measured at batch > 1 or on another GPU.
H200_MAX_DENSE_MIB = 74.0


@dataclass(frozen=True)
class CrossoverRule:
    """When a decode step runs exact dense attention instead of the sparse path (None: never)."""

    max_dense_mib: float | None = None

    def __post_init__(self) -> None:
        if self.max_dense_mib is not None and not self.max_dense_mib > 0:
            raise ConfigError(f"crossover must be a positive number of MiB (e.g. {H200_MAX_DENSE_MIB}) or 'off'; "
                              f"got {self.max_dense_mib!r}")

    @property
    def enabled(self) -> bool:
        return self.max_dense_mib is not None

    @classmethod
    def parse(cls, raw) -> CrossoverRule:
        """additional_config["locks"]["crossover"]: "off" (the default), "h200" (the H200's measured value),
        or a number of MiB of dense KV reads per layer at or below which a step runs dense."""
        if raw is None or raw == "off":
            return cls()
        if raw == "h200":
            return cls(H200_MAX_DENSE_MIB)
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            raise ConfigError(f"crossover must be 'off', 'h200' or a number of MiB (e.g. {H200_MAX_DENSE_MIB}); got {raw!r}")
        return cls(float(raw))

    def describe(self) -> str:
        return f"{self.max_dense_mib:g}MiB" if self.enabled else "off"

    def dense_bytes(self, seq_lens: np.ndarray, num_kv_heads: int, head_dim: int, element_bytes: int) -> int:
        """KV bytes one layer's dense attention reads for these rows (seq_len 0 rows, the graph padding, read none)."""
        pages = int(np.sum(-(-np.asarray(seq_lens, dtype=np.int64) // PAGE_SIZE)))
        return pages * num_kv_heads * 2 * PAGE_SIZE * head_dim * element_bytes

    def runs_dense(self, seq_lens: np.ndarray, num_kv_heads: int, head_dim: int, element_bytes: int) -> bool:
        """Whether a decode step of rows with these lengths runs dense under this rule."""
        if not self.enabled or not np.any(np.asarray(seq_lens) > 0):
            return False
        return self.dense_bytes(seq_lens, num_kv_heads, head_dim, element_bytes) <= self.max_dense_mib * MIB
