"""Page summaries (locks.md §1.1-1.2): centroid, and a rank-r basis with per-token coefficients.

For a page of B keys: mu = mean(k_i), D = K - mu (B x d), Gram D D^T = U S^2 U^T (eigenvalues
descending), coefficients C = U_r S_r (B x r), basis V = D^T U_r S_r^{-1} (d x r). Everything is
batched over arbitrary leading dims and runs on any device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# A mode is a zero mode when its Gram eigenvalue is negative or <= max(B * eps * lambda_max,
# (B * eps)^2 * sum_i ||k_i||^2), eps = eps_fp32 (architecture.md fixes this for every kernel).
# The first term: an fp32 eigendecomposition reproduces zero eigenvalues only up to ~3 eps *
# lambda_max (measured), so a smaller threshold keeps noise modes whose basis column D^T u / sigma
# is not orthogonal to the rest. The second: the fp32 centroid is exact only to ~eps |k| per
# element, so a page of identical keys has round-off deviations of energy ~eps^2 sum ||k_i||^2.
ZERO_MODE_RTOL = torch.finfo(torch.float32).eps  # of an fp32 build; `zero_mode_rtol` gives any build's


def zero_mode_rtol(dtype: torch.dtype) -> float:
    """Relative size below which a Gram eigenvalue is round-off of the build's own precision (its dtype's eps):
    an fp64 build keeps a genuine mode of 1e-6 of the largest that an fp32 build must drop."""
    return torch.finfo(dtype).eps


@dataclass(frozen=True)
class PageSummaries:
    """Summaries of P pages of B keys each, batched over leading dims `...`.

    centroid [..., P, d]; basis [..., P, d, r] (orthonormal kept columns, zero columns for zero
    modes); coefficients [..., P, B, r] (row i is c_i, zero for zero modes); eigenvalues
    [..., P, B] (all B Gram eigenvalues sigma_k^2, descending) or None when the summaries were
    unpacked from a packed row (which does not store the spectrum).
    """

    centroid: torch.Tensor
    basis: torch.Tensor
    coefficients: torch.Tensor
    eigenvalues: torch.Tensor | None = None

    def __post_init__(self) -> None:
        *lead, pages, dim = self.centroid.shape
        if tuple(self.basis.shape[:-1]) != (*lead, pages, dim):
            raise ValueError(f"basis shape {tuple(self.basis.shape)} does not match centroid {tuple(self.centroid.shape)}")
        if tuple(self.coefficients.shape[:-2]) != (*lead, pages) or self.coefficients.shape[-1] != self.basis.shape[-1]:
            raise ValueError(
                f"coefficients shape {tuple(self.coefficients.shape)} does not match basis {tuple(self.basis.shape)}"
            )

    @property
    def rank(self) -> int:
        return self.basis.shape[-1]

    @property
    def page_size(self) -> int:
        return self.coefficients.shape[-2]

    @property
    def head_dim(self) -> int:
        return self.centroid.shape[-1]

    def kept_modes(self) -> torch.Tensor:
        """bool [..., P, r]: which of the r modes are nonzero (not dropped as zero modes)."""
        return (self.coefficients != 0).any(dim=-2)

    def spectral_tail(self) -> torch.Tensor:
        """tau [..., P]: Gram eigenvalue energy not represented by the kept modes (>= 0)."""
        if self.eigenvalues is None:
            raise ValueError("these summaries carry no eigenvalues (unpacked from a packed row); build them from keys")
        eig = self.eigenvalues.clamp_min(0)
        kept = torch.zeros_like(eig, dtype=torch.bool)
        kept[..., : self.rank] = self.kept_modes()
        return torch.where(kept, torch.zeros_like(eig), eig).sum(-1)


def accumulate_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32: the reference's one precision rule.

    Defined here (not in score.py, which re-exports it) because score.py imports this module.
    """
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def build_page_summaries(
    keys: torch.Tensor, rank: int, compute_dtype: torch.dtype | None = None
) -> PageSummaries:
    """keys [..., P, B, d] (any float dtype) -> PageSummaries in compute_dtype (fp32, or fp64 for fp64 keys).

    Modes are ordered by descending eigenvalue and each kept mode is oriented so that the
    largest-magnitude entry of its coefficient column is positive (a fixed sign, so kernels can be
    compared column by column). Any rank 1 <= r <= B - 1 works; r = B is allowed but useless.
    """
    if keys.dim() < 3:
        raise ValueError(f"keys must be [..., P, B, d], got shape {tuple(keys.shape)}")
    page_size = keys.shape[-2]
    if not 1 <= rank <= page_size:
        raise ValueError(f"rank {rank} is outside 1..{page_size} for pages of {page_size} keys; pass e.g. rank=8")
    dtype = accumulate_dtype(keys) if compute_dtype is None else compute_dtype
    keys = keys.to(dtype)
    centroid = keys.mean(dim=-2)
    deviations = keys - centroid.unsqueeze(-2)
    gram = deviations @ deviations.transpose(-1, -2)  # [..., P, B, B]
    # fp32 eigh (LAPACK syevd) returns NaN pairs or fails to converge, for the whole batch, on a Gram made only
    # of round-off (a page of identical keys: repeated tokens in NoPE layers, bf16 collisions, padding);
    # 16 x 16 in fp64 costs little and is exact enough for every dtype the build serves.
    eigenvalues, eigenvectors = (t.to(dtype) for t in torch.linalg.eigh(gram.double()))  # ascending
    eigenvalues = eigenvalues.flip(-1)
    eigenvectors = eigenvectors.flip(-1)

    top_eigenvalues = eigenvalues[..., :rank]
    top_vectors = eigenvectors[..., :rank]  # U_r [..., P, B, r]
    rtol = zero_mode_rtol(dtype)
    relative_floor = rtol * page_size * eigenvalues[..., :1].clamp_min(0)
    centering_floor = (rtol * page_size) ** 2 * keys.square().sum(dim=(-1, -2)).unsqueeze(-1)
    threshold = torch.maximum(relative_floor, centering_floor)
    kept = top_eigenvalues > threshold  # also drops negative eigenvalues and all modes of a constant page
    singular = torch.where(kept, top_eigenvalues, torch.ones_like(top_eigenvalues)).sqrt()

    # Fix the sign: the largest-magnitude entry of each U column becomes positive.
    pivot = top_vectors.abs().argmax(dim=-2, keepdim=True)
    sign = torch.where(torch.gather(top_vectors, -2, pivot) < 0, -1.0, 1.0).to(dtype)
    top_vectors = top_vectors * sign

    keep = kept.unsqueeze(-2).to(dtype)
    coefficients = top_vectors * singular.unsqueeze(-2) * keep  # C = U_r S_r
    basis = (deviations.transpose(-1, -2) @ top_vectors) / singular.unsqueeze(-2) * keep  # V = D^T U_r S_r^-1
    return PageSummaries(centroid=centroid, basis=basis, coefficients=coefficients, eigenvalues=eigenvalues)


def reconstruct_keys(summaries: PageSummaries) -> torch.Tensor:
    """PageSummaries -> reconstructed keys [..., P, B, d]: mu + V c_i for every token i."""
    deviations = summaries.coefficients @ summaries.basis.transpose(-1, -2)
    return summaries.centroid.unsqueeze(-2) + deviations
