"""The proven statements of locks.md §5, checked numerically on fresh random pages."""

from __future__ import annotations

import math

import pytest
import torch
from locks_toolkit.kernels.build.reference import build_page_summaries
from locks_toolkit.kernels.score.bounds import (
    coverage,
    envelope_gap,
    outlier_capture,
    retention_bound,
    score_error,
    score_error_bounds,
)
from locks_toolkit.kernels.score.reference import exact_page_scores, summary_page_scores
from locks_toolkit.kernels.select.reference import combine_group, select_pages
from locks_toolkit.kernels.testing import gaussian_keys, low_rank_keys, outlier_keys

B = 16
CASES = [(64, 1, 13), (128, 4, 7), (256, 7, 37), (128, 8, 13)]  # (d, G, pages)



def _keys(gen, kind, shape, dtype=torch.float64):
    if kind == "gaussian":
        return gaussian_keys(gen, shape, dtype)
    if kind == "outlier":
        return outlier_keys(gen, shape, dtype=dtype)
    return low_rank_keys(gen, shape, page_rank=3, dtype=dtype)


@pytest.mark.parametrize("dim,groups,pages", CASES)
@pytest.mark.parametrize("kind", ["gaussian", "outlier"])
@pytest.mark.parametrize("rank", [1, 4, 8])
def test_score_error_bound_holds_on_every_page(gen, dim, groups, pages, kind, rank):
    keys = _keys(gen, kind, (2, pages, B, dim))
    q = _keys(gen, kind, (2, 1, groups, dim))[:, 0]
    scale = 1 / math.sqrt(dim)
    summaries = build_page_summaries(keys, rank)
    error = score_error(q, keys, summaries, scale)
    bounds = score_error_bounds(q, keys, summaries, scale)
    slack = 1e-9 * (1 + exact_page_scores(q, keys, scale).abs())
    assert (error <= bounds.tight + slack).all(), f"max violation {(error - bounds.tight).max():.3g}"
    assert (bounds.tight <= bounds.loose + slack).all(), f"tight > loose by {(bounds.tight - bounds.loose).max():.3g}"
    assert error.max() > 1e-6, "a truncated summary of full-rank pages must have some score error"


@pytest.mark.parametrize("dim,groups,pages", CASES)
def test_score_error_and_bound_vanish_when_rank_covers_the_page(gen, dim, groups, pages):
    keys = low_rank_keys(gen, (2, pages, B, dim), page_rank=3, dtype=torch.float64)
    q = torch.randn((2, groups, dim), generator=gen, dtype=torch.float64) * 3
    scale = 1 / math.sqrt(dim)
    for rank in (3, 8):
        summaries = build_page_summaries(keys, rank)
        bounds = score_error_bounds(q, keys, summaries, scale)
        assert score_error(q, keys, summaries, scale).max() < 1e-9
        assert bounds.tight.max() < 1e-9
        # tau is a sum of round-off eigenvalues (~1e-16 lambda_max each); its square root is ~1e-8.
        assert bounds.loose.max() < 1e-4
    truncated = score_error_bounds(q, keys, build_page_summaries(keys, 2), scale)
    assert truncated.loose.min() > 1e-4, "below the page rank the bound must not vanish"


@pytest.mark.parametrize("dim,groups,pages", CASES)
@pytest.mark.parametrize("rank,noise", [(1, None), (4, None), (3, 0.03), (3, 0.1)])
def test_coverage_retention_is_at_least_exp_minus_4_eta(gen, dim, groups, pages, rank, noise):
    # noise=None: full-rank Gaussian pages (large eta); otherwise rank-3 pages plus small noise, so
    # eta is small and exp(-4 eta) is a demanding bound.
    if noise is None:
        keys = gaussian_keys(gen, (4, pages, B, dim), dtype=torch.float64)
    else:
        keys = low_rank_keys(gen, (4, pages, B, dim), page_rank=3, dtype=torch.float64)
        keys = keys + noise * torch.randn(keys.shape, generator=gen, dtype=torch.float64)
    q = torch.randn((4, groups, dim), generator=gen, dtype=torch.float64) * 3
    scale = 1 / math.sqrt(dim)
    k = max(3, pages // 3)
    exact = exact_page_scores(q, keys, scale)
    estimated = summary_page_scores(q, build_page_summaries(keys, rank), scale)
    eta = (estimated - exact).abs().amax(dim=(-1, -2))  # per leading index
    chosen = select_pages(combine_group(estimated, "share_average"), pages, k)
    best = select_pages(combine_group(exact, "share_average"), pages, k)
    kept = coverage(exact, chosen).mean(-1)
    optimum = coverage(exact, best).mean(-1)
    assert (kept <= optimum + 1e-12).all(), "the exact share-average set must be optimal"
    assert (kept >= retention_bound(eta) * optimum - 1e-12).all(), f"eta={eta.tolist()}"


@pytest.mark.parametrize("dim,groups,pages", CASES)
@pytest.mark.parametrize("kind", ["gaussian", "outlier", "low_rank"])
def test_envelope_bounds_every_logit(gen, dim, groups, pages, kind):
    keys = _keys(gen, kind, (3, pages, B, dim), dtype=torch.float32)
    q = torch.randn((3, groups, dim), generator=gen) * 4
    gap = envelope_gap(q, keys, 1 / math.sqrt(dim))
    assert (gap <= 1e-4).all(), f"a logit exceeds the envelope by {gap.max():.3g}"
    # the envelope is tight for a query along one axis: it picks that axis's max or min
    axis = torch.zeros((3, 1, dim))
    axis[..., 0] = 1.0
    assert envelope_gap(axis, keys, 1.0).abs().max() < 1e-5


@pytest.mark.parametrize("dim,groups,pages", CASES)
@pytest.mark.parametrize("kind", ["gaussian", "outlier", "low_rank"])
@pytest.mark.parametrize("rank", [1, 4, 15])
def test_outlier_capture_inequality(gen, dim, groups, pages, kind, rank):
    keys = _keys(gen, kind, (2, pages, B, dim))
    q = _keys(gen, "outlier" if kind == "outlier" else "gaussian", (2, 1, groups, dim))[:, 0]
    summaries = build_page_summaries(keys, rank)
    sides = outlier_capture(q, keys, summaries)
    slack = 1e-9 * (sides.captured.abs() + sides.required.abs() + 1)
    assert (sides.captured >= sides.required - slack).all(), (
        f"violation {(sides.required - sides.captured).max():.3g}"
    )


def _page_with_spectrum(gen, spectrum, dim=64, dtype=torch.float64):
    """One page of 16 keys whose centered Gram has eigenvalues `spectrum` (then zeros), and the key-space
    direction of each mode (the columns of V)."""
    tokens = 16
    u = torch.randn((tokens, len(spectrum)), generator=gen, dtype=torch.float64)
    u, _ = torch.linalg.qr(u - u.mean(0, keepdim=True))  # orthonormal, orthogonal to the ones vector: centered
    v, _ = torch.linalg.qr(torch.randn((dim, len(spectrum)), generator=gen, dtype=torch.float64))
    deviations = u @ torch.diag(torch.tensor(spectrum, dtype=torch.float64).sqrt()) @ v.T
    centroid = torch.randn((1, dim), generator=gen, dtype=torch.float64)
    return (centroid + deviations).to(dtype)[None], v


SMALL_MODE_SPECTRUM = [100.0, 50.0, 30.0, 20.0, 1e-4]  # 100 x [1, .5, .3, .2, 1e-6]


def test_an_fp64_build_keeps_a_genuine_small_mode_and_the_audit_holds(gen):
    keys, v = _page_with_spectrum(gen, SMALL_MODE_SPECTRUM)
    summaries = build_page_summaries(keys, 8)
    assert summaries.kept_modes()[0].sum() == 5  # fp32's eps would drop the 1e-6 mode here
    q = v[:, 4][None, None]  # [P=1 pages' q: G=1, d] along the small mode
    capture = outlier_capture(q, keys, summaries)
    assert (capture.captured >= capture.required - 1e-12).all(), (capture.captured, capture.required)


def test_a_mode_the_build_dropped_counts_as_the_first_left_out(gen):
    """An fp32 build drops the 1e-6 mode as round-off; the inequality then needs sigma_{r+1} to be that mode
    (the largest one not represented), not the rank's next eigenvalue (0 here), or a correct summary fails."""
    keys, v = _page_with_spectrum(gen, SMALL_MODE_SPECTRUM)
    summaries = build_page_summaries(keys.float(), 8)
    assert summaries.kept_modes()[0].sum() == 4
    q = v[:, 4][None, None].float()
    capture = outlier_capture(q, keys.float(), summaries)
    slack = 1e-4 * SMALL_MODE_SPECTRUM[0]  # fp32 round-off of this page's numbers
    assert (capture.captured >= capture.required - slack).all(), (capture.captured, capture.required)
    assert (capture.required <= 0).all()  # q only sees the dropped mode, which the bound now subtracts
