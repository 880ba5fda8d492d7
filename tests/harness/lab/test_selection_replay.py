"""harness/lab/selection_replay.py without an engine: the key statistics and the command line's checks.
(The replay of a real backend capture is tested in test_vllm_backend_impl.py.)"""

from __future__ import annotations

import pytest
import torch
from locks_toolkit.harness.lab import selection_replay
from locks_toolkit.kernels.config import PAGE_SIZE
from locks_toolkit.kernels.select import chunked as topk


def test_key_stats_describe_the_threshold_bin():
    low = 1 << topk.LOW_BITS
    # one sequence of 7 pages (recent page 6), two KV heads; k = 4: sink + recent + the 2 best of pages 1..5
    keys = torch.zeros((2, 8), dtype=torch.int32)
    keys[0, 1:6] = torch.tensor([9 * low + 5, 7 * low + 3, 7 * low + 3, 7 * low + 1, 2 * low])  # threshold 7*low+3, tied
    keys[1, 1:6] = torch.tensor([3 * low, 3 * low, 3 * low, 3 * low, 3 * low])  # flat: everything ties
    keys[:, 0] = keys[:, 6:] = 10**6  # sink / recent / beyond: never contested
    seq_lens = torch.tensor([6 * PAGE_SIZE + 1])
    first, flat = selection_replay.key_stats(keys, seq_lens, num_kv_heads=2, page_budget=4)
    assert first == {"seq": 0, "head": 0, "contested": 5, "above_bin": 1, "in_threshold_bin": 3,
                     "distinct_low_in_bin": 2, "tied_at_threshold": 2, "distinct_bins": 3}
    assert flat == {"seq": 0, "head": 1, "contested": 5, "above_bin": 0, "in_threshold_bin": 5,
                    "distinct_low_in_bin": 1, "tied_at_threshold": 5, "distinct_bins": 1}
    # a sequence that fits the budget has no threshold search
    assert selection_replay.key_stats(keys, torch.tensor([3 * PAGE_SIZE]), num_kv_heads=2, page_budget=4) == []


@pytest.mark.parametrize("argv, message", [(["--paths", "chunked,fast"], "unknown path(s) ['fast']"),
                                           (["--layers", "2", "--capture-layer", "2"], "--capture-layer 2 must be below --layers 2")])
def test_command_line_names_the_fix(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        selection_replay.main(argv)
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_replay_refuses_a_capture_without_summary_rows():
    with pytest.raises(ValueError, match="no summary rows"):
        selection_replay.replay_capture({"selection": {}, "summary_rows": None}, selection_replay.path_tunings())
