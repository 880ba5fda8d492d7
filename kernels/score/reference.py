"""Page scores (locks.md §2): estimated log attention mass from summaries, and the exact-LSE target."""

from __future__ import annotations

import torch

from ..build.reference import PageSummaries, accumulate_dtype


def summary_logits(q: torch.Tensor, summaries: PageSummaries, scale: float) -> torch.Tensor:
    """q [..., G, d] -> reconstructed logits [..., G, P, B] = (q . mu_j + (V_j^T q) . c_i) * scale."""
    dtype = accumulate_dtype(q, summaries.centroid)
    q = q.to(dtype)
    centroid_logits = torch.einsum("...gd,...pd->...gp", q, summaries.centroid.to(dtype))
    projected = torch.einsum("...gd,...pdr->...gpr", q, summaries.basis.to(dtype))
    deviation_logits = torch.einsum("...gpr,...pbr->...gpb", projected, summaries.coefficients.to(dtype))
    return (centroid_logits.unsqueeze(-1) + deviation_logits) * scale


def summary_page_scores(q: torch.Tensor, summaries: PageSummaries, scale: float) -> torch.Tensor:
    """q [..., G, d], summaries over P pages -> s_hat [..., G, P] (fp32, fp64 if any input is fp64)."""
    return torch.logsumexp(summary_logits(q, summaries, scale), dim=-1)


def exact_logits(q: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """q [..., G, d], keys [..., P, B, d] -> logits [..., G, P, B] = q . k_i * scale."""
    dtype = accumulate_dtype(q, keys)
    return torch.einsum("...gd,...pbd->...gpb", q.to(dtype), keys.to(dtype)) * scale


def token_mask(token_counts: torch.Tensor, page_size: int) -> torch.Tensor:
    """token_counts [..., P] (valid tokens per page, 0..B) -> bool [..., P, B]."""
    slots = torch.arange(page_size, device=token_counts.device)
    return slots < token_counts.unsqueeze(-1)


def exact_page_scores(
    q: torch.Tensor, keys: torch.Tensor, scale: float, token_counts: torch.Tensor | None = None
) -> torch.Tensor:
    """q [..., G, d], keys [..., P, B, d] -> s [..., G, P], the LSE of exact logits over valid tokens.

    token_counts [..., P] (broadcastable) marks a partially filled page: only its first count slots
    are tokens; a page with no tokens scores -inf.
    """
    logits = exact_logits(q, keys, scale)
    if token_counts is not None:
        valid = token_mask(torch.as_tensor(token_counts, device=keys.device), keys.shape[-2])
        logits = logits.masked_fill(~valid.unsqueeze(-3), float("-inf"))
    return torch.logsumexp(logits, dim=-1)
