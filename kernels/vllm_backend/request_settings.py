"""Per-request selection settings: one engine serves every scorer and budget (quality grids, A/B on traffic).

    LLM(model, attention_backend="CUSTOM", enable_prefix_caching=True, block_size=16,
        logits_processors=[RequestSettings],             # switches the engine to per-request selection
        additional_config={"locks": {"budget": 2048}})   # requests without settings use these
    SamplingParams(extra_args={"locks": {"scorer": "quest", "budget": 256}})
    SamplingParams(extra_args={"locks": {"scorer": "dense"}})   # exact attention over every page (FullKV)

vLLM 0.24 hands an attention builder no request identity, but it tells logits processors which request
sits in which persistent-batch slot (added, removed, moved) right before it builds the step's attention
metadata, and decode rows are those slots in order. `RequestSettings` is a logits processor that leaves
the logits alone and keeps, per slot, the request's selection and prompt length; the builder reads them.

An engine with this processor runs eager (the rows of one step are grouped by setting on the host), and
a request's first generated token always comes from exact attention, as in an engine without prefix
caching: a prompt tail of one token (a prefix-cache hit up to the last page) is a decode-shaped row that
the builder sends to the exact group. Summaries are keyed by physical block, so cached pages keep theirs.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from ..config import ConfigError, SelectionConfig
from .settings import BACKEND_SCORERS, REQUEST_SETTINGS_PROCESSOR

logger = logging.getLogger(__name__)

EXTRA_ARGS_KEY = "locks"
DENSE = "dense"  # exact attention over every page: the FullKV arm inside a Locks engine
REQUEST_SCORERS: tuple[str, ...] = (DENSE, *BACKEND_SCORERS)
_REQUEST_KEYS = ("scorer", "budget")


@dataclass(frozen=True)
class RequestSelection:
    """One request's selection: a scorer and its token budget (None for dense)."""

    scorer: str
    budget_tokens: int | None

    @property
    def dense(self) -> bool:
        return self.scorer == DENSE

    @property
    def page_budget(self) -> int:
        if self.budget_tokens is None:
            raise ValueError("a dense request has no page budget")
        return SelectionConfig(budget_tokens=self.budget_tokens).page_budget

    def label(self) -> str:
        return DENSE if self.dense else f"{self.scorer} b={self.budget_tokens}"


def parse_request_selection(extra_args: Mapping[str, Any] | None) -> RequestSelection | None:
    """`SamplingParams.extra_args` -> the request's selection (None: no "locks" entry, the engine's settings).

    A sparse scorer without a budget gets budget None: the engine's, filled in by `row_groups`. Raises
    ConfigError naming the fix.
    """
    raw = (extra_args or {}).get(EXTRA_ARGS_KEY)
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ConfigError(f'extra_args["{EXTRA_ARGS_KEY}"] must be a dict like {{"scorer": "locks", "budget": 512}}, '
                          f"got {type(raw).__name__}")  # fmt: skip
    unknown = sorted(set(raw) - set(_REQUEST_KEYS))
    if unknown:
        raise ConfigError(f'unknown key(s) {unknown} in extra_args["{EXTRA_ARGS_KEY}"]; allowed: {", ".join(_REQUEST_KEYS)}')
    scorer = raw.get("scorer", "locks")
    if scorer not in REQUEST_SCORERS:
        raise ConfigError(f"request scorer {scorer!r} unknown; use one of {', '.join(REQUEST_SCORERS)}")
    budget = raw.get("budget")
    if scorer == DENSE:
        if "budget" in raw:
            raise ConfigError('a "dense" request attends every page; drop its "budget"')
        return RequestSelection(DENSE, None)
    if budget is None:
        return RequestSelection(scorer, None)
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise ConfigError(f"request budget must be an integer number of tokens (e.g. 512), got {budget!r}")
    SelectionConfig(budget_tokens=budget)  # the same budget rules as the engine's (ConfigError)
    return RequestSelection(scorer, budget)


@dataclass(frozen=True)
class SlotState:
    selection: RequestSelection | None  # None: the engine's settings
    prompt_len: int


class RequestSettings(LogitsProcessor):
    """A logits processor that changes no logit: it tracks each batch slot's selection for the builder."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.slots: dict[int, SlotState] = {}
        _ACTIVE[0] = self

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        try:
            parse_request_selection(sampling_params.extra_args)
        except ConfigError as error:
            raise ValueError(str(error)) from None

    def is_argmax_invariant(self) -> bool:
        return True

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.slots, batch_update, _slot_state)


def _slot_state(params: Any, prompt_ids: list[int] | None, output_ids: list[int]) -> SlotState:
    return SlotState(parse_request_selection(params.extra_args), len(prompt_ids or ()))


_ACTIVE: list[RequestSettings | None] = [None]  # the processor of this process's current engine


@dataclass(frozen=True)
class RowGroup:
    """Decode rows of one step that share a selection; `rows` indexes the step's decode rows."""

    selection: RequestSelection
    rows: torch.Tensor  # int64 [n] on the step's device
    host_rows: np.ndarray  # the same rows on the host
    host_seq_lens: np.ndarray  # their sequence lengths as the host knows them (at least the device's)

    @property
    def count(self) -> int:
        return len(self.host_rows)


def row_groups(num_decodes: int, seq_lens: Sequence[int], default: RequestSelection,
               device: torch.device) -> list[RowGroup] | None:  # fmt: skip
    """The live decode rows [0, num_decodes) grouped by selection; None when every row uses `default`.

    A row whose sequence is still its prompt (a one-token prompt tail after a prefix-cache hit) is exact.
    """
    processor = _ACTIVE[0]
    if processor is None:
        raise ConfigError("per-request selection needs the RequestSettings logits processor in this engine; pass "
                          f"logits_processors=[{REQUEST_SETTINGS_PROCESSOR!r}]")
    by_selection: dict[RequestSelection, list[int]] = {}
    for row in range(num_decodes):
        seq_len = int(seq_lens[row])
        if seq_len <= 0:  # padding
            continue
        slot = processor.slots.get(row)
        selection = slot.selection if slot is not None else None
        if selection is None:
            selection = default
        elif selection.budget_tokens is None and not selection.dense:
            selection = RequestSelection(selection.scorer, default.budget_tokens)
        if slot is not None and seq_len <= slot.prompt_len:
            selection = RequestSelection(DENSE, None)
        by_selection.setdefault(selection, []).append(row)
    if set(by_selection) <= {default}:
        return None
    return [RowGroup(sel, torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True), np.asarray(rows),
                     np.asarray([int(seq_lens[row]) for row in rows]))
            for sel, rows in by_selection.items()]  # fmt: skip
