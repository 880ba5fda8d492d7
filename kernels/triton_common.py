"""Shared pieces of the Triton kernels: the packed-row constants a kernel needs, and device facts.

The byte layout itself is defined once, by `reference.packing.SummaryLayout`; kernels receive its
offsets as compile-time constants so every address computation folds into immediates.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .build.packing import SummaryLayout
from .config import cdiv  # noqa: F401  (re-exported: kernels and ops import it from here)

FP32_EPS = float(torch.finfo(torch.float32).eps)


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@dataclass(frozen=True)
class RowConstants:
    """The packed-row facts a kernel is specialized on (bytes unless said)."""

    head_dim: int
    page_size: int
    rank: int
    basis_bits: int  # 4, 8, or 16 for the float16 (rNfp) format
    coef_offset: int
    basis_offset: int
    scales_offset: int  # == payload_bytes; meaningless for rNfp (no scales)
    used_bytes: int  # payload + scales; the rest of the row up to row_bytes is zero padding
    row_bytes: int

    @classmethod
    def of(cls, layout: SummaryLayout) -> "RowConstants":
        if layout.row_bytes % 16:
            raise ValueError(f"row_bytes {layout.row_bytes} is not a multiple of 16; the kernels assume 64-byte rows")
        return cls(
            head_dim=layout.head_dim,
            page_size=layout.page_size,
            rank=layout.rank,
            basis_bits=layout.basis_element_bits,
            coef_offset=layout.coefficients_offset,
            basis_offset=layout.basis_offset,
            scales_offset=layout.scales_offset,
            used_bytes=layout.payload_bytes + layout.scale_bytes,
            row_bytes=layout.row_bytes,
        )


def row_views(summary_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """uint8 rows -> (uint8, int8, float16) views of the same bytes (no copy; graph safe)."""
    return summary_rows, summary_rows.view(torch.int8), summary_rows.view(torch.float16)


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int | None) -> int:
    """Multiprocessor count (a fixed guess on the CPU interpreter, where it only sets grid sizes)."""
    if device_index is None or not torch.cuda.is_available():
        return 8
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_index(t: torch.Tensor) -> int | None:
    return t.device.index if t.device.type == "cuda" else None


def dot_in_fp32(t: torch.Tensor) -> bool:
    """True when tl.dot must take fp32 operands (ieee): fp32 data, or the CPU interpreter, whose
    tl.dot mis-evaluates bf16 operands (numpy has no bf16). On the GPU, bf16/fp16 data uses the
    tensor cores."""
    return t.device.type != "cuda" or t.dtype not in (torch.bfloat16, torch.float16)


def check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@triton.jit
def mm(a, b, FP32: tl.constexpr):
    """a [M, K] @ b [K, N] with fp32 accumulation; exact fp32 products when FP32 (the fp32 and
    interpreter paths), tensor-core precision otherwise."""
    if FP32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


