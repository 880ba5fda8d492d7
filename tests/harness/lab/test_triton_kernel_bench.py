"""The pure parts of `locks bench kernel`: geometry presets, the bytes model, the table, the CLI refusal."""

from __future__ import annotations

import pytest
import torch
from locks_toolkit.harness.lab import kernel_bench as kb
from locks_toolkit.kernels.build.packing import SummaryLayout
from locks_toolkit.kernels.config import ConfigError, SummaryFormat


def test_glm_geometry_and_aliases():
    geom = kb.resolve_geometry("glm4-9b-1m")
    assert (geom.num_layers, geom.num_q_heads, geom.num_kv_heads, geom.head_dim) == (40, 32, 4, 128)
    assert kb.resolve_geometry("gemma-3-4b").head_dim == 256
    with pytest.raises(ConfigError, match="unknown"):
        kb.resolve_geometry("no-such-model")


def test_bytes_model_matches_the_issue_floor_at_128k():
    """GLM-4-9B, 128K + 1 token, b=2048, r8i4: ~27 MB of rows + 4 MB of selected KV -> ~8 µs at 4.23 TB/s."""
    geom = kb.resolve_geometry("glm4-9b-1m")
    layout = SummaryLayout(SummaryFormat.parse("r8i4"), 128)
    seq_len = 128 * 1024 + 1
    nbytes = kb.stage_bytes(geom, layout, seq_len, batch=1, page_budget=128, splits=32)
    assert nbytes["score"] >= 4 * 8192 * 832
    assert 4 * 128 * 8192 <= nbytes["decode"] <= 4 * 128 * 8192 * 1.3  # + split-K partials
    floor_us = 1e6 * nbytes["locks_step"] / kb.HBM_BYTES_PER_S
    assert 7.0 < floor_us < 9.5
    dense_floor_us = 1e6 * nbytes["dense"] / kb.HBM_BYTES_PER_S
    assert 60 < dense_floor_us < 70  # the issue's dense floor: 67 µs


def _record(status="ok", checks_ok=True):
    timings = {name: {"mean_us": us} for name, us in
               (("build", 900.0), ("score", 9.0), ("select", 3.0), ("select_flat", 4.0), ("decode", 2.0), ("locks_step", 15.0),
                ("triton_dense", 80.0), ("fa3", 70.0))}
    return {
        "cell": {"context_tokens": 131072, "batch_size": 1}, "status": status, "reason": None if status == "ok" else "x",
        "timings_us": timings, "floor_fraction": {name: 0.5 for name in timings},
        "floor_us": {name: 7.5 for name in timings}, "build_all_layers_ms": 36.0,
        "speedup_vs_dense": 70.0 / 15.0, "best_dense": "fa3",
        "checks": [{"name": "decode", "ok": checks_ok, "seed": 1, "problems": [] if checks_ok else ["bad"]}],
    }


def test_table_reports_speedup_only_for_good_cells():
    table = kb.markdown_table([_record()])
    assert "| 128k | 1 |" in table and "4.67x (fa3)" in table and "| 3.0 (4.0) |" in table
    failed = kb.markdown_table([_record(status="error", checks_ok=False)])
    assert "x (" not in failed and "FAILED" in failed


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_cli_refuses_without_gpu():
    from locks_toolkit.locks_cli.main import app
    from typer.testing import CliRunner

    result = CliRunner().invoke(app, ["bench", "kernel", "--contexts", "32k", "--batch", "1"])
    assert result.exit_code == 2
    assert "needs a CUDA GPU" in result.output
