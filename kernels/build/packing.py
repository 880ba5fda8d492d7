"""The packed summary row (architecture.md) and the quantization of locks.md §1.3-1.4.

One uint8 row per (page, KV head): centroid, coefficients [B, r] row-major, basis column-major
[r, d] (int8, int4 nibbles or float16), then float16 scales [1 + B + r] for quantized formats,
zero-padded to a multiple of 64 bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import PAGE_SIZE, SummaryFormat
from .reference import PageSummaries

ROW_ALIGN_BYTES = 64
CENTROID_BITS = 8  # centroid and coefficients are int8 whenever the basis is quantized
COEFFICIENT_BITS = 8
_FP16_MAX = torch.finfo(torch.float16).max


@dataclass(frozen=True)
class SummaryLayout:
    """Byte layout of one packed row for a format, head dim and page size (all offsets in bytes)."""

    fmt: SummaryFormat
    head_dim: int
    page_size: int = PAGE_SIZE

    def __post_init__(self) -> None:
        if self.fmt.basis_bits == 4 and self.head_dim % 2:
            raise ValueError(f"int4 basis needs an even head_dim (two values per byte), got {self.head_dim}")
        if self.head_dim < 1 or self.page_size < 2:
            raise ValueError(f"head_dim {self.head_dim} / page_size {self.page_size} must be >= 1 / >= 2")

    @property
    def rank(self) -> int:
        return self.fmt.rank

    @property
    def centroid_offset(self) -> int:
        return 0

    @property
    def centroid_bytes(self) -> int:
        return self.head_dim * (1 if self.fmt.quantized else 2)

    @property
    def coefficients_offset(self) -> int:
        return self.centroid_offset + self.centroid_bytes

    @property
    def coefficients_bytes(self) -> int:
        return self.page_size * self.rank * (1 if self.fmt.quantized else 2)

    @property
    def basis_offset(self) -> int:
        return self.coefficients_offset + self.coefficients_bytes

    @property
    def basis_element_bits(self) -> int:
        """Bits per stored basis value: the format's basis_bits, or 16 (float16) for rNfp."""
        return self.fmt.basis_bits if self.fmt.quantized else 16

    @property
    def basis_bytes(self) -> int:
        return self.head_dim * self.rank * self.basis_element_bits // 8

    @property
    def payload_bytes(self) -> int:
        """Logical bytes of locks.md §1.4 (scales excluded): 768 for r8i4 at d=128, B=16."""
        return self.basis_offset + self.basis_bytes

    @property
    def scales_offset(self) -> int:
        return self.payload_bytes

    @property
    def num_scales(self) -> int:
        """float16 scales: centroid, one per token, one per basis column (0 for rNfp)."""
        return 1 + self.page_size + self.rank if self.fmt.quantized else 0

    @property
    def scale_bytes(self) -> int:
        return 2 * self.num_scales

    @property
    def row_bytes(self) -> int:
        """payload + scales, zero-padded up to a multiple of 64 bytes."""
        used = self.payload_bytes + self.scale_bytes
        return ROW_ALIGN_BYTES * math.ceil(used / ROW_ALIGN_BYTES)

    def kv_bytes(self, bytes_per_element: int = 2) -> int:
        """Bytes of the page's K and V in the cache (bf16 by default): 2 * B * d * 2."""
        return 2 * self.page_size * self.head_dim * bytes_per_element


def quantize_symmetric(x: torch.Tensor, bits: int, dim: int | tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """x float -> (q int8 same shape, scale float16 reduced over `dim`, keepdim).

    scale = absmax / qmax rounded to float16 first; q = round_half_even(x / scale) clamped to
    [-qmax, qmax]; a group whose scale is 0 (all zero, or underflowing float16) has q = 0.
    """
    qmax = 2 ** (bits - 1) - 1
    x = x.to(torch.float32)
    absmax = x.abs().amax(dim=dim, keepdim=True)
    scale16 = (absmax / qmax).to(torch.float16)
    if torch.isinf(scale16).any():
        raise ValueError(f"a value of magnitude {absmax.max().item():.3g} overflows a float16 scale; keys are not sane")
    scale = scale16.to(torch.float32)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(x / safe).clamp(-qmax, qmax)
    q = torch.where(scale > 0, q, torch.zeros_like(q))
    return q.to(torch.int8), scale16


def _fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    """float [..., n] -> uint8 [..., 2n] (little-endian float16)."""
    x16 = x.to(torch.float16)
    if torch.isinf(x16).any() and not torch.isinf(x).any():
        raise ValueError(f"a summary value exceeds the float16 range (±{_FP16_MAX:.0f}); use a quantized format")
    return x16.contiguous().view(torch.uint8)


def _from_fp16_bytes(raw: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2n] -> float32 [..., n]."""
    return raw.contiguous().view(torch.float16).to(torch.float32)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 [..., n] in [-7, 7] (n even) -> uint8 [..., n/2]: element 2j low nibble, 2j+1 high, value + 8."""
    biased = (q.to(torch.int16) + 8).to(torch.uint8)
    return biased[..., 0::2] | (biased[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n/2] -> int8 [..., n], inverse of pack_int4."""
    low = (packed & 0x0F).to(torch.int16) - 8
    high = (packed >> 4).to(torch.int16) - 8
    return torch.stack((low, high), dim=-1).flatten(-2).to(torch.int8)


def _layout_for(summaries: PageSummaries, fmt: SummaryFormat) -> SummaryLayout:
    if summaries.rank < fmt.rank:
        raise ValueError(f"summaries have rank {summaries.rank} < format rank {fmt.rank}; rebuild with rank={fmt.rank}")
    return SummaryLayout(fmt, summaries.head_dim, summaries.page_size)


def pack_summaries(summaries: PageSummaries, fmt: SummaryFormat) -> torch.Tensor:
    """PageSummaries (rank >= fmt.rank; extra columns are dropped) -> uint8 [..., P, row_bytes]."""
    layout = _layout_for(summaries, fmt)
    r = fmt.rank
    centroid = summaries.centroid
    coefficients = summaries.coefficients[..., :r]  # [..., P, B, r]
    basis_cols = summaries.basis[..., :r].transpose(-1, -2)  # [..., P, r, d], column c contiguous
    lead = centroid.shape[:-1]
    if not fmt.quantized:
        parts = [_fp16_bytes(centroid), _fp16_bytes(coefficients.flatten(-2)), _fp16_bytes(basis_cols.flatten(-2))]
    else:
        q_mu, s_mu = quantize_symmetric(centroid, CENTROID_BITS, dim=-1)  # s [..., P, 1]
        q_c, s_c = quantize_symmetric(coefficients, COEFFICIENT_BITS, dim=-1)  # s [..., P, B, 1]
        q_v, s_v = quantize_symmetric(basis_cols, fmt.basis_bits, dim=-1)  # s [..., P, r, 1]
        basis_raw = pack_int4(q_v) if fmt.basis_bits == 4 else q_v.view(torch.uint8)
        scales = torch.cat((s_mu, s_c.squeeze(-1), s_v.squeeze(-1)), dim=-1)  # [..., P, 1 + B + r]
        parts = [
            q_mu.view(torch.uint8),
            q_c.view(torch.uint8).flatten(-2),
            basis_raw.flatten(-2),
            scales.contiguous().view(torch.uint8),
        ]
    row = torch.cat([p.reshape(*lead, -1) for p in parts], dim=-1)
    padding = layout.row_bytes - row.shape[-1]
    return torch.nn.functional.pad(row, (0, padding))


def unpack_summaries(packed: torch.Tensor, layout: SummaryLayout) -> PageSummaries:
    """uint8 [..., P, row_bytes] -> dequantized float32 PageSummaries (eigenvalues None)."""
    if packed.dtype != torch.uint8 or packed.shape[-1] != layout.row_bytes:
        raise ValueError(
            f"packed rows must be uint8 [..., P, {layout.row_bytes}] for {layout.fmt} at d={layout.head_dim}; "
            f"got {packed.dtype} {tuple(packed.shape)}"
        )
    d, B, r = layout.head_dim, layout.page_size, layout.rank
    lead = packed.shape[:-1]

    def field(offset: int, nbytes: int) -> torch.Tensor:
        return packed[..., offset : offset + nbytes]

    raw_mu = field(layout.centroid_offset, layout.centroid_bytes)
    raw_c = field(layout.coefficients_offset, layout.coefficients_bytes)
    raw_v = field(layout.basis_offset, layout.basis_bytes)
    if not layout.fmt.quantized:
        centroid = _from_fp16_bytes(raw_mu)
        coefficients = _from_fp16_bytes(raw_c).reshape(*lead, B, r)
        basis_cols = _from_fp16_bytes(raw_v).reshape(*lead, r, d)
    else:
        scales = _from_fp16_bytes(field(layout.scales_offset, layout.scale_bytes))
        s_mu, s_c, s_v = scales[..., :1], scales[..., 1 : 1 + B], scales[..., 1 + B :]
        centroid = raw_mu.contiguous().view(torch.int8).to(torch.float32) * s_mu
        coefficients = raw_c.contiguous().view(torch.int8).to(torch.float32).reshape(*lead, B, r) * s_c.unsqueeze(-1)
        raw_v = raw_v.reshape(*lead, r, -1)
        q_v = unpack_int4(raw_v) if layout.fmt.basis_bits == 4 else raw_v.contiguous().view(torch.int8)
        basis_cols = q_v.to(torch.float32) * s_v.unsqueeze(-1)
    return PageSummaries(centroid=centroid, basis=basis_cols.transpose(-1, -2), coefficients=coefficients)


def quantize_summaries(summaries: PageSummaries, fmt: SummaryFormat) -> PageSummaries:
    """PageSummaries -> what a kernel reading the packed row sees: unpack(pack(.)), float32."""
    layout = _layout_for(summaries, fmt)
    return unpack_summaries(pack_summaries(summaries, fmt), layout)
