"""Scores, GQA combine and page selection (locks.md §2-3), including brute-force optimality of
share-average top-k among shared sets that contain the sink and recent page."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from locks_toolkit.kernels.build.reference import build_page_summaries, reconstruct_keys
from locks_toolkit.kernels.score.reference import exact_page_scores, summary_page_scores
from locks_toolkit.kernels.select.reference import combine_group, select_pages
from locks_toolkit.kernels.testing import gaussian_keys

B = 16



@pytest.mark.parametrize("dim,groups", [(64, 1), (128, 4), (256, 7), (128, 8)])
def test_summary_scores_are_the_lse_of_reconstructed_logits(gen, dim, groups):
    keys = gaussian_keys(gen, (2, 13, B, dim))
    q = torch.randn((2, groups, dim), generator=gen) * 2
    summaries = build_page_summaries(keys, 4)
    scale = 1 / math.sqrt(dim)
    got = summary_page_scores(q, summaries, scale)
    assert got.shape == (2, groups, 13)
    recon = reconstruct_keys(summaries).double()
    want = torch.logsumexp(torch.einsum("xgd,xpbd->xgpb", q.double(), recon) * scale, dim=-1)
    assert torch.allclose(got.double(), want, atol=1e-4)


def test_exact_scores_with_a_partial_page(gen):
    keys = gaussian_keys(gen, (3, 7, B, 64))
    q = torch.randn((3, 4, 64), generator=gen)
    counts = torch.full((3, 7), B)
    counts[:, -1] = torch.tensor([1, 9, 16])
    got = exact_page_scores(q, keys, 0.125, token_counts=counts)
    for x in range(3):
        n = int(counts[x, -1])
        last = torch.logsumexp(q[x] @ keys[x, -1, :n].T * 0.125, dim=-1)
        assert torch.allclose(got[x, :, -1], last, atol=1e-5)
        assert torch.allclose(got[x, :, :-1], exact_page_scores(q[x], keys[x, :-1], 0.125), atol=1e-5)
    counts[0, 2] = 0
    assert torch.isneginf(exact_page_scores(q, keys, 0.125, token_counts=counts)[0, :, 2]).all()


def test_combine_rules_match_their_definitions(gen):
    scores = torch.randn((5, 7, 13), generator=gen) * 3
    mask = torch.rand((5, 13), generator=gen) > 0.3
    mask[:, 0] = True
    masked = scores.masked_fill(~mask.unsqueeze(-2), float("-inf"))
    shares = torch.softmax(masked, dim=-1)
    avg = combine_group(scores, "share_average", mask)
    assert torch.allclose(avg[mask], shares.mean(-2)[mask])
    assert torch.allclose(combine_group(scores, "group_max", mask)[mask], shares.amax(-2)[mask])
    assert torch.allclose(combine_group(scores, "group_mass", mask)[mask], torch.logsumexp(scores, -2)[mask])
    for rule in ("share_average", "group_max", "group_mass"):
        assert torch.isneginf(combine_group(scores, rule, mask)[~mask]).all()
    assert torch.allclose(avg.masked_fill(~mask, 0).sum(-1), torch.ones(5)), "shares must sum to 1 over candidates"
    with pytest.raises(ValueError, match="share_average"):
        combine_group(scores, "sum", mask)


def _check_selection(selected: torch.Tensor, num_pages: int, k: int) -> list[int]:
    ids = [i for i in selected.tolist() if i >= 0]
    assert selected.tolist() == ids + [-1] * (k - len(ids)), "ids must come first, -1 padding last"
    assert ids == sorted(set(ids)), "ids must be ascending and unique"
    assert all(0 <= i < num_pages for i in ids)
    assert len(ids) == min(num_pages, k)
    if num_pages > k:
        assert ids[0] == 0 and ids[-1] == num_pages - 1
    return ids


@pytest.mark.parametrize("k", [2, 3, 8])
def test_select_pages_around_the_budget(gen, k):
    scores = torch.randn((k + 5,), generator=gen)
    for n in range(1, k + 4):
        ids = _check_selection(select_pages(scores, n, k), n, k)
        if n <= k:
            assert ids == list(range(n)), "dense fallback must attend every page"
        else:
            contested = sorted(range(1, n - 1), key=lambda j: (-float(scores[j]), j))[: k - 2]
            assert ids == sorted([0, n - 1, *contested])


def test_select_pages_with_per_head_page_counts_ties_and_nan(gen):
    k = 5
    group_scores = torch.randn((3, 4, 37), generator=gen)
    group_scores[0] = 0.0  # all ties: lower ids win
    group_scores[1, :, 3] = float("nan")
    group_scores[2, :, 5:9] = float("-inf")
    num_pages = torch.randint(1, 38, (3, 4), generator=gen)
    num_pages[0, 0], num_pages[1, 1], num_pages[2, 2] = 37, k, k + 1
    selected = select_pages(group_scores, num_pages, k)
    assert selected.shape == (3, 4, k) and selected.dtype == torch.int64
    for x, h in itertools.product(range(3), range(4)):
        n = int(num_pages[x, h])
        ids = _check_selection(selected[x, h], n, k)
        if x == 0 and n > k:
            assert ids == [0, 1, 2, 3, n - 1]
        if x == 1 and n > k:
            assert 3 not in ids, "a NaN score must rank below every finite one"
    with pytest.raises(ValueError, match="num_pages"):
        select_pages(group_scores, 38, k)
    with pytest.raises(ValueError, match="k >= 2"):
        select_pages(group_scores, 7, 1)


def _group_mean_coverage(exact: torch.Tensor, pages: list[int]) -> float:
    shares = torch.softmax(exact.double(), dim=-1)  # [G, P]
    return float(shares[:, pages].sum(-1).mean())


@pytest.mark.parametrize("groups", [1, 4, 7, 8])
@pytest.mark.parametrize("num_pages,k", [(7, 4), (9, 5), (8, 3)])
def test_share_average_top_k_is_the_best_shared_set(gen, groups, num_pages, k):
    # Heads disagree strongly so that group-max / group-mass are not trivially optimal too.
    exact = torch.randn((groups, num_pages), generator=gen, dtype=torch.float64) * 3
    selected = select_pages(combine_group(exact, "share_average"), num_pages, k).tolist()
    best = max(
        _group_mean_coverage(exact, [0, num_pages - 1, *rest])
        for rest in itertools.combinations(range(1, num_pages - 1), k - 2)
    )
    got = _group_mean_coverage(exact, selected)
    assert got >= best - 1e-12, f"share-average set {selected} covers {got:.6f} < best shared set {best:.6f}"
