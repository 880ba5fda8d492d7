"""The selection-fidelity microscope (locks.md §7): pure functions over captured decode-step tensors.

For every (record, layer, decode step) the engine pages the cache (B = 16; the last, possibly
partial, page is the recent page and has no summary), scores the full pages with each arm's
scorer, combines over the GQA group and selects per budget exactly as the method does, and
measures against the exact-LSE oracle in fp64. Scoring is done once per arm; only selection and
the selection metrics repeat per budget. The §5 audits live in `microscope_audit.py`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..kernels.build.reference import PageSummaries, reconstruct_keys
from ..kernels.config import PAGE_SIZE, SelectionConfig, SummaryFormat, scored_pages
from ..kernels.decode.reference import selected_page_mask
from ..kernels.score.reference import exact_page_scores
from ..kernels.score.selectors import make_scorer, scorer_names
from ..kernels.select.reference import combine_group, select_pages
from .arms import DENSE_ARM, FORMAT_SCORERS, parse_arm
from .microscope_audit import AuditCounts, audit_scores, audit_selection, step_outputs
from .microscope_inputs import Arm, StepPages

logger = logging.getLogger(__name__)

_TINY = 1e-300  # floor for shares before taking logs (fp64 softmax can underflow to 0)


def parse_arms(selectors: Sequence[str], formats: Sequence[str]) -> list[Arm]:
    """`locks` expands over `formats`; `locks:r4i8` names one format; other scorers take no format.

    Names and formats are checked by the eval arms' parser (`suites.arms.parse_arm`), so both commands
    accept and refuse the same spellings; `fullkv` is not a selector here (it selects nothing)."""
    parsed_formats = [SummaryFormat.parse(text) for text in formats]
    arms: list[Arm] = []
    for text in selectors:
        name, _, fmt_text = text.strip().partition(":")
        if name.strip().lower() == DENSE_ARM:
            raise ValueError(f"selector {name!r} selects no pages; use one of {', '.join(scorer_names())}")
        if name in FORMAT_SCORERS and not fmt_text:
            if not parsed_formats:
                raise ValueError(f"selector {name!r} needs a summary format; pass --formats r8i4 or {name}:r8i4")
            arms.extend(Arm(name, fmt) for fmt in parsed_formats)
            continue
        arm = parse_arm(text)  # an ArmError (a ValueError) names the valid spellings
        arms.append(Arm(arm.scorer, arm.fmt))
    if len(set(arms)) != len(arms):
        raise ValueError(f"selectors repeat an arm: {', '.join(a.label for a in arms)}")
    return arms


@dataclass(frozen=True)
class CapturedRecord:
    """One prompt's decode-step attention inputs at the full-attention layers (post-RoPE, as cached).

    queries [L, T, Hkv, G, d]; keys, values [L, Hkv, N, d(v)] (N >= max(seq_lens)); seq_lens int [T]
    (tokens visible to step t, its own included); outputs [L, T, Hkv, G, dv] or None (the model's
    attention output, used only to check the capture); carrier_pages: logical pages of the needle.
    """

    record_id: str
    layers: tuple[int, ...]
    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    seq_lens: torch.Tensor
    carrier_pages: tuple[int, ...] = ()
    outputs: torch.Tensor | None = None


@dataclass
class CellResult:
    """Metrics of one (record, arm, budget, layer) cell. Shapes: T steps, Hkv KV heads, G query heads.

    gamma, gamma_c: fp64 [T, Hkv, G]; recall, carrier_kept, carrier_eligible: [T, Hkv];
    score_abs_err: fp64 [n] |s_hat - s| over every (step, query head, full page);
    share_log_err, share_weight: fp64 [m] |log m_bar_hat - log m_bar| over contested pages, and the
    exact group share m_bar as its weight; energy_residual / energy_total: within-page key variance
    missed / present, summed over the pages of the last step (None without a reconstruction).
    """

    record_id: str
    arm: Arm
    budget_tokens: int
    page_budget: int
    layer: int
    gamma: torch.Tensor
    gamma_c: torch.Tensor
    recall: torch.Tensor
    carrier_kept: torch.Tensor
    carrier_eligible: torch.Tensor
    score_abs_err: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.float64))
    share_log_err: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.float64))
    share_weight: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.float64))
    energy_residual: float | None = None
    energy_total: float | None = None
    audits: AuditCounts = field(default_factory=AuditCounts)


def page_view(tokens: torch.Tensor, seq_len: int, page_size: int = PAGE_SIZE) -> torch.Tensor:
    """[Hkv, N, d] -> fp64 [Hkv, P, B, d] of the first seq_len tokens, zero padded to whole pages."""
    num_pages = math.ceil(seq_len / page_size)
    visible = tokens[:, :seq_len].to(torch.float64)
    padded = torch.nn.functional.pad(visible, (0, 0, 0, num_pages * page_size - seq_len))
    return padded.view(tokens.shape[0], num_pages, page_size, tokens.shape[-1])


def step_pages(record: CapturedRecord, layer_index: int, step: int, page_size: int = PAGE_SIZE) -> StepPages:
    seq_len = int(record.seq_lens[step])
    keys = page_view(record.keys[layer_index], seq_len, page_size)
    counts = torch.full((keys.shape[1],), page_size, dtype=torch.int64)
    counts[-1] = seq_len - page_size * (keys.shape[1] - 1)
    return StepPages(
        q=record.queries[layer_index, step].to(torch.float64),
        keys=keys,
        values=page_view(record.values[layer_index], seq_len, page_size),
        token_counts=counts,
        full_pages=scored_pages(seq_len, page_size),
    )


def group_shares(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """scores [Hkv, G, P] -> share-average group shares m_bar [Hkv, P] over the masked pages (0 elsewhere)."""
    return combine_group(scores, "share_average", mask).clamp_min(0.0).nan_to_num(0.0)


def _pad_scores(scores: torch.Tensor, num_pages: int) -> torch.Tensor:
    """[Hkv, G, F] -> [Hkv, G, P]: the unsummarized partial page scores -inf (it is attended anyway)."""
    missing = num_pages - scores.shape[-1]
    return torch.nn.functional.pad(scores, (0, missing), value=float("-inf")) if missing else scores


def reconstruction(arm: Arm, state: object, keys: torch.Tensor) -> torch.Tensor | None:
    """The keys [.., F, B, d] a scorer's state represents, or None when it stores no per-key estimate."""
    if isinstance(state, PageSummaries):
        return reconstruct_keys(state).to(torch.float64)
    if arm.scorer == "oracle":
        return keys
    if arm.scorer == "centroid":
        return keys.mean(dim=-2, keepdim=True).expand_as(keys)
    return None


class _ArmState:
    """Scorer + the state of the pages complete so far, rebuilt only when a page fills."""

    def __init__(self, arm: Arm) -> None:
        self.arm = arm
        self.scorer = make_scorer(arm.scorer, fmt=arm.fmt)
        self._cached: tuple[int, object] | None = None

    def state(self, full_keys: torch.Tensor) -> object:
        # Summaries of complete pages never change, but shared-basis scorers fit on all pages, so
        # the state is prepared from exactly the pages complete at this step (no future keys).
        if self._cached is None or self._cached[0] != full_keys.shape[-3]:
            self._cached = (full_keys.shape[-3], self.scorer.prepare(full_keys))
        return self._cached[1]


def evaluate_record(
    record: CapturedRecord,
    arms: Sequence[Arm],
    budgets_tokens: Sequence[int],
    scale: float,
    combine: str = "share_average",
    on_step: Callable[[], None] | None = None,
) -> list[CellResult]:
    """Every (arm, budget, layer) cell of one record; `on_step` is called after each (layer, step)."""
    selections = [SelectionConfig(budget_tokens=b, combine=combine) for b in budgets_tokens]
    cells: list[CellResult] = []
    for li in range(len(record.layers)):
        cells.extend(_evaluate_layer(record, li, arms, selections, scale, combine, on_step))
    return cells


def _evaluate_layer(
    record: CapturedRecord,
    li: int,
    arms: Sequence[Arm],
    selections: Sequence[SelectionConfig],
    scale: float,
    combine: str,
    on_step: Callable[[], None] | None,
) -> list[CellResult]:
    num_steps, num_kv, group = record.queries.shape[1:4]
    cells = {
        (arm, sel.budget_tokens): CellResult(
            record_id=record.record_id, arm=arm, budget_tokens=sel.budget_tokens, page_budget=sel.page_budget,
            layer=record.layers[li], gamma=torch.zeros(num_steps, num_kv, group, dtype=torch.float64),
            gamma_c=torch.zeros(num_steps, num_kv, group, dtype=torch.float64),
            recall=torch.zeros(num_steps, num_kv, dtype=torch.float64),
            carrier_kept=torch.zeros(num_steps, num_kv, dtype=torch.int64),
            carrier_eligible=torch.zeros(num_steps, num_kv, dtype=torch.int64),
        )
        for arm in arms for sel in selections
    }
    states = {arm: _ArmState(arm) for arm in arms}
    errors_of: dict[Arm, list[torch.Tensor]] = {arm: [] for arm in arms}
    shares_of: dict[Arm, list[tuple[torch.Tensor, torch.Tensor]]] = {arm: [] for arm in arms}
    score_audits = {arm: AuditCounts() for arm in arms}
    energy: dict[Arm, tuple[float, float] | None] = {}

    for t in range(num_steps):
        view = step_pages(record, li, t)
        full_keys = view.keys[:, : view.full_pages]
        exact = exact_page_scores(view.q, view.keys, scale, view.token_counts)  # fp64 [Hkv, G, P]
        contested = view.contested_mask()
        scored = view.scored_mask()
        exact_group = combine_group(_pad_scores(exact[..., : view.full_pages], view.num_pages), combine, scored)
        exact_shares = group_shares(exact, scored)
        carrier = _page_mask(record.carrier_pages, view.num_pages)
        outputs = step_outputs(view, scale)
        mass = torch.softmax(exact, dim=-1)  # [Hkv, G, P]: each page's share of the head's attention
        oracle = {sel.budget_tokens: select_pages(exact_group, view.num_pages, sel.page_budget) for sel in selections}

        for arm in arms:
            state = states[arm].state(full_keys)
            estimated = states[arm].scorer.scores(state, view.q, scale).to(torch.float64)  # [Hkv, G, F]
            errors = (estimated - exact[..., : view.full_pages]).abs()
            errors_of[arm].append(errors.flatten())
            score_audits[arm].merge(audit_scores(arm, state, view.q, full_keys, estimated, errors, scale))
            ranked = _pad_scores(estimated, view.num_pages)
            shares = group_shares(ranked, scored)
            log_err = (shares.clamp_min(_TINY).log() - exact_shares.clamp_min(_TINY).log()).abs()
            shares_of[arm].append((log_err[:, contested].flatten(), exact_shares[:, contested].flatten()))
            group_scores = combine_group(ranked, combine, scored)
            for sel in selections:
                cell = cells[(arm, sel.budget_tokens)]
                selected = select_pages(group_scores, view.num_pages, sel.page_budget)
                best = oracle[sel.budget_tokens]
                _selection_metrics(cell, t, view, mass, contested, carrier, selected, best)
                cell.audits.merge(
                    audit_selection(view, outputs, exact, contested, scored, errors, selected, best, scale, combine)
                )
            if t == num_steps - 1:
                energy[arm] = _energy(arm, state, full_keys)
        if on_step is not None:
            on_step()

    for (arm, _), cell in cells.items():
        cell.score_abs_err = torch.cat(errors_of[arm])
        cell.share_log_err = torch.cat([e for e, _ in shares_of[arm]])
        cell.share_weight = torch.cat([w for _, w in shares_of[arm]])
        if energy[arm] is not None:
            cell.energy_residual, cell.energy_total = energy[arm]
        cell.audits.merge(score_audits[arm])
    return list(cells.values())


def _page_mask(pages: Sequence[int], num_pages: int) -> torch.Tensor:
    mask = torch.zeros(num_pages, dtype=torch.bool)
    inside = [p for p in pages if 0 <= p < num_pages]
    mask[inside] = True
    return mask


def _selection_metrics(
    cell: CellResult,
    at: int,
    view: StepPages,
    mass: torch.Tensor,
    contested: torch.Tensor,
    carrier: torch.Tensor,
    selected: torch.Tensor,
    oracle_selected: torch.Tensor,
) -> None:
    """gamma, gamma_c, recall and carrier retention of one selection (locks.md §7); mass [Hkv, G, P]
    is the softmax of the exact page log masses, computed once per step."""
    inside = selected_page_mask(selected, view.num_pages)  # [Hkv, P]
    inside_exact = selected_page_mask(oracle_selected, view.num_pages)
    cell.gamma[at] = (mass * inside.unsqueeze(-2)).sum(-1)
    contested_mass = (mass * contested).sum(-1)
    kept = (mass * (inside & contested).unsqueeze(-2)).sum(-1)
    # No contested mass (every page is sink or recent) means nothing could be lost: 1 by convention.
    cell.gamma_c[at] = torch.where(contested_mass > 0, kept / contested_mass.clamp_min(_TINY), 1.0)
    cell.recall[at] = (inside & inside_exact).sum(-1) / inside_exact.sum(-1)
    eligible = inside_exact & carrier
    cell.carrier_eligible[at] = eligible.sum(-1)
    cell.carrier_kept[at] = (eligible & inside).sum(-1)


def _energy(arm: Arm, state: object, full_keys: torch.Tensor) -> tuple[float, float] | None:
    """(residual, total) within-page key variance: sum ||k - k_hat||^2 and sum ||k - mu||^2."""
    rebuilt = reconstruction(arm, state, full_keys)
    if rebuilt is None:
        return None
    residual = (full_keys - rebuilt).square().sum().item()
    total = (full_keys - full_keys.mean(dim=-2, keepdim=True)).square().sum().item()
    return residual, total


def capture_output_error(record: CapturedRecord, scale: float) -> float | None:
    """max |o_model - o_dense| over layers, steps and heads: 0 up to fp32 noise when the capture
    (post-RoPE q, cached k/v, head mapping, scale) is what the model attended with."""
    if record.outputs is None:
        return None
    from ..kernels.decode.reference import attend_pages

    worst = 0.0
    for li in range(record.queries.shape[0]):
        for t in range(record.queries.shape[1]):
            view = step_pages(record, li, t)
            dense, _ = attend_pages(view.q, view.keys, view.values, scale, token_counts=view.token_counts)
            worst = max(worst, (dense - record.outputs[li, t].to(torch.float64)).abs().max().item())
    return worst


def _quantile(values: torch.Tensor, q: float) -> float | None:
    return float(torch.quantile(values, q)) if values.numel() else None


def summarize(cells: Sequence[CellResult]) -> dict:
    """Pool cells (typically one arm and budget over all records) into the §7 summary numbers.

    gamma, gamma_c, recall: means over (record, layer, step, head) samples; score errors pooled over
    pages before the percentiles; share_log_err: mean |log m_bar_hat - log m_bar| weighted by the
    exact group share; needle retention and energy: ratios of pooled sums; bound_violations: audits
    violated out of bound_checks (per audit in `audits`).
    """
    if not cells:
        raise ValueError("nothing to summarize: no cells")
    gamma = torch.cat([c.gamma.flatten() for c in cells])
    gamma_c = torch.cat([c.gamma_c.flatten() for c in cells])
    recall = torch.cat([c.recall.flatten() for c in cells])
    kept = sum(int(c.carrier_kept.sum()) for c in cells)
    eligible = sum(int(c.carrier_eligible.sum()) for c in cells)
    errors = torch.cat([c.score_abs_err for c in cells])
    share_err = torch.cat([c.share_log_err for c in cells])
    share_weight = torch.cat([c.share_weight for c in cells])
    energy_total = sum(c.energy_total or 0.0 for c in cells)
    has_energy = any(c.energy_total is not None for c in cells)
    audits = AuditCounts()
    for cell in cells:
        audits.merge(cell.audits)
    weight = float(share_weight.sum())
    residual = sum(c.energy_residual or 0.0 for c in cells)
    return {
        "samples": gamma.numel(),
        "gamma": float(gamma.mean()),
        "gamma_min": float(gamma.min()),
        "gamma_c": float(gamma_c.mean()),
        "gamma_c_min": float(gamma_c.min()),
        "recall": float(recall.mean()),
        "needle_retention": kept / eligible if eligible else None,
        "needle_kept": kept,
        "needle_eligible": eligible,
        "score_err_p50": _quantile(errors, 0.5),
        "score_err_p95": _quantile(errors, 0.95),
        "score_err_max": float(errors.max()) if errors.numel() else None,
        "share_log_err": float((share_err * share_weight).sum()) / weight if weight > 0 else None,
        "share_log_err_p95": _quantile(share_err, 0.95),
        "captured_energy": 1 - residual / energy_total if has_energy and energy_total > 0 else None,
        "bound_violations": audits.total_violated,
        "bound_checks": audits.total_checked,
        "audits": audits.to_json(),
    }
