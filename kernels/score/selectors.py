"""Every page scorer of locks.md §6 behind one interface, found by name through a registry.

    scorer = make_scorer("locks", fmt="r8i4")
    state = scorer.prepare(keys)               # keys [..., P, B, d] (full pages)
    page_scores = scorer.scores(state, q, scale)   # q [..., G, d] -> [..., G, P]

Scores are page log-mass estimates (larger = more attention) in fp32 (fp64 for fp64 inputs); they
feed `select.combine_group`. The leading dims `...` are one (sequence, layer, KV head) each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from ..build.packing import quantize_summaries
from ..build.reference import PageSummaries, build_page_summaries
from ..config import SummaryFormat
from .reference import accumulate_dtype, exact_page_scores, summary_page_scores

DEFAULT_SHARED_RANK = 8


class PageScorer(Protocol):
    name: str

    def prepare(self, keys: torch.Tensor) -> Any:
        """keys [..., P, B, d] -> scorer state (what the method stores per page)."""

    def scores(self, state: Any, q: torch.Tensor, scale: float) -> torch.Tensor:
        """q [..., G, d] -> page scores [..., G, P]."""


_REGISTRY: dict[str, Callable[..., PageScorer]] = {}


def register_scorer(name: str) -> Callable[[Callable[..., PageScorer]], Callable[..., PageScorer]]:
    def add(factory: Callable[..., PageScorer]) -> Callable[..., PageScorer]:
        if name in _REGISTRY:
            raise ValueError(f"scorer {name!r} is registered twice")
        _REGISTRY[name] = factory
        return factory

    return add


def scorer_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def make_scorer(name: str, fmt: SummaryFormat | str | None = None, **options: Any) -> PageScorer:
    """A scorer by registry name; fmt (e.g. "r8i4") sets the summary format / rank where it matters."""
    if name not in _REGISTRY:
        raise ValueError(f"scorer {name!r} unknown; use one of {', '.join(_REGISTRY)}")
    if isinstance(fmt, str):
        fmt = SummaryFormat.parse(fmt)
    return _REGISTRY[name](fmt=fmt, **options)


def _float(x: torch.Tensor) -> torch.Tensor:
    return x.to(accumulate_dtype(x))


@register_scorer("oracle")
@dataclass(frozen=True)
class OracleScorer:
    """Exact-LSE oracle: s_j = logsumexp_i q . k_i * scale. Reads every key."""

    fmt: SummaryFormat | None = None
    name: str = "oracle"

    def prepare(self, keys: torch.Tensor) -> torch.Tensor:
        return keys

    def scores(self, state: torch.Tensor, q: torch.Tensor, scale: float) -> torch.Tensor:
        return exact_page_scores(q, state, scale)


@register_scorer("locks")
@dataclass(frozen=True)
class LocksScorer:
    """Locks summaries: LSE of reconstructed logits. rNiM goes through the packed row (what kernels
    read); rNfp uses the unrounded fp32 summaries, so the §5 bounds hold exactly. fmt None = r8i4."""

    fmt: SummaryFormat | None = None
    name: str = "locks"

    @property
    def summary_format(self) -> SummaryFormat:
        return self.fmt or SummaryFormat()

    def prepare(self, keys: torch.Tensor) -> PageSummaries:
        fmt = self.summary_format
        summaries = build_page_summaries(keys, fmt.rank)
        return quantize_summaries(summaries, fmt) if fmt.quantized else summaries

    def scores(self, state: PageSummaries, q: torch.Tensor, scale: float) -> torch.Tensor:
        return summary_page_scores(q, state, scale)


@register_scorer("centroid")
@dataclass(frozen=True)
class CentroidScorer:
    """Centroid only: q . mu_j * scale + log B (the log-mass if every key sat at the centroid)."""

    fmt: SummaryFormat | None = None
    name: str = "centroid"

    def prepare(self, keys: torch.Tensor) -> tuple[torch.Tensor, int]:
        return _float(keys).mean(dim=-2), keys.shape[-2]

    def scores(self, state: tuple[torch.Tensor, int], q: torch.Tensor, scale: float) -> torch.Tensor:
        centroid, page_size = state
        return torch.einsum("...gd,...pd->...gp", q.to(centroid.dtype), centroid) * scale + math.log(page_size)


def envelope_scores(q: torch.Tensor, upper: torch.Tensor, lower: torch.Tensor, scale: float) -> torch.Tensor:
    """q [..., G, d], per-dim key max/min [..., P, d] -> sum_c max(q_c u_c, q_c l_c) * scale [..., G, P]."""
    q = q.to(upper.dtype).unsqueeze(-2)  # [..., G, 1, d]
    return torch.maximum(q * upper.unsqueeze(-3), q * lower.unsqueeze(-3)).sum(-1) * scale


@register_scorer("quest")
@dataclass(frozen=True)
class QuestScorer:
    """Quest min/max envelope: an upper bound on every logit of the page (not a log-mass; adding
    log B would not change any ranking or share). Selection is per KV head with the same combine."""

    fmt: SummaryFormat | None = None
    name: str = "quest"

    def prepare(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys = _float(keys)
        return keys.amax(dim=-2), keys.amin(dim=-2)

    def scores(self, state: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, scale: float) -> torch.Tensor:
        return envelope_scores(q, *state, scale)


@register_scorer("moment")
@dataclass(frozen=True)
class MomentScorer:
    """Moment core: second-order expansion of the page LSE around the centroid.

    With x_i = q . delta_i * scale (sum_i x_i = 0): log sum_i exp(q . mu * scale + x_i)
    = q . mu * scale + log B + log mean_i exp(x_i) ~= q . mu * scale + log B + mean_i x_i^2 / 2
    = q . mu * scale + log B + scale^2 / 2 * q^T S q, with S = D^T D / B the page's key covariance.
    At scale = 1/sqrt(d) this is locks.md's q.mu/sqrt(d) + q^T S_j q / (2 B d) when its S_j is the
    scatter D^T D, plus the constant log B. The reference evaluates q^T S q as ||D q||^2 / B (same
    number as storing the d x d covariance, without the d^2 memory).
    """

    fmt: SummaryFormat | None = None
    name: str = "moment"

    def prepare(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys = _float(keys)
        centroid = keys.mean(dim=-2)
        return centroid, keys - centroid.unsqueeze(-2)

    def scores(self, state: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, scale: float) -> torch.Tensor:
        centroid, deviations = state
        q = q.to(centroid.dtype)
        page_size = deviations.shape[-2]
        first = torch.einsum("...gd,...pd->...gp", q, centroid) * scale + math.log(page_size)
        quadratic = torch.einsum("...gd,...pbd->...gpb", q, deviations).square().mean(-1)  # q^T S q
        return first + quadratic * scale**2 / 2


def fit_shared_basis(keys: torch.Tensor, rank: int, pooled_dims: int | None = None) -> torch.Tensor:
    """keys [..., P, B, d] -> orthonormal basis [..., d, rank] (top PCA directions of the within-page
    deviations, pooled over pages and tokens). pooled_dims: how many trailing leading dims to pool
    as well (None = all of them, giving one [d, rank] basis)."""
    keys = _float(keys)
    deviations = keys - keys.mean(dim=-2, keepdim=True)
    lead_dims = keys.dim() - 3
    pooled = lead_dims if pooled_dims is None else pooled_dims
    flat = deviations.flatten(-3, -2)  # [..., P*B, d]
    if pooled:
        flat = _pool(flat, pooled)
    scatter = flat.transpose(-1, -2) @ flat  # [..., d, d]
    _, vectors = torch.linalg.eigh(scatter)
    return vectors.flip(-1)[..., :rank]


def _pool(flat: torch.Tensor, pooled: int) -> torch.Tensor:
    """[..., L1..Lp, T, d] -> [..., L1*..*Lp*T, d]: merge the last `pooled` leading dims into the rows."""
    return flat.flatten(-2 - pooled, -2)


def shared_basis_summaries(keys: torch.Tensor, basis: torch.Tensor) -> PageSummaries:
    """keys [..., P, B, d], basis [..., d, r] (broadcastable) -> page summaries in that basis:
    exact centroid, coefficients c_i = W^T (k_i - mu_j) (the centered-on-page reconstruction)."""
    keys = _float(keys)
    centroid = keys.mean(dim=-2)
    basis = basis.to(keys.dtype)
    page_basis = basis.unsqueeze(-3).expand(*centroid.shape[:-1], *basis.shape[-2:])
    coefficients = (keys - centroid.unsqueeze(-2)) @ page_basis
    return PageSummaries(centroid=centroid, basis=page_basis, coefficients=coefficients)


@register_scorer("shared_basis_sequence")
@dataclass(frozen=True)
class SharedBasisSequenceScorer:
    """ShadowKV-style sketch: one rank-r PCA basis per leading index (sequence, layer, KV head),
    fitted on all of that sequence's page deviations; pages keep their exact centroid."""

    fmt: SummaryFormat | None = None
    name: str = "shared_basis_sequence"

    def prepare(self, keys: torch.Tensor) -> PageSummaries:
        rank = self.fmt.rank if self.fmt else DEFAULT_SHARED_RANK
        return shared_basis_summaries(keys, fit_shared_basis(keys, rank, pooled_dims=0))

    def scores(self, state: PageSummaries, q: torch.Tensor, scale: float) -> torch.Tensor:
        return summary_page_scores(q, state, scale)


@register_scorer("shared_basis_global")
@dataclass(frozen=True, eq=False)
class SharedBasisGlobalScorer:
    """Loki-style sketch: one rank-r basis fitted once, on `calibration_keys` [..., P, B, d] (pooled
    over all their leading dims) or given as `basis` [..., d, r]; without either, it is fitted on
    the keys given to prepare, pooled over all leading dims."""

    fmt: SummaryFormat | None = None
    calibration_keys: torch.Tensor | None = None
    basis: torch.Tensor | None = None
    name: str = "shared_basis_global"

    @property
    def rank(self) -> int:
        return self.fmt.rank if self.fmt else DEFAULT_SHARED_RANK

    def prepare(self, keys: torch.Tensor) -> PageSummaries:
        if self.basis is not None:
            basis = self.basis
        else:
            source = keys if self.calibration_keys is None else self.calibration_keys
            basis = fit_shared_basis(source, self.rank)
        return shared_basis_summaries(keys, basis)

    def scores(self, state: PageSummaries, q: torch.Tensor, scale: float) -> torch.Tensor:
        return summary_page_scores(q, state, scale)
