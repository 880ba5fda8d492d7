"""The graph-launch probe's arithmetic and input checks (the timing itself needs a GPU)."""

from __future__ import annotations

import random

import pytest
from locks_toolkit.harness.lab import graph_launch_probe as probe
from locks_toolkit.kernels.config import ConfigError


def test_fit_recovers_a_noisy_line_and_the_summary_reads_both_timings():
    rng = random.Random(3)
    xs = [100, 300, 550, 750, 1000]
    cells = [{"nodes": x, "replay_call_us": 4.0 + 0.05 * x + rng.uniform(-0.01, 0.01),
              "idle_to_done_us": 9.0 + 1.2 * x + rng.uniform(-0.01, 0.01)} for x in xs]
    fit = probe.summarize(cells)
    assert fit["replay_call_us_per_node"] == pytest.approx(0.05, abs=1e-4)
    assert fit["idle_to_done_us_per_node"] == pytest.approx(1.2, abs=1e-4)
    assert fit["idle_to_done_us_fixed"] == pytest.approx(9.0, abs=0.05)
    table = probe.markdown(cells, fit)
    assert table.count("\n| ") == len(xs) and "1.200 µs" in table
    with pytest.raises(ValueError, match="distinct"):
        probe.fit_line([5, 5], [1, 2])


def test_node_list_needs_two_distinct_positive_counts():
    assert probe.parse_nodes("300,100,300") == [100, 300]
    for bad in ("100", "0,10", "a,b"):
        with pytest.raises(ConfigError):
            probe.parse_nodes(bad)


def test_without_a_gpu_the_probe_says_so_and_writes_nothing(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "probe.jsonl"
    assert probe.main(["--out", str(out)]) == 2 and not out.exists()
