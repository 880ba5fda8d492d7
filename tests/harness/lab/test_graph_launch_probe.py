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


def _branch_cells(layers: int, us: dict[str, float], wrong: str | None = None) -> list[dict]:
    cells = []
    for mode in probe.BRANCH_MODES:
        ran = probe.expected_kernels(mode, layers)
        if mode == wrong:  # the flag said dense, the sparse body ran as well
            ran = {"dense_kernels": ran["dense_kernels"], "sparse_kernels": probe.SPARSE_KERNELS * layers}
        cells.append({"layers": layers, "mode": mode, "idle_to_done_us": us[mode] * layers, **ran})
    return cells


def test_branch_summary_prices_each_way_of_choosing_against_the_path_it_runs():
    rng = random.Random(5)
    dense, sparse = rng.uniform(1.5, 3.0), rng.uniform(4.0, 6.0)
    us = {"dense": dense, "sparse": sparse, "both": dense + sparse, "branch_dense": dense + 0.4,
          "branch_sparse": sparse + 0.7}
    fit = probe.summarize_branches(_branch_cells(40, us))
    assert fit["both_over_dense_us"] == pytest.approx(sparse)
    assert fit["branch_over_dense_us"] == pytest.approx(0.4) and fit["branch_over_sparse_us"] == pytest.approx(0.7)
    assert fit["branches_ran_as_flagged"]
    assert "IF/ELSE +0.40 µs (dense) / +0.70 µs (sparse)" in probe.branch_markdown(_branch_cells(40, us), fit)
    assert not probe.summarize_branches(_branch_cells(40, us, wrong="branch_dense"))["branches_ran_as_flagged"]
    with pytest.raises(ValueError, match="lack modes"):
        probe.summarize_branches(_branch_cells(40, us)[:-1])


def test_a_negative_layer_count_is_refused_before_any_gpu_work(tmp_path):
    out = tmp_path / "probe.jsonl"
    assert probe.main(["--branches", "-3", "--out", str(out)]) == 2 and not out.exists()
