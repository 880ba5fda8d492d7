"""The CUDA score kernel on a CPU machine: NVRTC compiles it for sm_90 as production launches it, within its
register budget and with the loop the design counts on, and `fits` says why a call goes to Triton instead.
Its numerics run on the GPU only: `python -m locks_toolkit.harness.lab.kernel_checks --cuda` compares its page
scores and selections with the fp64 reference (18 of 18 on the H200, docs/results/archive/gpu-checks-h200-4bd6718.log)."""

from __future__ import annotations

import pytest
import torch
from locks_toolkit.harness.lab import compile_report
from locks_toolkit.kernels.build.packing import SummaryLayout
from locks_toolkit.kernels.checks import CUDA_CASES, available_devices, check_score_select
from locks_toolkit.kernels.config import SummaryFormat
from locks_toolkit.kernels.score import cuda as cuda_score
from locks_toolkit.kernels.score.pages import SCORER_KERNELS, ScoreTuning
from locks_toolkit.kernels.testing import fresh_seed
from locks_toolkit.kernels.triton_common import RowConstants

R8I4 = RowConstants.of(SummaryLayout(SummaryFormat.parse("r8i4"), 128))


@pytest.mark.parametrize("rows_per_lane", [1, 2])
def test_compiles_for_sm90_with_the_designed_tile_loop(rows_per_lane):
    """Per 4-page tile: the int8 mma of V^T q and q . mu, 2 a k-step over q's four byte pieces with one head per
    lane (G <= 8), 3 over three with two (32 + 8 and 48 + 12), and the tf32 contraction (8 mma, 16 with two heads
    per lane); the rows read from shared memory (39 loads), where one bulk copy per row brought them, and one
    global load (the block ids of a later tile); at most 128 registers (16 warps per SM), no spills; at most 600 /
    840 instructions (the bf16 mma's operands and global loads took 824 / 1000). Before the loop a warp converts q
    to byte digits (32 dims a lane, one or two heads): an add and a LOP3 a dim, a byte transpose and dp4a sums keep
    the whole prologue within 650 / 1000 instructions (the digit-by-digit loop took 1024 / 1475)."""
    report = compile_report.cuda_score_report(rows_per_lane)
    print({k: v for k, v in report.items() if k != "loop_opcodes"})
    ops = report["loop_opcodes"]
    assert report["registers"] <= 65536 // (32 * cuda_score.MIN_WARPS_PER_SM)
    assert ops.get("IMMA") == {1: 40, 2: 60}[rows_per_lane]
    assert report["loop_mma"] == {1: 48, 2: 76}[rows_per_lane]
    assert ops.get("LDS") == 39 and ops.get("UBLKCP") == 1 and report["loop_global_loads"] == 1
    assert report["loop_instructions"] <= {1: 600, 2: 840}[rows_per_lane]
    assert report["loop_spill_accesses"] == 0 and report["stack_bytes"] == 0
    assert report["prologue_instructions"] <= {1: 650, 2: 1000}[rows_per_lane]


def test_compiles_with_64_bit_row_offsets():
    """Summary buffers of 4 GiB and more take 64-bit offsets (only the bulk copies' source addresses): the same
    loop within the same budget."""
    report = compile_report.cuda_score_report(2, rows_under_4gib=False)
    assert report["registers"] <= 128 and report["loop_mma"] == 76 and report["loop_spill_accesses"] == 0


def test_compile_errors_name_the_source():
    with pytest.raises(RuntimeError, match="NVRTC could not compile score_t.cu"):
        cuda_score.compile_cubin(cuda_score.compile_options(R8I4, True) + ["-DROW_OFFSET_T=not_a_type"])


def test_fits_says_why_a_call_goes_to_triton():
    q = torch.zeros((1, 32, 128), dtype=torch.bfloat16)
    rows = torch.zeros((4, 4, R8I4.row_bytes), dtype=torch.uint8)
    assert "not an sm_90 device" in cuda_score.fits(q, rows, R8I4, 8)
    assert "query dtype" in cuda_score.fits(q.float(), rows, R8I4, 8)
    assert "group size 32" in cuda_score.fits(q, rows, R8I4, 32)
    r4i4 = RowConstants.of(SummaryLayout(SummaryFormat.parse("r4i4"), 128))
    assert "format r4i4" in cuda_score.fits(q, rows, r4i4, 8)
    r8i4_d64 = RowConstants.of(SummaryLayout(SummaryFormat.parse("r8i4"), 64))
    assert "d=64" in cuda_score.fits(q[..., :64], rows, r8i4_d64, 8)
    assert cuda_score.lane_rows(8) == 1 and cuda_score.lane_rows(9) == 2 and cuda_score.lane_rows(16) == 2


@pytest.mark.parametrize("device", available_devices() or [pytest.param("none", marks=pytest.mark.skip(reason="needs TRITON_INTERPRET=1 or a GPU"))])
def test_cuda_scorer_tuning_selects_what_the_reference_selects(device):
    """The backend's default tuning on the CUDA kernel's own geometry (G = 16): on a GPU the CUDA kernel
    serves it; in the interpreter the transposed Triton kernel does (fits declines), with the same result."""
    result = check_score_select(device, CUDA_CASES[2], fresh_seed(), torch.bfloat16,
                                tuning=ScoreTuning(**SCORER_KERNELS["cuda"]), second_call=device != "cpu")
    print(result)
    assert result.ok, result
