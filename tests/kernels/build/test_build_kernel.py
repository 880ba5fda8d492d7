"""build_summaries (Triton) vs build_page_summaries + pack_summaries, on fresh random pages."""

from __future__ import annotations

import pytest
import torch
from locks_toolkit.kernels.checks import BUILD_CASES, LOW_RANK_CASES, available_devices, check_build
from locks_toolkit.kernels.testing import fresh_seed

DEVICES = available_devices() or [pytest.param("none", marks=pytest.mark.skip(reason="needs TRITON_INTERPRET=1 or a GPU"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("fmt", "head_dim", "dtype"), BUILD_CASES)
def test_build_matches_reference(device, fmt, head_dim, dtype):
    result = check_build(device, fmt, head_dim, dtype, fresh_seed(), num_kv_heads=1, num_pages=2)
    print(result)
    assert result.ok, str(result)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("fmt", "page_rank"), LOW_RANK_CASES)
def test_build_is_exact_when_rank_covers_the_page(device, fmt, page_rank):
    result = check_build(device, fmt, 64, torch.float32, fresh_seed(), low_rank=page_rank, num_kv_heads=1, num_pages=2)
    print(result)
    assert result.ok, str(result)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_identical_and_near_identical_key_pages_build_finite_rows_that_score_exactly(device, dtype):
    """A page of 16 equal keys has a Gram of pure round-off (fp32 eigh returns NaN or fails on it): the kernel must
    write finite rows with no modes, and the page must score q . mu * scale + log 16 up to the centroid's int8 step.
    A page equal up to one rounding step must score within the same bound plus its tiny deviations."""
    from locks_toolkit.kernels import ops
    from locks_toolkit.kernels.build.packing import SummaryLayout, unpack_summaries
    from locks_toolkit.kernels.config import SummaryFormat
    from locks_toolkit.kernels.score.reference import exact_page_scores, summary_page_scores
    from locks_toolkit.kernels.testing import generator

    seed = fresh_seed()
    gen = generator(seed)
    dim, B = 128, 16
    layout = SummaryLayout(SummaryFormat.parse("r8i4"), dim)
    key = torch.randn(dim, generator=gen) * 3 + 1
    constant = key.expand(B, dim)
    near = key + key.abs() * 2.0**-8 * torch.randint(-1, 2, (B, dim), generator=gen)  # within one bf16 ulp or so
    pages = torch.stack((constant, near, torch.randn((B, dim), generator=gen))).to(dtype)  # [P, B, d]
    k_cache = torch.cat((pages, pages[:1])).unsqueeze(2).contiguous()  # [blocks, B, Hkv=1, d]; block 3 not built
    rows = torch.full((4, 1, layout.row_bytes), 0xAB, dtype=torch.uint8, device=device)
    ops.build_summaries(k_cache.to(device), torch.arange(3, dtype=torch.int32, device=device), rows, layout)
    rows = rows.cpu()
    assert bool((rows[3] == 0xAB).all()), "a block not in block_ids was written"
    summaries = unpack_summaries(rows[:3].transpose(0, 1), layout)  # [Hkv=1, P, ...]
    for tensor in (summaries.centroid, summaries.basis, summaries.coefficients):
        assert torch.isfinite(tensor).all(), f"seed {seed}: non-finite summary"
    assert torch.count_nonzero(summaries.coefficients[0, 0]) == 0 and torch.count_nonzero(summaries.basis[0, 0]) == 0
    constant_key = pages[0, 0].float()
    assert torch.allclose(summaries.centroid[0, 0], constant_key, atol=constant_key.abs().max().item() / 127)
    q = torch.randn((1, 4, dim), generator=gen)
    q64 = q.double()
    scale = dim**-0.5
    got = summary_page_scores(q, summaries, scale).double()  # [1, G, P]
    keys = pages.double().unsqueeze(0)
    exact = exact_page_scores(q64, keys, scale)
    mu_step = keys.mean(-2).abs().amax(-1) / 127  # [1, P]: the centroid's int8 step
    deviation = (keys - keys.mean(-2, keepdim=True)).norm(dim=-1).amax(-1)  # [1, P]
    tol = scale * (q64.abs().sum(-1, keepdim=True) * mu_step + 2 * q64.norm(dim=-1, keepdim=True) * deviation)
    err = (got - exact).abs()[..., :2]
    assert bool((err <= tol[..., :2] + 1e-5).all()), f"seed {seed}: score error {err.tolist()} over {tol[..., :2].tolist()}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("fmt", "head_dim", "dtype", "num_kv_heads", "num_pages", "low_rank"), [
    ("r8i4", 128, torch.bfloat16, 3, 4, None),  # 15 (block, head) items: the last tile is partial
    ("r8fp", 64, torch.float32, 1, 2, None),  # 3 items, one of them a skipped block id
    ("r4i8", 64, torch.float32, 2, 3, 4),
])
def test_build_with_several_pages_per_program(device, fmt, head_dim, dtype, num_kv_heads, num_pages, low_rank,
                                              monkeypatch):
    """Two pages per program on a small case: tiles mix heads, blocks and -1 ids, and stop sweeping together."""
    from locks_toolkit.kernels.build import kernel as build

    monkeypatch.setattr(build, "SMALL_BUILD_ITEMS", 0)
    monkeypatch.setattr(build, "PAGES_PER_PROGRAM", 2)  # the tuning option the kernel bench can try
    assert build.build_tile(1) == 2
    result = check_build(device, fmt, head_dim, dtype, fresh_seed(), low_rank=low_rank,
                         num_kv_heads=num_kv_heads, num_pages=num_pages)
    print(result)
    assert result.ok, str(result)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("fmt", "dtype"), [("r8i4", torch.bfloat16), ("r4fp", torch.float32)])
def test_one_launch_builds_every_layer_like_per_layer_builds(device, fmt, dtype):
    """build_summaries_layers over 3 layers (own keys each) writes exactly what 3 build_summaries calls write,
    and only the rows of the given blocks (a -1 id is skipped)."""
    from locks_toolkit.kernels import ops
    from locks_toolkit.kernels.build.packing import SummaryLayout
    from locks_toolkit.kernels.config import SummaryFormat

    gen = torch.Generator().manual_seed(fresh_seed())
    layout = SummaryLayout(SummaryFormat.parse(fmt), 64)
    caches = [(torch.randn((5, 16, 2, 64), generator=gen) * 3).to(dtype).to(device) for _ in range(3)]
    rows = [torch.full((5, 2, layout.row_bytes), 0xCD, dtype=torch.uint8, device=device) for _ in range(3)]
    expected = [r.clone() for r in rows]
    ids = torch.tensor([3, -1, 0], dtype=torch.int32, device=device)
    for k, want in zip(caches, expected):
        ops.build_summaries(k, ids, want, layout)
    ops.build_summaries_layers(ops.layer_tables(caches, rows, layout), ids, layout)
    for got, want in zip(rows, expected):
        assert torch.equal(got.cpu(), want.cpu())
    assert bool((rows[1][[1, 2, 4]] == 0xCD).all())


def test_layer_tables_refuse_mismatched_layers():
    from locks_toolkit.kernels import ops
    from locks_toolkit.kernels.build.packing import SummaryLayout
    from locks_toolkit.kernels.config import SummaryFormat

    layout = SummaryLayout(SummaryFormat.parse("r8i4"), 64)
    rows = [torch.zeros((5, 2, layout.row_bytes), dtype=torch.uint8) for _ in range(2)]
    caches = [torch.zeros((5, 16, 2, 64)), torch.zeros((6, 16, 2, 64))]
    with pytest.raises(ValueError, match="layer 0"):
        ops.layer_tables(caches, rows, layout)


def test_float16_centroid_step_admits_one_rounding_flip_and_no_more():
    """Two fp32 sums of the same keys may round one float16 element to neighbouring values: the check's step must
    admit one ulp at the centroid's absmax and refuse two."""
    from locks_toolkit.kernels.checks import centroid_step
    from locks_toolkit.kernels.testing import generator

    gen = generator(fresh_seed())
    ref = (torch.randn((3, 64), generator=gen) * 4).to(torch.float16)
    top = ref.abs().argmax(-1)
    rows = torch.arange(3)
    step = centroid_step(ref.float(), quantized=False)[:, 0]
    bits = ref.view(torch.int16)
    for ulps, admitted in ((1, True), (2, False)):
        moved = bits.clone()
        moved[rows, top] += ulps  # away from zero for either sign: the magnitude's bits grow
        diff = (moved.view(torch.float16).float() - ref.float())[rows, top].abs()
        assert bool((diff <= 1.01 * step).all()) == admitted, (ulps, diff, step)
