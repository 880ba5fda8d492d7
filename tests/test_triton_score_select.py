"""score_select (Triton) vs summary_page_scores + combine_group + select_pages on the same packed rows."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from locks_toolkit.kernels.triton.score_select import _nibble_value
from locks_toolkit.kernels.reference.testing import fresh_seed
from locks_toolkit.kernels.triton.checks import MANY_PAGES_CASE, SELECT_CASES, available_devices, check_score_select

DEVICES = available_devices() or [pytest.param("none", marks=pytest.mark.skip(reason="needs TRITON_INTERPRET=1 or a GPU"))]
# Under the interpreter a NaN made anywhere in the kernels (e.g. -inf - -inf for a padded head slot) warns;
# the kernels must not make one, since a NaN key cast to int indexes the histogram out of bounds.
pytestmark = pytest.mark.filterwarnings("error:invalid value encountered:RuntimeWarning")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", SELECT_CASES, ids=lambda c: f"G{c.group}-d{c.head_dim}-{c.fmt}-{c.combine}-k{c.page_budget}"
                         + (f"-wsG{c.workspace_group}" if c.workspace_group else "") + ("-ties" if c.identical_pages else "")
                         + (f"-flat{c.page_noise}" if c.page_noise else ""))
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


@triton.jit
def _decode_nibbles(out_ptr, DT: tl.constexpr):
    n = tl.arange(0, 16)
    tl.store(out_ptr + n, _nibble_value(n, DT).to(tl.float32))


@pytest.mark.parametrize("device", DEVICES)
def test_nibble_value_is_exact(device):
    """_nibble_value (the scorer's int4 decode) gives n - 8 exactly for every code, in each dot dtype.

    The interpreter runs score_select's dots in fp32 only, so the fp16/bf16 branches are checked here
    (bf16 by its bit identity: the interpreter has no bf16 constants)."""
    want = torch.arange(-8, 8, dtype=torch.float32)
    for dtype in (tl.float16, tl.float32) if device == "cpu" else (tl.bfloat16, tl.float16, tl.float32):
        out = torch.full((16,), float("nan"), device=device)
        _decode_nibbles[(1,)](out, DT=dtype)
        assert torch.equal(out.cpu(), want), f"{dtype}: {out.tolist()}"
    codes = torch.arange(16, dtype=torch.int16)
    assert torch.equal(((codes | 0x4300).view(torch.bfloat16) - 136).float(), want)
