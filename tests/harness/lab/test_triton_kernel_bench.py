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
    # the decode's two kernels, each with its own floor: the partials are written by one and read by the other
    partials = 32 * 32 * 129 * 4
    assert nbytes["merge"] == partials + 32 * 128 * 2 and nbytes["decode"] == nbytes["decode_pages"] + nbytes["merge"]
    assert nbytes["decode_pages"] - 4 * 128 * 8192 == partials + 32 * 128 * 2
    h200_copy_bytes_per_s = 4.23e12  # the issue's floors: the H200's measured copy bandwidth
    floor_us = 1e6 * nbytes["locks_step"] / h200_copy_bytes_per_s
    assert 7.0 < floor_us < 9.5
    dense_floor_us = 1e6 * nbytes["dense"] / h200_copy_bytes_per_s
    assert 60 < dense_floor_us < 70  # the issue's dense floor: 67 µs


def _record(status="ok", checks_ok=True):
    timings = {name: {"mean_us": us} for name, us in
               (("build", 900.0), ("score", 9.0), ("select", 3.0), ("select_flat", 4.0), ("decode", 2.0), ("merge", 0.7), ("locks_step", 15.0),
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
    assert "| 128k | 1 |" in table and "4.67x (fa3)" in table and "| 3.0 (4.0) |" in table and "(50%; 0.7)" in table
    failed = kb.markdown_table([_record(status="error", checks_ok=False)])
    assert "x (" not in failed and "FAILED" in failed


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_cli_refuses_without_gpu():
    from locks_toolkit.locks_cli.main import app
    from typer.testing import CliRunner

    result = CliRunner().invoke(app, ["bench", "kernel", "--contexts", "32k", "--batch", "1"])
    assert result.exit_code == 2
    assert "needs a CUDA GPU" in result.output


def test_the_bench_times_the_kernels_the_backend_resolves():
    """Defaults are the backend's settings, resolved by the backend's own code: the CUDA scorer (Triton transposed
    where it declines) and the merge selection."""
    from locks_toolkit.kernels.score.pages import DEFAULT_TUNING
    from locks_toolkit.kernels.vllm_backend.kernel_ops import TritonOps
    from locks_toolkit.kernels.vllm_backend.settings import BackendSettings

    cfg = kb.KernelBenchConfig(preset="glm4-9b-1m", contexts=(32768,), batch_sizes=(1,))
    tuning = kb.resolve_tuning(cfg)
    settings = BackendSettings()
    assert tuning == TritonOps(settings.select, settings.scorer_kernel).tuning
    assert tuning.cuda and tuning.transposed and tuning != DEFAULT_TUNING  # not the kernel-level defaults
    assert tuning.select_path == "merge"
    pinned = kb.resolve_tuning(kb.KernelBenchConfig(preset="glm4-9b-1m", contexts=(32768,), batch_sizes=(1,),
                                                    select="chunked", scorer_kernel="pages"))
    assert pinned.select_path == "chunked" and not pinned.cuda and not pinned.transposed


def test_the_record_names_the_score_kernel_that_takes_the_call():
    """Off sm_90 (here: the CPU) the CUDA kernel declines and the transposed Triton kernel runs; a format
    without int4 words runs the pages kernel."""
    from locks_toolkit.kernels.build.packing import SummaryLayout as Layout

    cfg = kb.KernelBenchConfig(preset="glm4-9b-1m", contexts=(32768,), batch_sizes=(1,))
    tuning = kb.resolve_tuning(cfg)
    q = torch.zeros(1, 32, 128, dtype=torch.bfloat16)
    r8i4 = Layout(SummaryFormat.parse("r8i4"), 128)
    rows = torch.zeros(8, 4, r8i4.row_bytes, dtype=torch.uint8)
    assert kb.kernels_that_run(q, rows, r8i4, 8, tuning) == {"score": "transposed", "select": "merge"}
    r8i8 = Layout(SummaryFormat.parse("r8i8"), 128)
    rows8 = torch.zeros(8, 4, r8i8.row_bytes, dtype=torch.uint8)
    assert kb.kernels_that_run(q, rows8, r8i8, 8, tuning)["score"] == "pages"


def test_unknown_kernel_settings_are_refused_with_the_choices():
    with pytest.raises(ConfigError, match="select 'three' unknown; use one of auto"):
        kb.KernelBenchConfig(preset="glm4-9b-1m", contexts=(32768,), batch_sizes=(1,), select="three")
    with pytest.raises(ConfigError, match="scorer kernel 'lean' unknown"):
        kb.KernelBenchConfig(preset="glm4-9b-1m", contexts=(32768,), batch_sizes=(1,), scorer_kernel="lean")


def test_a_cell_names_only_the_settings_that_differ_from_the_deployed_ones():
    deployed = kb.KernelBenchConfig(preset="glm4-9b-1m", contexts=(32768,), batch_sizes=(1,))
    assert kb.kernel_settings(deployed) == {}
    other = kb.KernelBenchConfig(preset="glm4-9b-1m", contexts=(32768,), batch_sizes=(1,), select="chunked",
                                scorer_kernel="pages")
    assert kb.kernel_settings(other) == {"select": "chunked", "scorer_kernel": "pages"}
    from locks_toolkit.reports.kernel import kernel_frame

    record = {"schema": "locks.bench.kernel/1", "status": "ok", "us_per_layer": 8.0,
              "cell": {"preset": "glm4-9b-1m", "format": "r8i4", "context_tokens": 1024, "batch_size": 1,
                       "budget_tokens": 256, "stage": "score", **kb.kernel_settings(other)}}
    assert kernel_frame([record]).iloc[0]["geometry"] == "glm4-9b-1m r8i4 [select=chunked,scorer_kernel=pages]"
