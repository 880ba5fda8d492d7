"""Every Locks layer's key cache and summary rows by layer name, so one launch can build a page on all layers.

A page that completes during decode is first scored one step later (config.scored_pages: the recent
page never competes), so its summaries are built at the start of the next step, by the metadata
builder, eagerly and before any graph replay: one launch for every layer of the group instead of
one per layer inside the step (40 serial single-page builds made every 16th step ~40% slower).
The impl registers its layer at each forward with a KV cache; registration is a dict lookup
unless the tensors changed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)


class SummaryStore:
    """layer name -> (k_cache view [NB, 16, Hkv, d], summary rows uint8 [NB, Hkv, row_bytes])."""

    def __init__(self) -> None:
        self._layers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._tables: dict[tuple, Any] = {}

    def register(self, name: str, k_cache: torch.Tensor, summary_rows: torch.Tensor) -> None:
        known = self._layers.get(name)
        if known is None or known[0].data_ptr() != k_cache.data_ptr() or known[1].data_ptr() != summary_rows.data_ptr():
            self._layers[name] = (k_cache, summary_rows)
            self._tables.clear()  # addresses changed: every table holding this layer is stale

    def registered(self, names: Sequence[str]) -> list[str]:
        return [name for name in names if name in self._layers]

    def build(self, names: Sequence[str], block_ids: torch.Tensor, layout, ops) -> int:
        """Builds block_ids int32 [N] (<0 skipped) on every registered layer of `names`; returns the layer count."""
        present = tuple(self.registered(names))
        if len(present) < len(names):
            logger.debug("Locks: %d of %d layers not registered yet; building the others", len(names) - len(present), len(names))
        if not present:
            return 0
        key = (present, layout)
        tables = self._tables.get(key)
        if tables is None:
            caches, rows = zip(*(self._layers[name] for name in present), strict=True)
            tables = self._tables[key] = ops.layer_tables(caches, rows, layout)
        ops.build_summaries_layers(tables, block_ids, layout)
        return len(present)

    def forget(self, names: Sequence[str]) -> None:
        """Drops these layers (a new engine's builder starts: the old tensors must not be kept alive)."""
        for name in names:
            self._layers.pop(name, None)
        self._tables.clear()


STORE = SummaryStore()
