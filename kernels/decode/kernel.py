"""Sparse paged decode attention over per-(sequence, KV head) selected pages (locks.md §4).

Reference: `reference.attention.paged_decode_reference` (selected_pages given; None = dense).

`_sparse_decode_kernel`, grid (S * Hkv, num_splits): one program holds the G query heads of one
KV head (G_DOT = next_pow2(G) rows; tl.dot pads small M itself) and walks its split's slice of the k selected
page slots, PPI pages per iteration (`DecodeTuning`), through the block table; each K/V page is read once for all
G heads (K and V issued together: the first dot's operand shuffle is a barrier loads stay behind).
Online softmax in fp32, P@V with p cast to the cache dtype (bf16), fp32 accumulation.
Tokens >= seq_len (the partial last page) and -1 slots are masked. It writes (o / l, lse) per
query head and split; `_merge_kernel`, grid (S * Hq,), combines the splits by log-sum-exp and
writes out in q's dtype. Each iteration is three dependent memory round trips (slot -> block table -> K/V),
which at bs1 cost more than the bytes: `DecodeTuning` sets how many iterations a program walks.
The merge stays a launch of its own. Merging in the decode launch lost twice on the H200 at bs1:
- in the last split to arrive: 1.1-1.4 µs slower;
- in G merger programs per pair that wait on an arrival counter: 8.3 µs at best against 7.5 for both
  launches (commit `1064240`).
The split count is fixed by the workspace and the batch shape, never by data, so one captured graph serves
every context.
Bytes: k * B * d * 2 * elt (K+V, 1 MB per (seq, KV head) at b=2048, d=128, bf16)
+ partials 2 * Hq * splits * (d + 1) * 4 (written and re-read).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..triton_common import mm


@dataclass(frozen=True)
class DecodeTuning:
    """Launch shape of the sparse decode (the pages are the same under every tuning; fp32 order may differ).

    pages_per_iter: pages per loop iteration (16 tokens each: the N of QK^T and the K of PV).
    max_splits: the most splits per (sequence, KV head); the workspace holds this many.
    waves: splits are sized for about this many programs per SM (then capped by max_splits and by
      one iteration's pages per split).
    warps, stages: the decode kernel's num_warps / num_stages.
    merge_eager: the merge loads every split's partial output together with its lse, instead of
      only the splits whose lse is finite after reading it (one memory round trip instead of two;
      every split below num_splits is written by the decode kernel, so nothing unwritten is read).
    """

    pages_per_iter: int = 4
    max_splits: int = 32
    waves: int = 2
    warps: int = 8
    stages: int = 3
    merge_eager: bool = True

    def __post_init__(self) -> None:
        if self.pages_per_iter < 1 or self.pages_per_iter & (self.pages_per_iter - 1):
            raise ValueError(f"pages_per_iter must be a power of two, got {self.pages_per_iter}")
        if self.max_splits < 1 or self.waves < 1:
            raise ValueError(f"max_splits and waves must be >= 1, got {self.max_splits} / {self.waves}")


# One 4-page iteration per program at bs1, b = 2048 (32 splits x 4 KV heads), 8 warps, the eager merge. In a
# decoder layer on the H200 (`harness.lab.decode_sweep`) decode + merge took 5.2 + 2.3 µs at bs1 and 14.6 + 2.5
# at bs8, against 5.8 + 2.5 and 17.4 + 2.5 for the earlier shape (`TWO_PAGE_DECODE`: two 2-page iterations,
# 4 warps, the merge waiting on each lse).
DEFAULT_DECODE = DecodeTuning()
TWO_PAGE_DECODE = DecodeTuning(pages_per_iter=2, warps=4, merge_eager=False)


@dataclass(frozen=True)
class DecodeWorkspace:
    """Split-K partials: out [S_max, Hq, splits, d] fp32 and lse [S_max, Hq, splits] fp32."""

    partial_out: torch.Tensor
    partial_lse: torch.Tensor

    @property
    def max_splits(self) -> int:
        return self.partial_lse.shape[2]


@triton.jit
def _sparse_decode_kernel(
    q_ptr, k_ptr, v_ptr, block_table_ptr, seq_lens_ptr, sel_ptr, part_out_ptr, part_lse_ptr,
    s_qs, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_bt,
    num_kv_heads, num_q_heads, K, num_splits, max_splits, scale,
    G: tl.constexpr, G_DOT: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, B: tl.constexpr,
    PPI: tl.constexpr, FP32: tl.constexpr,
):
    pair = tl.program_id(0)
    split = tl.program_id(1)
    s = pair // num_kv_heads
    h = pair % num_kv_heads
    seq_len = tl.load(seq_lens_ptr + s)
    per_split = tl.cdiv(K, num_splits)
    slot_begin = split * per_split
    slot_end = tl.minimum(slot_begin + per_split, K)

    KV_T = tl.float32 if FP32 else k_ptr.dtype.element_ty
    g = tl.arange(0, G_DOT)
    gm = g < G
    d = tl.arange(0, D_PAD)
    dm = d < D
    q = tl.load(q_ptr + s * s_qs + (h * G + g)[:, None] * s_qh + d[None, :], mask=gm[:, None] & dm[None, :], other=0.0)
    q = q.to(KV_T)
    N: tl.constexpr = PPI * B
    n = tl.arange(0, N)
    slot_in_iter = n // B
    tok = n % B

    m_i = tl.full([G_DOT], float("-inf"), tl.float32)
    l_i = tl.zeros([G_DOT], tl.float32)
    acc = tl.zeros([G_DOT, D_PAD], tl.float32)
    sel_row = sel_ptr + pair.to(tl.int64) * K
    for first in range(slot_begin, slot_end, PPI):
        slot = first + slot_in_iter
        page = tl.load(sel_row + slot, mask=slot < slot_end, other=-1)
        live = page >= 0
        blk = tl.load(block_table_ptr + s * s_bt + page, mask=live, other=0).to(tl.int64)
        valid = live & (page * B + tok < seq_len)
        kv_mask = valid[:, None] & dm[None, :]
        k = tl.load(k_ptr + blk[:, None] * s_kb + tok[:, None] * s_kt + h * s_kh + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + blk[:, None] * s_vb + tok[:, None] * s_vt + h * s_vh + d[None, :], mask=kv_mask, other=0.0)
        logits = mm(q, tl.trans(k.to(KV_T)), FP32) * scale  # [G_DOT, N]
        logits = tl.where(valid[None, :], logits, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(logits, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(logits - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + mm(p.to(KV_T), v.to(KV_T), FP32)
        m_i = m_new
    has = l_i > 0
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    head = s * num_q_heads + h * G + g  # flat (sequence, query head)
    tl.store(part_lse_ptr + head * max_splits + split, lse, mask=gm)
    o_ptr = part_out_ptr + (head.to(tl.int64) * max_splits + split)[:, None] * D + d[None, :]
    tl.store(o_ptr, o, mask=gm[:, None] & dm[None, :])


@triton.jit
def _merge_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, s_os, s_oh, num_q_heads, num_splits, max_splits,
    D: tl.constexpr, D_PAD: tl.constexpr, SPLIT_PAD: tl.constexpr, EAGER: tl.constexpr = False,
):
    head = tl.program_id(0)  # flat (sequence, query head)
    s = head // num_q_heads
    qh = head % num_q_heads
    sp = tl.arange(0, SPLIT_PAD)
    spm = sp < num_splits
    d = tl.arange(0, D_PAD)
    dm = d < D
    lse = tl.load(part_lse_ptr + head * max_splits + sp, mask=spm, other=float("-inf"))
    top = tl.max(lse, axis=0)
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    w = tl.where(spm & (lse > float("-inf")), tl.exp(lse - top_safe), 0.0)
    o_mask = (spm if EAGER else w > 0)[:, None] & dm[None, :]
    o = tl.load(part_out_ptr + (head.to(tl.int64) * max_splits + sp)[:, None] * D + d[None, :], mask=o_mask, other=0.0)
    total = tl.sum(w, axis=0)
    res = tl.sum(w[:, None] * o, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + s * s_os + qh * s_oh + d, res.to(out_ptr.dtype.element_ty), mask=dm)
