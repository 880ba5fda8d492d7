"""The score probe's instruments on a CPU machine: each variant compiles to the kernel it claims to be (NVRTC for
sm_90), the deployed program count is the one `ops` launches, and the table names every row's outcome. Its timings
come from the GPU only (`docs/lease/score-probe.sh`)."""

from __future__ import annotations

import pytest
from locks_toolkit.harness.lab import compile_report
from locks_toolkit.harness.lab.score_probe import VARIANTS, markdown
from locks_toolkit.kernels import ops


def _report(defines):
    return compile_report.cuda_score_report(1, defines=defines)


def test_the_probe_variants_remove_what_they_name():
    """Loads only: the tile loop keeps its bulk copy and drops every mma; arithmetic only: it keeps the mma and
    drops the copy (at two stages and at three); the deployed build (no macro) keeps both."""
    by_name = {v.name: v for v in VARIANTS}
    deployed = _report(by_name["deployed"].defines)["loop_opcodes"]
    loads = _report(by_name["loads_only"].defines)["loop_opcodes"]
    math = _report(by_name["math_only"].defines)["loop_opcodes"]
    assert deployed.get("UBLKCP") == 1 and deployed.get("IMMA") == 40
    assert loads.get("UBLKCP") == 1 and "IMMA" not in loads and "HMMA" not in loads
    assert "UBLKCP" not in math and math.get("IMMA") == 40
    # the same instruments over three stages
    loads3 = _report(by_name["loads_only_stages_3"].defines)["loop_opcodes"]
    math3 = _report(by_name["math_only_stages_3"].defines)["loop_opcodes"]
    assert loads3.get("UBLKCP") == 1 and "IMMA" not in loads3
    assert "UBLKCP" not in math3 and math3.get("IMMA") == 40


@pytest.mark.parametrize("stages", [2, 4])
def test_other_stage_counts_keep_the_loop_without_spills(stages):
    report = _report((("STAGES", stages),))
    assert report["loop_mma"] == 48 and report["loop_spill_accesses"] == 0


def test_twenty_warps_an_sm_fit_the_register_cap_at_g8():
    """The warps_20 variant caps registers at 65536 / (20 x 32) = 102: the G <= 8 build (100 registers at 16 warps)
    must fit that without spilling, or the variant would time spills instead of occupancy."""
    by_name = {v.name: v for v in VARIANTS}
    report = _report(by_name["warps_20"].defines)
    assert report["registers"] <= 65536 // (32 * 20) and report["loop_spill_accesses"] == 0
    assert report["loop_mma"] == 48


def test_score_grid_fills_one_wave_of_program_slots():
    """132 SMs x 4 programs: 4 pairs (512K bs1) get 132 programs each, 64 pairs (32K x 16) 8, and a short table
    no more than one 16-page step per program."""
    assert ops.score_grid_chunks(4, 32769, 132, 4, 16, 512) == 132
    assert ops.score_grid_chunks(64, 2049, 132, 4, 16, 512) == 8
    assert ops.score_grid_chunks(4, 33, 132, 4, 16, 512) == 3
    assert ops.score_grid_chunks(1024, 2049, 132, 4, 16, 512) == 1


def test_markdown_rows_give_times_floors_and_failures():
    cell = {"context_tokens": 524288, "batch_size": 1}
    ok = {"cell": cell, "variant": {"name": "stages_4"}, "chunks": 132, "status": "ok", "floor_us": 37.4,
          "timing_us": {"mean_us": 46.8, "sd_us": 0.3}, "floor_fraction": 37.4 / 46.8, "max_abs_diff": 0.0}
    failed = {"cell": cell, "variant": {"name": "math_only"}, "chunks": 132, "status": "error", "reason": "boom"}
    table = markdown([ok, failed]).splitlines()
    assert table[2] == "| 512k | 1 | stages_4 | 132 | 46.8 (0.3) | 37.4 | 80% | largest score difference 0 |"
    assert table[3].startswith("| 512k | 1 | math_only | 132 | error |") and "boom" in table[3]


def test_variants_scale_programs_within_capacity_and_order_blocks():
    import torch

    by_name = {v.name: v for v in VARIANTS}
    assert by_name["programs_x2"].programs(132) == 264 and by_name["programs_x2"].programs(300) == 512
    assert by_name["programs_half"].programs(1) == 1 and by_name["deployed"].programs(8) == 8
    table = torch.tensor([[5, 2, 9], [7, 1, 3]], dtype=torch.int32)
    assert by_name["blocks_in_order"].table(table).tolist() == [[2, 5, 9], [1, 3, 7]]
    assert by_name["deployed"].table(table) is table


def test_what_if_instruments_change_only_what_they_price():
    """scale_pairs: the tile loop reads each page's scales in 3 shared loads instead of 6 (12 fewer a tile), the
    mma count unchanged; q_raw: the prologue loses the digit conversion and the loop keeps its mma; no_mufu: the loop
    keeps its mma and issues no MUFU; the arithmetic at 20 warps an SM fits the 102-register cap and issues no copy."""
    by_name = {v.name: v for v in VARIANTS}
    deployed = _report(())
    pairs = _report(by_name["scale_pairs"].defines)
    raw = _report(by_name["q_raw"].defines)
    math20 = _report(by_name["math_only_warps_20"].defines)
    no_mufu = _report(by_name["no_mufu"].defines)
    assert deployed["loop_opcodes"]["LDS"] - pairs["loop_opcodes"]["LDS"] == 12
    assert pairs["loop_mma"] == deployed["loop_mma"] and pairs["loop_spill_accesses"] == 0
    assert raw["prologue_instructions"] < deployed["prologue_instructions"] / 2 and raw["loop_mma"] == 48
    assert math20["registers"] <= 65536 // (32 * 20) and "UBLKCP" not in math20["loop_opcodes"]
    assert "MUFU" in deployed["loop_opcodes"] and "MUFU" not in no_mufu["loop_opcodes"]
    assert no_mufu["loop_mma"] == 48
