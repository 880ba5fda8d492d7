"""sparse_paged_decode (Triton) vs paged_decode_reference (fp64) over scrambled paged caches."""

from __future__ import annotations

import pytest
import torch

from locks_toolkit.kernels.reference.testing import fresh_seed
from locks_toolkit.kernels.triton.checks import DECODE_CASES, available_devices, check_decode

DEVICES = available_devices() or [pytest.param("none", marks=pytest.mark.skip(reason="needs TRITON_INTERPRET=1 or a GPU"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"G{c.group}-d{c.head_dim}-k{c.page_budget}-Hkv{c.num_kv_heads}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_sparse_decode_matches_reference(device, case, dtype):
    result = check_decode(device, case, fresh_seed(), dtype)
    print(result)
    assert result.ok, str(result)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", DECODE_CASES[:3], ids=lambda c: f"G{c.group}-d{c.head_dim}-k{c.page_budget}-Hkv{c.num_kv_heads}")
@pytest.mark.parametrize("merge_in_decode", [True, False], ids=["merged-by-last-split", "merge-kernel"])
def test_repeated_calls_on_one_workspace_match_reference(device, case, merge_in_decode):
    """Three calls on one workspace: the in-kernel merge's arrival counters must return to zero after each
    (a stale count makes the wrong split merge, before the others' partials exist); the two-launch merge
    (the path before session 5) stays correct too."""
    result = check_decode(device, case, fresh_seed(), torch.float32, merge_in_decode=merge_in_decode, calls=3)
    assert result.ok, str(result)
