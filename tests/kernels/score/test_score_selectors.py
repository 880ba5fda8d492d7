"""The page scorers of locks.md §6 behind one registry: shapes, exactness where a scorer must be
exact, the moment expansion's order, and the shared-basis sketches."""

from __future__ import annotations

import math

import pytest
import torch
from locks_toolkit.kernels.config import SummaryFormat
from locks_toolkit.kernels.score.reference import exact_page_scores
from locks_toolkit.kernels.score.selectors import fit_shared_basis, make_scorer, scorer_names
from locks_toolkit.kernels.testing import gaussian_keys, low_rank_keys

B = 16
ALL = ("oracle", "locks", "centroid", "quest", "moment", "shared_basis_sequence", "shared_basis_global")



def test_registry_lists_every_selector_and_refuses_unknown_names():
    assert set(ALL) <= set(scorer_names())
    with pytest.raises(ValueError, match="oracle"):
        make_scorer("lokc")
    with pytest.raises(Exception, match="rNiM"):
        make_scorer("locks", fmt="r8q4")


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("dim,groups,pages", [(64, 1, 7), (128, 4, 13), (256, 7, 37), (128, 8, 7)])
def test_every_scorer_gives_finite_scores_of_the_right_shape(gen, name, dim, groups, pages):
    keys = gaussian_keys(gen, (2, 3, pages, B, dim)).to(torch.bfloat16)  # model dtype in, fp32 out
    q = torch.randn((2, 3, groups, dim), generator=gen).to(torch.bfloat16)
    scorer = make_scorer(name, fmt="r4i4")
    scores = scorer.scores(scorer.prepare(keys), q, 1 / math.sqrt(dim))
    assert scores.shape == (2, 3, groups, pages) and scores.dtype == torch.float32
    assert torch.isfinite(scores).all()


@pytest.mark.parametrize("dim", [64, 128])
def test_oracle_and_full_rank_locks_are_exact(gen, dim):
    keys = gaussian_keys(gen, (3, 13, B, dim), dtype=torch.float64)
    q = torch.randn((3, 7, dim), generator=gen, dtype=torch.float64)
    scale = 1 / math.sqrt(dim)
    exact = exact_page_scores(q, keys, scale)
    oracle = make_scorer("oracle")
    assert torch.equal(oracle.scores(oracle.prepare(keys), q, scale), exact)
    locks = make_scorer("locks", fmt=SummaryFormat(rank=15, basis_bits=None))
    assert torch.allclose(locks.scores(locks.prepare(keys), q, scale), exact, atol=1e-9)
    quantized = make_scorer("locks", fmt="r15i8")
    err = (quantized.scores(quantized.prepare(keys), q, scale) - exact).abs()
    assert 0 < err.max() < 0.5, "int8 summaries are close to, but not equal to, the exact scores"


def test_centroid_and_moment_are_exact_on_constant_pages(gen):
    dim = 64
    keys = torch.randn((5, 1, dim), generator=gen, dtype=torch.float64).expand(5, B, dim).reshape(1, 5, B, dim)
    q = torch.randn((1, 4, dim), generator=gen, dtype=torch.float64)
    scale = 1 / math.sqrt(dim)
    exact = exact_page_scores(q, keys, scale)
    for name in ("centroid", "moment"):
        scorer = make_scorer(name)
        assert torch.allclose(scorer.scores(scorer.prepare(keys), q, scale), exact, atol=1e-10), name


def test_moment_score_is_a_second_order_expansion(gen):
    # keys = mu + t * delta: the moment core's error must shrink like t^3 (a wrong constant in the
    # quadratic term leaves a t^2 error, and the centroid alone a t^2 error too).
    dim = 128
    base = gaussian_keys(gen, (2, 7, B, dim), dtype=torch.float64)
    mu = base.mean(-2, keepdim=True)
    q = torch.randn((2, 4, dim), generator=gen, dtype=torch.float64)
    scale = 1 / math.sqrt(dim)
    errors = {}
    for name in ("moment", "centroid"):
        scorer = make_scorer(name)
        for t in (0.2, 0.1):
            keys = mu + t * (base - mu)
            errors[name, t] = (scorer.scores(scorer.prepare(keys), q, scale) - exact_page_scores(q, keys, scale)).abs().max()
    moment_ratio = errors["moment", 0.2] / errors["moment", 0.1]
    centroid_ratio = errors["centroid", 0.2] / errors["centroid", 0.1]
    assert moment_ratio > 6, f"moment error shrinks by {moment_ratio:.2f} when t halves; expected ~8 (third order)"
    assert 3 < centroid_ratio < 5, f"centroid error ratio {centroid_ratio:.2f}; expected ~4 (second order)"


@pytest.mark.parametrize("groups", [1, 8])
def test_quest_upper_bounds_every_logit(gen, groups):
    dim = 128
    keys = gaussian_keys(gen, (3, 37, B, dim))
    q = torch.randn((3, groups, dim), generator=gen) * 3
    scale = 1 / math.sqrt(dim)
    quest = make_scorer("quest")
    envelope = quest.scores(quest.prepare(keys), q, scale)
    max_logit = (torch.einsum("xgd,xpbd->xgpb", q, keys) * scale).amax(-1)
    assert (envelope >= max_logit - 1e-4).all()
    assert (envelope >= exact_page_scores(q, keys, scale) - math.log(B) - 1e-4).all()


def _shared_subspace_keys(gen, shape, subspace_rank):
    """Pages whose deviations all lie in one subspace per leading index (centroids arbitrary)."""
    *lead, pages, page_size, dim = shape
    directions = torch.randn((*lead, 1, subspace_rank, dim), generator=gen, dtype=torch.float64)
    factors = torch.randn((*lead, pages, page_size, subspace_rank), generator=gen, dtype=torch.float64)
    centroids = torch.randn((*lead, pages, 1, dim), generator=gen, dtype=torch.float64) * 3
    return centroids + factors @ directions


def test_shared_basis_sequence_fits_one_basis_per_leading_index(gen):
    dim = 64
    keys = _shared_subspace_keys(gen, (3, 13, B, dim), subspace_rank=5)
    q = torch.randn((3, 4, dim), generator=gen, dtype=torch.float64)
    scale = 1 / math.sqrt(dim)
    exact = exact_page_scores(q, keys, scale)
    scorer = make_scorer("shared_basis_sequence", fmt="r5fp")
    state = scorer.prepare(keys)
    assert torch.allclose(scorer.scores(state, q, scale), exact, atol=1e-9)
    # one basis per leading index, shared by all its pages
    assert torch.equal(state.basis[1, 0], state.basis[1, 12])
    # pooled over the three leading indices (different subspaces), rank 5 can no longer be exact
    pooled = make_scorer("shared_basis_global", fmt="r5fp")
    assert (pooled.scores(pooled.prepare(keys), q, scale) - exact).abs().max() > 1e-3


def test_shared_basis_global_uses_calibration_keys_or_a_given_basis(gen):
    dim = 128
    directions = torch.randn((6, dim), generator=gen, dtype=torch.float64)

    def keys_in_span(pages):
        factors = torch.randn((2, pages, B, 6), generator=gen, dtype=torch.float64)
        return torch.randn((2, pages, 1, dim), generator=gen, dtype=torch.float64) + factors @ directions

    calibration, keys = keys_in_span(7), keys_in_span(13)
    q = torch.randn((2, 7, dim), generator=gen, dtype=torch.float64)
    scale = 1 / math.sqrt(dim)
    exact = exact_page_scores(q, keys, scale)
    scorer = make_scorer("shared_basis_global", fmt="r6fp", calibration_keys=calibration)
    assert torch.allclose(scorer.scores(scorer.prepare(keys), q, scale), exact, atol=1e-9)
    basis = fit_shared_basis(calibration, 6)
    assert basis.shape == (dim, 6)
    assert torch.allclose(basis.T @ basis, torch.eye(6, dtype=torch.float64), atol=1e-10)
    given = make_scorer("shared_basis_global", fmt="r6fp", basis=basis)
    assert torch.allclose(given.scores(given.prepare(keys), q, scale), exact, atol=1e-9)
    # a basis fitted elsewhere (other directions) is not exact
    other = fit_shared_basis(low_rank_keys(gen, (1, 7, B, dim), 6, dtype=torch.float64), 6)
    wrong = make_scorer("shared_basis_global", fmt="r6fp", basis=other)
    assert (wrong.scores(wrong.prepare(keys), q, scale) - exact).abs().max() > 1e-3
