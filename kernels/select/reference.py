"""GQA combine and page selection (locks.md §3): one shared page set per (sequence, layer, KV head)."""

from __future__ import annotations

import torch

from ..config import check_combine_rule


def combine_group(scores: torch.Tensor, rule: str, page_mask: torch.Tensor | None = None) -> torch.Tensor:
    """scores [..., G, P] (log masses per query head) -> group score [..., P]; larger is better.

    share_average: mean over G of each head's softmax over its candidate pages (m_bar_j in [0, 1]).
    group_max: max over G of the same shares. group_mass: logsumexp over G of the raw scores.
    page_mask [..., P] (True = candidate, e.g. page < num_pages) limits the softmax; masked pages
    get -inf under every rule so they are never selected. NaN scores count as -inf.
    """
    check_combine_rule(rule)
    scores = torch.nan_to_num(scores, nan=float("-inf"))
    if page_mask is not None:
        scores = scores.masked_fill(~page_mask.unsqueeze(-2), float("-inf"))
    if rule == "group_mass":
        combined = torch.logsumexp(scores, dim=-2)
    else:
        # A head whose candidates all score -inf has no shares (softmax would be NaN): give it zeros.
        shares = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
        combined = shares.mean(dim=-2) if rule == "share_average" else shares.amax(dim=-2)
    if page_mask is not None:
        combined = combined.masked_fill(~page_mask, float("-inf"))
    return combined


def select_pages(group_scores: torch.Tensor, num_pages: int | torch.Tensor, page_budget: int,
                 checked: bool = True) -> torch.Tensor:  # fmt: skip
    """group_scores [..., P], num_pages int or int[...] -> int64 [..., k] logical page ids.

    Ascending and -1 padded. With n = num_pages > k: the sink page 0, the most recent page n - 1 and
    the top-(k - 2) of pages 1..n-2 by group score (ties go to the lower page id). With n <= k:
    every page 0..n-1 (the dense fallback). checked=False leaves out the check that n is in 1..P, which
    reads a device tensor back: for callers that hold n in range themselves (a decode step per layer).
    """
    if page_budget < 2:
        raise ValueError(f"page budget {page_budget} leaves no room for the sink and recent pages; pass k >= 2")
    num_candidates = group_scores.shape[-1]
    device = group_scores.device
    lead = group_scores.shape[:-1]
    n = torch.as_tensor(num_pages, device=device, dtype=torch.int64).expand(lead).unsqueeze(-1)  # [..., 1]
    if checked and ((n > num_candidates).any() or (n < 1).any()):
        raise ValueError(f"num_pages must be in 1..{num_candidates} (the scored pages); got {num_pages}")
    page_ids = torch.arange(num_candidates, device=device).expand(*lead, num_candidates)
    contested = (page_ids > 0) & (page_ids < n - 1)

    # Order: contested pages first, by descending score, ties by ascending id (stable sorts).
    key = torch.nan_to_num(group_scores.to(torch.float64), nan=float("-inf"))
    by_score = torch.sort(key, dim=-1, descending=True, stable=True).indices
    contested_sorted = torch.gather(contested, -1, by_score)
    by_contested = torch.sort(contested_sorted.to(torch.int8), dim=-1, descending=True, stable=True).indices
    order = torch.gather(by_score, -1, by_contested)

    width = page_budget - 2
    top = order[..., :width]
    if top.shape[-1] < width:  # fewer scored pages than the budget: pad (only reached when n <= k)
        top = torch.nn.functional.pad(top, (0, width - top.shape[-1]), value=-1)
    sparse = torch.cat((torch.zeros_like(n), n - 1, top), dim=-1)
    sparse = torch.sort(sparse, dim=-1).values

    dense_ids = torch.arange(page_budget, device=device).expand(*lead, page_budget)
    dense = torch.where(dense_ids < n, dense_ids, torch.full_like(dense_ids, -1))
    return torch.where(n > page_budget, sparse, dense)
