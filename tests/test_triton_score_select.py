"""score_select (Triton) vs summary_page_scores + combine_group + select_pages on the same packed rows."""

from __future__ import annotations

import pytest
import torch

from locks_toolkit.kernels.reference.testing import fresh_seed
from locks_toolkit.kernels.triton.checks import MANY_PAGES_CASE, SELECT_CASES, available_devices, check_score_select

DEVICES = available_devices() or [pytest.param("none", marks=pytest.mark.skip(reason="needs TRITON_INTERPRET=1 or a GPU"))]
# Under the interpreter a NaN made anywhere in the kernels (e.g. -inf - -inf for a padded head slot) warns;
# the kernels must not make one, since a NaN key cast to int indexes the histogram out of bounds.
pytestmark = pytest.mark.filterwarnings("error:invalid value encountered:RuntimeWarning")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", SELECT_CASES, ids=lambda c: f"G{c.group}-d{c.head_dim}-{c.fmt}-{c.combine}-k{c.page_budget}"
                         + (f"-wsG{c.workspace_group}" if c.workspace_group else "") + ("-ties" if c.identical_pages else ""))
def test_score_select_matches_reference(device, case):
    result = check_score_select(device, case, fresh_seed())
    print(result)
    assert result.ok, str(result)


@pytest.mark.parametrize("device", DEVICES)
def test_score_select_many_pages_bf16_query(device):
    """Enough pages that the threshold histogram bin is crowded; bf16 queries."""
    result = check_score_select(device, MANY_PAGES_CASE, fresh_seed(), q_dtype=torch.bfloat16)
    print(result)
    assert result.ok, str(result)
