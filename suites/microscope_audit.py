"""Audit counters of the microscope: every bound of locks.md §5 checked on real captured tensors.

Each audit counts how many instances were checked and how many violated the bound (beyond a tiny
fp64 tolerance). The score-error and outlier-capture bounds are theorems about unquantized
summaries, so they are audited only for states that carry the spectrum (built, not unpacked);
the selection audits (identity, output bound, coverage retention, oracle optimality) hold for
every scorer, and the envelope bound for Quest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..kernels.build.reference import PageSummaries
from ..kernels.decode.reference import attend_pages, selected_page_mask
from ..kernels.score import bounds
from ..kernels.score.reference import exact_logits, token_mask
from .microscope_inputs import Arm, StepPages

ABS_TOL = 1e-9  # fp64 slack for bounds on logits / log masses
REL_TOL = 1e-9  # fp64 slack relative to the size of the compared quantities

AUDITS = (
    "identity",  # o - o_S = eps (vbar_Sc - vbar_S)
    "output_bound",  # ||o_S - o|| <= 2 R (1 - gamma_S)
    "coverage_retention",  # coverage_c(S) >= exp(-4 eta) coverage_c(S_exact), eta = max page score error
    "oracle_optimal",  # share-average top-k of exact scores maximizes group-mean contested coverage
    "score_bound",  # |s_hat - s| <= max_i |q_perp . delta_perp_i| * scale       (unquantized summaries)
    "score_bound_loose",  # max_i |q_perp . delta_perp_i| <= ||q_perp|| sqrt(tau)  (unquantized summaries)
    "outlier_capture",  # sum_k<=r sigma_k^2 (v_k . q)^2 >= max_i (q . delta_i)^2 - sigma_r+1^2 ||q||^2
    "envelope",  # Quest: envelope score >= every logit of the page
)


@dataclass
class AuditCounts:
    """checked / violated per audit name (absent = not applicable to this arm)."""

    checked: dict[str, int] = field(default_factory=dict)
    violated: dict[str, int] = field(default_factory=dict)

    def add(self, name: str, violations: torch.Tensor) -> None:
        """violations: bool tensor, one element per checked instance."""
        self.checked[name] = self.checked.get(name, 0) + violations.numel()
        self.violated[name] = self.violated.get(name, 0) + int(violations.sum())

    def merge(self, other: AuditCounts) -> None:
        for name, count in other.checked.items():
            self.checked[name] = self.checked.get(name, 0) + count
            self.violated[name] = self.violated.get(name, 0) + other.violated[name]

    @property
    def total_checked(self) -> int:
        return sum(self.checked.values())

    @property
    def total_violated(self) -> int:
        return sum(self.violated.values())

    def to_json(self) -> dict[str, dict[str, int]]:
        return {name: {"checked": self.checked[name], "violated": self.violated[name]} for name in sorted(self.checked)}


def audit_scores(
    arm: Arm, state: object, q: torch.Tensor, full_keys: torch.Tensor, estimated: torch.Tensor, errors: torch.Tensor,
    scale: float,
) -> AuditCounts:
    """Page-level bounds of one step: q [Hkv, G, d], full_keys fp64 [Hkv, F, B, d], estimated [Hkv, G, F]: the
    page scores the arm's selector ranked (the audit checks what was used, not a rebuild from the keys), and
    errors = |estimated - exact|."""
    counts = AuditCounts()
    if full_keys.shape[-3] == 0:
        return counts
    if isinstance(state, PageSummaries) and state.eigenvalues is not None:
        limits = bounds.score_error_bounds(q, full_keys, state, scale)
        counts.add("score_bound", errors > limits.tight * (1 + REL_TOL) + ABS_TOL)
        counts.add("score_bound_loose", limits.tight > limits.loose * (1 + REL_TOL) + ABS_TOL)
        capture = bounds.outlier_capture(q, full_keys, state)
        size = capture.captured.abs() + capture.required.abs()
        counts.add("outlier_capture", capture.captured < capture.required - REL_TOL * size - ABS_TOL)
    if arm.scorer == "quest":  # the envelope the selector scored with must bound every logit of its page
        gap = exact_logits(q, full_keys, scale).amax(-1) - estimated.to(torch.float64)
        counts.add("envelope", gap > ABS_TOL)
    return counts


@dataclass(frozen=True)
class StepOutputs:
    """Per-step attention terms shared by every arm and budget (fp64).

    dense [Hkv, G, dv]: full attention output (its own pass); page_out [Hkv, G, P, dv]: sum over the
    page's tokens of w_i v_i with w the full softmax; radius [Hkv, 1]: R = max ||v_i||.
    """

    dense: torch.Tensor
    page_out: torch.Tensor
    radius: torch.Tensor


def step_outputs(view: StepPages, scale: float) -> StepOutputs:
    dense, _ = attend_pages(view.q, view.keys, view.values, scale, token_counts=view.token_counts)
    logits = exact_logits(view.q, view.keys, scale)  # [Hkv, G, P, B]
    valid = token_mask(view.token_counts, view.keys.shape[-2])
    weights = torch.softmax(logits.masked_fill(~valid, float("-inf")).flatten(-2), dim=-1).view(logits.shape)
    page_out = torch.einsum("hgpb,hpbd->hgpd", weights, view.values)
    radius = view.values.norm(dim=-1).flatten(-2).amax(-1).unsqueeze(-1)
    return StepOutputs(dense=dense, page_out=page_out, radius=radius)


def _sparse_output(view: StepPages, selected: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention renormalized over the selected pages only, reading just those pages: [Hkv, G, dv]."""
    ids = selected.clamp_min(0)  # -1 pads only occur with the dense fallback; they are masked below
    gather = ids[..., None, None].expand(*ids.shape, *view.keys.shape[-2:])
    keys = torch.gather(view.keys, 1, gather)
    values = torch.gather(view.values, 1, ids[..., None, None].expand(*ids.shape, *view.values.shape[-2:]))
    counts = torch.where(selected >= 0, view.token_counts[ids], 0)
    out, _ = attend_pages(view.q, keys, values, scale, token_counts=counts)
    return out


def audit_selection(
    view: StepPages,
    outputs: StepOutputs,
    exact: torch.Tensor,
    contested: torch.Tensor,
    scored: torch.Tensor,
    errors: torch.Tensor,
    selected: torch.Tensor,
    oracle_selected: torch.Tensor,
    scale: float,
    combine: str = "share_average",
) -> AuditCounts:
    """Selection-level bounds of one (step, budget): exact [Hkv, G, P] fp64 page log masses,
    contested / scored bool [P] (free pages / pages the shares are normalized over), errors
    [Hkv, G, F] score errors of the arm, selected / oracle_selected int [Hkv, k]."""
    counts = AuditCounts()
    num_pages = view.num_pages
    inside = selected_page_mask(selected, num_pages)  # [Hkv, P]

    # The exact identity o - o_S = eps (vbar_Sc - vbar_S), with o (dense pass), o_S (sparse pass
    # over the selected pages) and vbar_Sc (per-page sums) computed independently.
    sparse = _sparse_output(view, selected, scale)
    gamma = (torch.softmax(exact, dim=-1) * inside.unsqueeze(-2)).sum(-1)  # [Hkv, G]
    eps = (1 - gamma).clamp_min(0).unsqueeze(-1)
    rest_sum = (outputs.page_out * (~inside)[:, None, :, None]).sum(-2)  # eps * vbar_Sc
    rest = torch.where(eps > 0, rest_sum / eps.clamp_min(1e-300), torch.zeros_like(rest_sum))
    gap = (outputs.dense - sparse - eps * (rest - sparse)).norm(dim=-1)
    counts.add("identity", gap > REL_TOL * 1e3 * outputs.radius + ABS_TOL)
    error = (sparse - outputs.dense).norm(dim=-1)
    bound = 2 * outputs.radius * eps.squeeze(-1)
    counts.add("output_bound", error > bound * (1 + REL_TOL) + REL_TOL * outputs.radius + ABS_TOL)

    k = selected.shape[-1]
    if combine == "share_average" and num_pages > k and bool(contested.any()):
        shares = torch.softmax(exact.masked_fill(~scored, float("-inf")), dim=-1)  # [Hkv, G, P]
        inside_exact = selected_page_mask(oracle_selected, num_pages)
        coverage = (shares * (inside & contested).unsqueeze(-2)).sum(-1).mean(-1)  # [Hkv]
        coverage_exact = (shares * (inside_exact & contested).unsqueeze(-2)).sum(-1).mean(-1)
        eta = errors.flatten(-2).amax(-1)  # every scored page enters the normalization
        counts.add("coverage_retention", coverage < torch.exp(-4 * eta) * coverage_exact - REL_TOL)
        counts.add("oracle_optimal", coverage_exact < coverage - REL_TOL)
    return counts
