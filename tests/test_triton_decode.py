"""sparse_paged_decode (Triton) vs paged_decode_reference (fp64) over scrambled paged caches."""

from __future__ import annotations

import pytest
import torch

from locks_toolkit.kernels.reference.testing import fresh_seed
from locks_toolkit.kernels.triton.checks import DECODE_CASES, DECODE_TUNINGS, available_devices, check_decode

DEVICES = available_devices() or [pytest.param("none", marks=pytest.mark.skip(reason="needs TRITON_INTERPRET=1 or a GPU"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"G{c.group}-d{c.head_dim}-k{c.page_budget}-Hkv{c.num_kv_heads}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_sparse_decode_matches_reference(device, case, dtype):
    result = check_decode(device, case, fresh_seed(), dtype)
    print(result)
    assert result.ok, str(result)



@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tuning", DECODE_TUNINGS, ids=str)
@pytest.mark.parametrize("case", DECODE_CASES[1:4], ids=lambda c: f"G{c.group}-d{c.head_dim}-k{c.page_budget}-Hkv{c.num_kv_heads}")
def test_sparse_decode_launch_shapes_match_reference(device, tuning, case):
    """Other launch shapes (pages per iteration, split counts, the eager merge) give the reference's output."""
    result = check_decode(device, case, fresh_seed(), torch.bfloat16, tuning=tuning)
    assert result.ok, str(result)


def test_fused_merge_fits_its_grid_on_the_gpu_at_one_program_per_sm():
    from locks_toolkit.kernels.triton.ops import fused_fit

    assert fused_fit(32, 132, 4, 8) == (25, True)  # bs1, 4 KV heads, G = 8: 4 x (25 + 8) = 132 programs
    assert fused_fit(16, 132, 4, 8) == (16, True)
    assert fused_fit(9, 132, 32, 8) == (9, False)  # bs8: no room for even one split beside 8 mergers


@pytest.mark.parametrize("device", DEVICES)
def test_fused_merge_re_arms_its_counters_for_the_next_launch(device):
    """Two launches on one workspace (as consecutive layers run): both right, counters back at zero."""
    from locks_toolkit.kernels.triton.decode import DecodeTuning

    from locks_toolkit.kernels.triton import ops

    tuning = DecodeTuning(pages_per_iter=2, warps=4, fused_merge=True)
    case = DECODE_CASES[1]
    ws = ops.decode_workspace(len(case.seq_lens), case.num_kv_heads * case.group, case.head_dim, device)
    for seed in (fresh_seed(), fresh_seed()):
        result = check_decode(device, case, seed, torch.bfloat16, tuning=tuning, workspace=ws)
        assert result.ok, str(result)
