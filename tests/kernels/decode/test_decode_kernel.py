"""sparse_paged_decode (Triton) vs paged_decode_reference (fp64) over scrambled paged caches."""

from __future__ import annotations

import pytest
import torch
from locks_toolkit.kernels.checks import DECODE_CASES, DECODE_TUNINGS, available_devices, check_decode
from locks_toolkit.kernels.testing import fresh_seed

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
