"""The quantities of locks.md §5, for tests and the microscope's audit counters.

Every function is batched over leading dims `...` (one (sequence, layer, KV head) each); keys are
full pages [..., P, B, d], queries [..., G, d]. Accumulation is fp32, fp64 when inputs are fp64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..build.reference import PageSummaries
from ..decode.reference import selected_page_mask
from .reference import accumulate_dtype, exact_logits, exact_page_scores, summary_page_scores
from .selectors import envelope_scores


def score_error(q: torch.Tensor, keys: torch.Tensor, summaries: PageSummaries, scale: float) -> torch.Tensor:
    """|s_hat_j - s_j| [..., G, P]: summary score against the exact-LSE target."""
    return (summary_page_scores(q, summaries, scale) - exact_page_scores(q, keys, scale)).abs()


@dataclass(frozen=True)
class ScoreErrorBounds:
    """tight = max_i |q_perp . delta_perp_i| * scale; loose = ||q_perp|| sqrt(tau) * scale; [..., G, P]."""

    tight: torch.Tensor
    loose: torch.Tensor


def score_error_bounds(q: torch.Tensor, keys: torch.Tensor, summaries: PageSummaries, scale: float) -> ScoreErrorBounds:
    """Both forms of the unquantized score-error bound; summaries must carry eigenvalues (built, not unpacked)."""
    dtype = accumulate_dtype(q, keys, summaries.basis)
    q, keys = q.to(dtype), keys.to(dtype)
    basis, coefficients = summaries.basis.to(dtype), summaries.coefficients.to(dtype)
    deviations = keys - summaries.centroid.to(dtype).unsqueeze(-2)
    residual = deviations - coefficients @ basis.transpose(-1, -2)  # delta_perp [..., P, B, d]
    projected = torch.einsum("...gd,...pdr->...gpr", q, basis)
    q_perp = q.unsqueeze(-2) - torch.einsum("...gpr,...pdr->...gpd", projected, basis)  # [..., G, P, d]
    tight = torch.einsum("...gpd,...pbd->...gpb", q_perp, residual).abs().amax(-1) * scale
    tail = summaries.spectral_tail().to(dtype)  # [..., P]
    loose = q_perp.norm(dim=-1) * tail.sqrt().unsqueeze(-2) * scale
    return ScoreErrorBounds(tight=tight, loose=loose)


def coverage(exact_scores: torch.Tensor, selected_pages: torch.Tensor) -> torch.Tensor:
    """exact_scores [..., G, P], selected_pages [..., k] (-1 ignored) -> gamma_S [..., G]: the
    attention mass inside S of each query head (pages scoring -inf hold no mass)."""
    shares = torch.softmax(exact_scores, dim=-1)
    inside = selected_page_mask(selected_pages, exact_scores.shape[-1]).unsqueeze(-2)
    return (shares * inside).sum(-1)


def retention_bound(eta: float | torch.Tensor) -> float | torch.Tensor:
    """exp(-4 eta): the share of the exact selection's group-average coverage an estimated
    selection keeps when every page score is off by at most eta (shares move by <= exp(+-2 eta))."""
    return torch.exp(-4 * eta) if isinstance(eta, torch.Tensor) else math.exp(-4 * eta)


@dataclass(frozen=True)
class IdentityTerms:
    """Terms of o - o_S = eps (vbar_Sc - vbar_S), eps = 1 - gamma_S, for every query head.

    eps [..., G]; vbar_selected, vbar_rest [..., G, dv] (attention-weighted value means inside and
    outside S; vbar_rest is 0 when S^c holds no mass); radius [...]: R = max ||v_i||.
    """

    eps: torch.Tensor
    vbar_selected: torch.Tensor
    vbar_rest: torch.Tensor
    radius: torch.Tensor

    @property
    def difference(self) -> torch.Tensor:
        """eps (vbar_Sc - vbar_S) [..., G, dv]: equals o - o_S."""
        return self.eps.unsqueeze(-1) * (self.vbar_rest - self.vbar_selected)

    @property
    def output_error_bound(self) -> torch.Tensor:
        """2 R (1 - gamma_S) [..., G]: bounds ||o_S - o||."""
        return 2 * self.radius.unsqueeze(-1) * self.eps


def identity_terms(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, selected_pages: torch.Tensor
) -> IdentityTerms:
    """q [..., G, d], keys [..., P, B, d], values [..., P, B, dv], selected_pages [..., k] -> IdentityTerms."""
    dtype = accumulate_dtype(q, keys)
    weights = torch.softmax(exact_logits(q, keys, scale).flatten(-2), dim=-1)  # [..., G, P*B]
    inside = selected_page_mask(selected_pages, keys.shape[-3]).unsqueeze(-1).expand(keys.shape[:-1]).flatten(-2)
    flat_values = values.to(dtype).flatten(-3, -2).unsqueeze(-3)  # [..., 1, P*B, dv]
    w_in = weights * inside.unsqueeze(-2)
    w_out = weights - w_in
    gamma = w_in.sum(-1)
    eps = w_out.sum(-1)

    def mean_value(w: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
        total = (w.unsqueeze(-2) @ flat_values).squeeze(-2)
        return torch.where(mass.unsqueeze(-1) > 0, total / mass.clamp_min(torch.finfo(dtype).tiny).unsqueeze(-1), 0.0)

    radius = values.to(dtype).norm(dim=-1).flatten(-2).amax(-1)
    return IdentityTerms(eps=eps, vbar_selected=mean_value(w_in, gamma), vbar_rest=mean_value(w_out, eps), radius=radius)


@dataclass(frozen=True)
class OutlierCapture:
    """captured = sum_{k<=r} sigma_k^2 (v_k . q)^2 [..., G, P]; required = max_i (q . delta_i)^2 -
    sigma_{r+1}^2 ||q||^2 [..., G, P]. The inequality captured >= required holds for exact summaries."""

    captured: torch.Tensor
    required: torch.Tensor  # with sigma_{r+1}^2 the largest eigenvalue the summary does not represent


def outlier_capture(q: torch.Tensor, keys: torch.Tensor, summaries: PageSummaries) -> OutlierCapture:
    """Both sides of the outlier-capture inequality; summaries must carry eigenvalues."""
    if summaries.eigenvalues is None:
        raise ValueError("outlier capture needs the spectrum; pass summaries from build_page_summaries")
    dtype = accumulate_dtype(q, keys, summaries.basis)
    q, keys = q.to(dtype), keys.to(dtype)
    rank = summaries.rank
    eigenvalues = summaries.eigenvalues.to(dtype).clamp_min(0)  # [..., P, B]
    kept_eigenvalues = eigenvalues[..., :rank] * summaries.kept_modes()
    projected = torch.einsum("...gd,...pdr->...gpr", q, summaries.basis.to(dtype))
    captured = (projected.square() * kept_eigenvalues.unsqueeze(-3)).sum(-1)
    # The largest eigenvalue left out: past the rank, or a mode within it that the build dropped as a zero mode
    # (the inequality's sigma_{r+1} is the first mode not represented, whichever the reason).
    represented = torch.zeros_like(eigenvalues, dtype=torch.bool)
    represented[..., :rank] = summaries.kept_modes()
    next_eigenvalue = torch.where(represented, torch.zeros_like(eigenvalues), eigenvalues).amax(-1)
    deviations = keys - keys.mean(dim=-2, keepdim=True)
    largest = torch.einsum("...gd,...pbd->...gpb", q, deviations).square().amax(-1)
    required = largest - next_eigenvalue.unsqueeze(-2) * q.square().sum(-1, keepdim=True)
    return OutlierCapture(captured=captured, required=required)


def envelope_gap(q: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """max_i q . k_i * scale - envelope score [..., G, P]; <= 0 because the envelope bounds every logit."""
    keys = keys.to(accumulate_dtype(keys))
    envelope = envelope_scores(q, keys.amax(dim=-2), keys.amin(dim=-2), scale)
    return exact_logits(q, keys, scale).amax(-1) - envelope
