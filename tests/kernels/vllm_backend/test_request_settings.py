"""Per-request selection settings: parsing, the slot bookkeeping vLLM's batch updates drive, and the grouping
of one step's decode rows (the engine end to end: test_vllm_backend_engine.py)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from locks_toolkit.kernels.config import ConfigError  # noqa: E402
from locks_toolkit.kernels.vllm_backend import request_settings as rs  # noqa: E402
from locks_toolkit.kernels.vllm_backend.settings import REQUEST_SETTINGS_PROCESSOR, per_request_enabled  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality  # noqa: E402

DEFAULT = rs.RequestSelection("locks", 2048)


def test_settings_parse_into_a_selection_and_default_to_the_engine():
    assert rs.parse_request_selection(None) is None and rs.parse_request_selection({"other": 1}) is None
    assert rs.parse_request_selection({"locks": {"scorer": "quest", "budget": 256}}) == rs.RequestSelection("quest", 256)
    assert rs.parse_request_selection({"locks": {"scorer": "dense"}}).dense
    assert rs.parse_request_selection({"locks": {"budget": 512}}) == rs.RequestSelection("locks", 512)
    assert rs.parse_request_selection({"locks": {"scorer": "oracle"}}) == rs.RequestSelection("oracle", None)  # the engine's
    assert rs.RequestSelection("locks", 512).page_budget == 32


@pytest.mark.parametrize("raw, fragment", [
    ({"scorer": "exact"}, "use one of dense, locks, oracle, quest, centroid"),
    ({"scorer": "dense", "budget": 64}, 'drop its "budget"'),
    ({"budget": 100}, "not a multiple of the page size"),
    ({"budget": 16}, "at least 32 tokens"),
    ({"budget": "512"}, "integer number of tokens"),
    ({"k": 3}, "allowed: scorer, budget"),
    ("locks", "must be a dict"),
])  # fmt: skip
def test_bad_settings_are_refused_with_the_fix(raw, fragment):
    with pytest.raises(ConfigError, match=fragment):
        rs.parse_request_selection({"locks": raw})
    with pytest.raises(ValueError, match=fragment):  # what vLLM's request validation raises to the caller
        rs.RequestSettings.validate_params(SamplingParams(extra_args={"locks": raw}))


def test_the_engine_switch_is_the_processor_in_logits_processors():
    def config(listed):
        return SimpleNamespace(model_config=SimpleNamespace(logits_processors=listed))

    assert per_request_enabled(config([REQUEST_SETTINGS_PROCESSOR])) and per_request_enabled(config([rs.RequestSettings]))
    assert not per_request_enabled(config(None)) and not per_request_enabled(config(["other.module:RequestSettings"]))


def _added(index, selection_args, prompt_len):
    return (index, SamplingParams(extra_args=selection_args), list(range(prompt_len)), [])


def test_slots_follow_adds_removals_swaps_and_moves_like_a_list_model():
    """Random batch updates against a plain list model of the persistent batch."""
    processor = rs.RequestSettings(None, torch.device("cpu"), False)
    rng = random.Random(0)
    model: list[tuple | None] = [None] * 8
    for _ in range(200):
        removed = [i for i in range(8) if model[i] is not None and rng.random() < 0.2]
        for i in removed:
            model[i] = None
        added = []
        for i in range(8):  # vLLM reports a slot refilled in the same update as added only, never also removed
            if model[i] is None and i not in removed and rng.random() < 0.4:
                setting = rng.choice([None, {"scorer": "dense"}, {"scorer": "quest", "budget": 64}])
                args = None if setting is None else {"locks": setting}
                model[i] = (rs.parse_request_selection(args), 10 + i)
                added.append(_added(i, args, 10 + i))
        moved = []
        if rng.random() < 0.5:
            a, b = rng.sample(range(8), 2)
            model[a], model[b] = model[b], model[a]
            moved.append((a, b, MoveDirectionality.SWAP))
        processor.update_state(BatchUpdate(8, removed, added, moved))
        expected = {i: m for i, m in enumerate(model) if m is not None and m[0] is not None}
        assert {i: (s.selection, s.prompt_len) for i, s in processor.slots.items() if s.selection is not None} == expected


def test_rows_group_by_selection_and_a_prompt_tail_row_is_exact():
    processor = rs.RequestSettings(None, torch.device("cpu"), False)
    processor.update_state(BatchUpdate(4, [], [
        _added(0, {"locks": {"scorer": "quest", "budget": 64}}, 40),
        _added(1, None, 40),
        _added(2, {"locks": {"scorer": "quest", "budget": 64}}, 40),
        _added(3, {"locks": {"scorer": "oracle"}}, 99),
    ], []))  # fmt: skip
    # row 3's sequence is still its prompt (a one-token tail after a prefix-cache hit): exact; row 4 is padding
    groups = rs.row_groups(5, [41, 50, 60, 99, 0], DEFAULT, torch.device("cpu"))
    by_label = {g.selection.label(): g.host_rows.tolist() for g in groups}
    assert by_label == {"quest b=64": [0, 2], "locks b=2048": [1], "dense": [3]}
    assert all(g.rows.tolist() == g.host_rows.tolist() for g in groups)
    assert {g.selection.label(): g.host_seq_lens.tolist() for g in groups}["quest b=64"] == [41, 60]
    # the same batch one step later: row 3 decodes with its own scorer at the engine's budget
    later = {g.selection.label(): g.host_rows.tolist() for g in rs.row_groups(4, [42, 51, 61, 100], DEFAULT, torch.device("cpu"))}
    assert later["oracle b=2048"] == [3]
    # a batch with only engine-default rows takes the ungrouped fast path
    processor.update_state(BatchUpdate(4, [0, 2, 3], [], []))
    assert rs.row_groups(2, [41, 50], DEFAULT, torch.device("cpu")) is None
