"""Programmatic dependent launch of the decode kernels (`ScoreTuning.pdl`, `sparse_paged_decode(pdl=True)`)
on the GPU: each kernel lets the next one launch and waits for the previous one, so a missing or
misplaced wait shows up as a wrong selection or output here. sm_90 only: the interpreter has no
griddepcontrol, so on CPU machines these tests do not run (the CPU tests cover the same kernels
without PDL, and tests/test_triton_compile.py checks that the PDL compile carries both instructions)."""

from __future__ import annotations

import os

import pytest
import torch
from locks_toolkit.kernels.config import SELECT_PATHS
from locks_toolkit.kernels.reference.testing import fresh_seed
from locks_toolkit.kernels.triton.checks import (
    DECODE_CASES,
    MANY_PAGES_CASE,
    SELECT_CASES,
    check_decode,
    check_score_select,
)
from locks_toolkit.kernels.triton.score_select import ScoreTuning

SM90 = (os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.is_available()
        and torch.cuda.get_device_capability()[0] >= 9)
pytestmark = pytest.mark.skipif(not SM90, reason="programmatic dependent launch needs an sm_90 GPU (no interpreter support)")


@pytest.mark.parametrize("case", SELECT_CASES + [MANY_PAGES_CASE], ids=lambda c: f"G{c.group}-{c.fmt}-k{c.page_budget}-n{sum(c.seq_lens)}")
@pytest.mark.parametrize("path", SELECT_PATHS)
def test_score_select_with_pdl_matches_reference(case, path):
    result = check_score_select("cuda", case, fresh_seed(), tuning=ScoreTuning(select_path=path, pdl=True))
    assert result.ok, str(result)


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"G{c.group}-d{c.head_dim}-k{c.page_budget}")
@pytest.mark.parametrize("merge_in_decode", [False, True])
def test_decode_with_pdl_matches_reference(case, merge_in_decode):
    result = check_decode("cuda", case, fresh_seed(), torch.bfloat16, merge_in_decode=merge_in_decode, calls=3, pdl=True)
    assert result.ok, str(result)
