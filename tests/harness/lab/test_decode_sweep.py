"""The decode sweep's pieces that run without a GPU: the pages it attends, its table, its CLI errors."""

from __future__ import annotations

from dataclasses import asdict

import torch


def test_attended_pages_are_sink_recent_and_distinct_pages_between_in_order():
    from locks_toolkit.harness.lab.decode_sweep import attended_pages

    pages, k = 40, 9
    sel = attended_pages(2, 3, pages, k, torch.Generator().manual_seed(5))
    assert sel.shape == (2, 3, k) and sel.dtype == torch.int32
    rows = sel.reshape(6, k)
    assert bool((rows[:, 0] == 0).all()) and bool((rows[:, -1] == pages - 1).all())
    assert bool((rows[:, 1:] > rows[:, :-1]).all())  # ascending, so distinct
    assert len({tuple(r.tolist()) for r in rows}) > 1  # each pair draws its own pages


def test_markdown_lists_each_shape_with_its_kernels_and_failures():
    from locks_toolkit.harness.lab.decode_sweep import markdown
    from locks_toolkit.kernels.decode.kernel import DecodeTuning

    ok = {"tuning": asdict(DecodeTuning(pages_per_iter=4, warps=4, stages=1)), "context_tokens": 32768,
          "batch_size": 1, "splits": 32, "status": "ok", "alone_us": 6.123, "sd_us": 0.05, "in_layer_us": 7.456,
          "rest_us": 140.0, "max_error": 0.0039,
          "kernel_us": {"_sparse_decode_kernel": 4.4, "_merge_kernel": 2.1, "nvjet_sm90_gemv": 30.0}}
    bad = {"tuning": asdict(DecodeTuning(pages_per_iter=8, max_splits=16, merge_eager=False)), "context_tokens": 32768, "batch_size": 1,
           "splits": 16, "status": "wrong", "reason": "max |out - ref| = 0.5"}
    lines = markdown([ok, bad]).splitlines()
    assert "| 4 pages/iter, ≤ 32 splits, 4 warps, 1 stages, eager merge | 32 | 6.12 ± 0.05 | 7.46 (140.0) |" in lines[2]
    assert "_sparse_decode_kernel 4.4, _merge_kernel 2.1 |" in lines[2] and "nvjet" not in lines[2]
    assert "| 8 pages/iter, ≤ 16 splits" in lines[3] and "wrong: max |out - ref| = 0.5" in lines[3]


def test_pick_names_a_variant_that_does_not_exist(capsys):
    from locks_toolkit.harness.lab.decode_sweep import VARIANTS, main

    assert main(["--pick", f"1,{len(VARIANTS)}"]) == 2
    assert f"must be comma-separated indices below {len(VARIANTS)}" in capsys.readouterr().err


def test_a_tuning_that_cannot_launch_is_refused_with_its_reason():
    import pytest
    from locks_toolkit.kernels.decode.kernel import DecodeTuning

    with pytest.raises(ValueError, match="pages_per_iter must be a power of two"):
        DecodeTuning(pages_per_iter=3)
    with pytest.raises(ValueError, match="max_splits and waves must be >= 1"):
        DecodeTuning(max_splits=0)
