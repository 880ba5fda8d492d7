"""Page scoring + GQA combine + top-k page selection (locks.md §2-3), in three launches.

Reference: `reference.score.summary_page_scores`, `reference.select.combine_group` (page_mask =
the summarized pages, page < seq_len // B) and `reference.select.select_pages`.

1. `_score_kernel`, grid (S * Hkv, num_chunks): each program streams a contiguous range of tiles
   of P_TILE pages of one (sequence, KV head). A tile's rows are read ONCE for all G query heads:
   centroid and basis columns go through tl.dot (int values are exact in bf16/fp16, so the tensor
   cores see exact products; scales are applied after the product in fp32), the coefficient
   contraction runs on CUDA cores. It writes the per-head LSE scores s[g, j] (fp32 scratch) and
   an online (max, sum-exp) per head and chunk, so the softmax normalizer needs no second pass
   over the summaries. Loop bounds come from seq_lens on the device: work tracks the live pages.
   Bytes: row_bytes per summarized page (832 for r8i4, d=128) + 4*G written (+ re-read below).
2. `_keys_kernel`, grid (S * Hkv, num_chunks): merges the chunk normalizers and writes each
   contested page's group key (the log of its share-average / group-max share / mass fraction,
   all <= 0; same order as the reference) as 30-bit fixed point (2^-24 steps), and adds its
   top-13-bit histogram into a per-(sequence, KV head) global histogram (atomics, 8192 bins).
3. `_select_kernel`, grid (S * Hkv,): picks the threshold bin from that histogram, then ONE scan
   of the keys writes every page above the bin and gathers the pages inside it; the remaining 17
   bits are resolved among those candidates (9 + 8 bit histograms; ties to the lower page id, as
   the reference), then sink + recent, sorted ascending. Pages <= k: every page, -1 padded
   (dense fallback decided on the device). Bytes: 4*G read + 4*2 per contested page (+ candidates).
   Key resolution: log shares below -64 (share < 2e-28) all tie at 0, and keys within 2^-24 in
   log share tie; both go to the lower page id.
All scratch lives in `ScoreSelectWorkspace` (allocated once by the caller; CUDA-graph safe).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

P_TILE = 16  # pages per tile: the N of every tl.dot
MAX_CHUNKS = 64  # score programs per (sequence, KV head) at most; fixed by the workspace
SCORE_WARPS = 8
SCORE_MAXNREG = 128  # r8i4, G=8, d=128: 165 registers uncapped (1 program/SM); capped: 2 per SM, no spill
KEYS_BLOCK = 512  # pages per iteration of the key kernel
KEYS_WARPS = 8
SELECT_SCAN = 8192  # keys per iteration of the select scan: one iteration up to 128K tokens
SELECT_WARPS = 16
HIST_BINS = 8192  # top 13 of the 30 key bits; the select kernel resolves the low 17 bits among one bin
LOW_BITS = 17
COMBINE_CODES = {"share_average": 0, "group_max": 1, "group_mass": 2}


@dataclass(frozen=True)
class ScoreSelectWorkspace:
    """Scratch of score_select (R = max_num_seqs * num_kv_heads, GS = next_pow2(G), C = MAX_CHUNKS):
    scores [R, maxP, GS] fp32, chunk_max/chunk_sum [R, C, GS] fp32, keys/cand_low/cand_page
    [R, maxP] int32, hist [R, HIST_BINS] int32 (must start zeroed; every call leaves it zeroed)."""

    scores: torch.Tensor
    chunk_max: torch.Tensor
    chunk_sum: torch.Tensor
    keys: torch.Tensor
    hist: torch.Tensor
    cand_low: torch.Tensor
    cand_page: torch.Tensor

    @property
    def max_pairs(self) -> int:
        return self.scores.shape[0]

    @property
    def max_pages(self) -> int:
        return self.scores.shape[1]

    @property
    def group_slots(self) -> int:
        return self.scores.shape[2]


@triton.jit
def _mm(a, b, FP32: tl.constexpr):
    """a [M, K] @ b [K, N] with fp32 accumulation; exact fp32 products when FP32."""
    if FP32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _score_kernel(
    q_ptr, rows_u8, rows_i8, rows_f16, block_table_ptr, seq_lens_ptr,
    scores_ptr, chunk_max_ptr, chunk_sum_ptr,
    s_qs, s_qh, s_bt, num_kv_heads, row_bytes, max_pages, num_chunks, scale,
    G: tl.constexpr, G_DOT: tl.constexpr, GS: tl.constexpr, MAXC: tl.constexpr,
    D: tl.constexpr, D_PAD: tl.constexpr, B: tl.constexpr, R: tl.constexpr, BITS: tl.constexpr,
    COEF_OFF: tl.constexpr, BASIS_OFF: tl.constexpr, SCALE_OFF: tl.constexpr,
    P: tl.constexpr, RP: tl.constexpr, FP32: tl.constexpr,
):
    pair = tl.program_id(0)
    chunk = tl.program_id(1)
    s = pair // num_kv_heads
    h = pair % num_kv_heads
    n_full = tl.load(seq_lens_ptr + s) // B  # summarized pages
    n_tiles = tl.cdiv(n_full, P)
    per_chunk = tl.cdiv(n_tiles, num_chunks)
    t_begin = chunk * per_chunk
    t_end = tl.minimum(t_begin + per_chunk, n_tiles)

    DOT_T = tl.float32 if FP32 else q_ptr.dtype.element_ty
    g = tl.arange(0, G_DOT)
    gm = g < G
    d = tl.arange(0, D_PAD)
    dm = d < D
    jh = tl.arange(0, D_PAD // 2)
    jhm = jh < D // 2
    q_rows = q_ptr + s * s_qs + (h * G + g)[:, None] * s_qh
    q_full = tl.load(q_rows + d[None, :], mask=gm[:, None] & dm[None, :], other=0.0).to(DOT_T)
    q_even = tl.load(q_rows + 2 * jh[None, :], mask=gm[:, None] & jhm[None, :], other=0.0).to(DOT_T)
    q_odd = tl.load(q_rows + 2 * jh[None, :] + 1, mask=gm[:, None] & jhm[None, :], other=0.0).to(DOT_T)
    tok = tl.arange(0, B)

    run_max = tl.full([G_DOT], float("-inf"), tl.float32)
    run_sum = tl.zeros([G_DOT], tl.float32)
    # Every load of a tile is issued before its first tl.dot: a dot's operand shuffle has a barrier
    # the compiler will not hoist loads across, so per-column loads would cost a round trip each.
    n = tl.arange(0, P * RP)  # (page, basis column) pairs of a tile, column fastest
    n_page = n // RP
    n_col = n % RP
    c3 = tl.arange(0, RP)
    for t in range(t_begin, t_end):
        page = t * P + tl.arange(0, P)
        pm = page < n_full
        blk = tl.load(block_table_ptr + s * s_bt + page, mask=pm, other=0).to(tl.int64)
        row = (blk * num_kv_heads + h) * row_bytes  # [P] byte offset of each page's row
        page_n = t * P + n_page
        nm = (page_n < n_full) & (n_col < R)
        blk_n = tl.load(block_table_ptr + s * s_bt + page_n, mask=page_n < n_full, other=0).to(tl.int64)
        row_n = (blk_n * num_kv_heads + h) * row_bytes  # [P*RP] the same rows, per (page, column)
        # The coefficient block is addressed in its own 3D layout (block ids loaded again, L1 hits)
        # so its loads need no layout shuffle of `row` (a barrier) before they can issue.
        page3 = t * P + tl.arange(0, P)[:, None, None]
        blk3 = tl.load(block_table_ptr + s * s_bt + page3, mask=page3 < n_full, other=0).to(tl.int64)
        row3 = (blk3 * num_kv_heads + h) * row_bytes
        coef_idx = tok[None, :, None] * R + c3[None, None, :]  # element index inside the [B, r] block
        coef_mask = (page3 < n_full) & (c3 < R)[None, None, :]
        if BITS == 16:
            mu = tl.load(rows_f16 + row[:, None] // 2 + d[None, :], mask=pm[:, None] & dm[None, :], other=0.0)
            v = tl.load(rows_f16 + row_n[:, None] // 2 + BASIS_OFF // 2 + n_col[:, None] * D + d[None, :],
                        mask=nm[:, None] & dm[None, :], other=0.0)
            coef = tl.load(rows_f16 + (row3 + COEF_OFF) // 2 + coef_idx, mask=coef_mask, other=0.0).to(tl.float32)
            q_mu = _mm(q_full, tl.trans(mu.to(tl.float32)), True)
            vq = _mm(q_full, tl.trans(v.to(tl.float32)), True)  # [G_DOT, P*RP]
            tok_scale = tl.full([P, B], 1.0, tl.float32)
        else:
            f_scales = (row + SCALE_OFF) // 2
            mu_scale = tl.load(rows_f16 + f_scales, mask=pm, other=0.0).to(tl.float32)
            col_scale = tl.load(rows_f16 + (row_n + SCALE_OFF) // 2 + 1 + B + n_col, mask=nm, other=0.0).to(tl.float32)
            tok_scale = tl.load(rows_f16 + f_scales[:, None] + 1 + tok[None, :], mask=pm[:, None], other=0.0)
            coef = tl.load(rows_i8 + row3 + COEF_OFF + coef_idx, mask=coef_mask, other=0).to(tl.float32)  # [P, B, RP]
            # The basis (largest field) before the centroid: the compiler places each operand shuffle
            # right after its load, and loads after a shuffle wait for the shuffled data.
            if BITS == 4:
                packed = tl.load(rows_u8 + row_n[:, None] + BASIS_OFF + n_col[:, None] * (D // 2) + jh[None, :],
                                 mask=nm[:, None] & jhm[None, :], other=0x88).to(tl.int32)
            else:
                v = tl.load(rows_i8 + row_n[:, None] + BASIS_OFF + n_col[:, None] * D + d[None, :],
                            mask=nm[:, None] & dm[None, :], other=0)
            mu = tl.load(rows_i8 + row[:, None] + d[None, :], mask=pm[:, None] & dm[None, :], other=0)
            if BITS == 4:
                q_mu = _mm(q_full, tl.trans(mu.to(tl.float32).to(DOT_T)), FP32) * mu_scale[None, :]
                low = ((packed & 15) - 8).to(tl.float32).to(DOT_T)  # dims 0, 2, 4, ...
                high = ((packed >> 4) - 8).to(tl.float32).to(DOT_T)  # dims 1, 3, 5, ...
                vq = _mm(q_even, tl.trans(low), FP32) + _mm(q_odd, tl.trans(high), FP32)
            else:
                q_mu = _mm(q_full, tl.trans(mu.to(tl.float32).to(DOT_T)), FP32) * mu_scale[None, :]
                vq = _mm(q_full, tl.trans(v.to(tl.float32).to(DOT_T)), FP32)
            vq = vq * col_scale[None, :]
            tok_scale = tok_scale.to(tl.float32)
        # Coefficient contraction on CUDA cores: acc[g, p, i] = sum_c (V^T q)[g, p, c] * C[p, i, c].
        acc = tl.sum(tl.reshape(vq, [G_DOT, P, 1, RP]) * coef[None, :, :, :], axis=3)
        logits = (q_mu[:, :, None] + acc * tok_scale[None, :, :]) * scale  # [G_DOT, P, B]
        page_max = tl.max(logits, axis=2)
        score = page_max + tl.log(tl.sum(tl.exp(logits - page_max[:, :, None]), axis=2))  # [G_DOT, P]
        score = tl.where(pm[None, :], score, float("-inf"))
        out = scores_ptr + (pair.to(tl.int64) * max_pages + page[None, :]) * GS + g[:, None]
        tl.store(out, score, mask=gm[:, None] & pm[None, :])
        new_max = tl.maximum(run_max, tl.max(score, axis=1))
        run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(score - new_max[:, None]), axis=1)
        run_max = new_max
    part = (pair * MAXC + chunk) * GS + g
    tl.store(chunk_max_ptr + part, run_max, mask=g < GS)
    tl.store(chunk_sum_ptr + part, run_sum, mask=g < GS)


@triton.jit
def _pick_bin(hist, need, NB: tl.constexpr):
    """Largest bin b with count(digit >= b) >= need; returns (b, need - count(digit > b))."""
    bins = tl.arange(0, NB)
    at_least = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
    b = tl.max(tl.where(at_least >= need, bins, -1), axis=0)
    above = tl.sum(tl.where(bins == b, at_least - hist, 0), axis=0)
    return b, need - above


@triton.jit
def _keys_kernel(
    scores_ptr, chunk_max_ptr, chunk_sum_ptr, keys_ptr, hist_ptr, seq_lens_ptr,
    num_kv_heads, max_pages, num_chunks, K,
    G: tl.constexpr, GS: tl.constexpr, MAXC: tl.constexpr, B: tl.constexpr, RULE: tl.constexpr,
    BLOCK: tl.constexpr, NBINS: tl.constexpr, LOW_BITS: tl.constexpr,
):
    """Group key of every contested page as a 30-bit fixed-point log share, plus its top-digit histogram."""
    pair = tl.program_id(0)
    chunk = tl.program_id(1)
    s = pair // num_kv_heads
    num_pages = tl.cdiv(tl.load(seq_lens_ptr + s), B)
    if num_pages > K:
        g = tl.arange(0, GS)
        gm = g < G
        ch = tl.arange(0, MAXC)
        part = (pair * MAXC + ch[:, None]) * GS + g[None, :]
        cmask = (ch[:, None] < num_chunks) & gm[None, :]
        c_max = tl.load(chunk_max_ptr + part, mask=cmask, other=float("-inf"))
        c_sum = tl.load(chunk_sum_ptr + part, mask=cmask, other=0.0)
        top = tl.max(c_max, axis=0)
        top_safe = tl.where(top == float("-inf"), 0.0, top)
        total = tl.sum(c_sum * tl.exp(c_max - top_safe[None, :]), axis=0)
        # Heads with shares: the real ones (g < G; slots G..GS-1 only pad G to a power of two) with a
        # positive normalizer. The others must add nothing under any rule (and not be counted by the
        # average): their scores load as -inf, and -inf - log Z with log Z = -inf would be NaN.
        has_mass = gm & (total > 0.0)
        log_norm = top_safe + tl.log(tl.where(has_mass, total, 1.0))  # [GS] log Z_g, finite in every slot
        # Every rule's key is <= 0: log of a share (<= 1) or of a mass fraction.
        if RULE == 2:  # group_mass: logsumexp_g s - logsumexp over every (g, page)
            log_norm = tl.where(has_mass, log_norm, float("-inf"))
            norm_max = tl.max(log_norm, axis=0)
            offset = norm_max + tl.log(tl.sum(tl.exp(log_norm - norm_max), axis=0))
        elif RULE == 0:  # share_average: log(mean_g share_g)
            offset = tl.log(G * 1.0)
        else:
            offset = 0.0
        recent = num_pages - 1
        per_chunk = tl.cdiv(recent - 1, num_chunks)
        first = 1 + chunk * per_chunk
        last = tl.minimum(first + per_chunk, recent)
        score_rows = scores_ptr + pair.to(tl.int64) * max_pages * GS
        for start in range(first, last, BLOCK):
            page = start + tl.arange(0, BLOCK)
            pm = page < last
            sc = tl.load(score_rows + page[:, None] * GS + g[None, :], mask=pm[:, None] & gm[None, :], other=float("-inf"))
            if RULE == 2:
                x = sc
            else:  # log share per head; -inf (share 0) for heads without shares, as in the reference
                x = tl.where(has_mass[None, :], sc - log_norm[None, :], float("-inf"))
            x_max = tl.max(x, axis=1)
            if RULE == 1:  # group_max: the largest share
                key = x_max
            else:
                x_safe = tl.where(x_max == float("-inf"), 0.0, x_max)
                key = x_safe + tl.log(tl.where(pm, tl.sum(tl.exp(x - x_safe[:, None]), axis=1), 1.0))
            key = key - offset
            # NaN (from NaN inputs; the reference counts NaN as -inf) becomes the lowest key: a NaN cast
            # to int would index the histogram out of bounds.
            key = tl.minimum(tl.maximum(tl.where(key == key, key, -64.0), -64.0), 0.0)
            # Fixed point: 2^-24 steps of log share (finer than fp32 at |key| >= 1), 0 = share <= e^-64.
            fixed = (key * 16777216.0).to(tl.int32) + (1 << 30)
            fixed = tl.minimum(fixed, (1 << 30) - 1)
            tl.store(keys_ptr + pair.to(tl.int64) * max_pages + page, fixed, mask=pm)
            # One atomic per page: bins are 2^-7 wide in log share, so collisions stay moderate.
            tl.atomic_add(hist_ptr + pair * NBINS + (fixed >> LOW_BITS), 1, mask=pm, sem="relaxed")


@triton.jit
def _select_kernel(
    keys_ptr, hist_ptr, cand_low_ptr, cand_page_ptr, seq_lens_ptr, out_ptr,
    num_kv_heads, max_pages, K,
    B: tl.constexpr, NBINS: tl.constexpr, LOW_BITS: tl.constexpr, SCAN: tl.constexpr, K_PAD: tl.constexpr,
):
    """Top-(k-2) contested pages by key (ties to the lower page id) + sink + recent, ascending."""
    pair = tl.program_id(0)
    s = pair // num_kv_heads
    num_pages = tl.cdiv(tl.load(seq_lens_ptr + s), B)
    out_row = out_ptr + pair.to(tl.int64) * K
    slot = tl.arange(0, K_PAD)
    if num_pages <= K:  # dense fallback: every page, -1 padded
        tl.store(out_row + slot, tl.where(slot < num_pages, slot, -1), mask=slot < K)
    else:
        bins = tl.arange(0, NBINS)
        hist = tl.load(hist_ptr + pair * NBINS + bins)
        tl.store(hist_ptr + pair * NBINS + bins, tl.zeros([NBINS], tl.int32))  # zero again for the next call
        b1, need = _pick_bin(hist, K - 2, NBINS)
        recent = num_pages - 1
        key_row = keys_ptr + pair.to(tl.int64) * max_pages
        cand_low = cand_low_ptr + pair.to(tl.int64) * max_pages
        cand_page = cand_page_ptr + pair.to(tl.int64) * max_pages
        # One scan: pages above the threshold bin are selected; pages inside it become candidates.
        n_above = 0
        n_cand = 0
        for start in range(1, recent, SCAN):
            page = start + tl.arange(0, SCAN)
            pm = page < recent
            u = tl.load(key_row + page, mask=pm, other=0)
            digit = u >> LOW_BITS
            above = pm & (digit > b1)
            inside = pm & (digit == b1)
            tl.store(out_row + 1 + n_above + tl.cumsum(above.to(tl.int32), axis=0) - 1, page, mask=above)
            pos = n_cand + tl.cumsum(inside.to(tl.int32), axis=0) - 1
            tl.store(cand_low + pos, u & ((1 << LOW_BITS) - 1), mask=inside)
            tl.store(cand_page + pos, page, mask=inside)
            n_above += tl.sum(above.to(tl.int32), axis=0)
            n_cand += tl.sum(inside.to(tl.int32), axis=0)
        tl.debug_barrier()  # candidates were stored by other threads of this program
        # Resolve the remaining LOW_BITS (= 9 + 8) bits among the candidates (usually one chunk).
        MID: tl.constexpr = LOW_BITS - 8
        hist_mid = tl.zeros([1 << MID], tl.int32)
        for c0 in range(0, n_cand, SCAN):
            idx = c0 + tl.arange(0, SCAN)
            low = tl.load(cand_low + idx, mask=idx < n_cand, other=0)
            hist_mid += tl.histogram(low >> 8, 1 << MID, mask=idx < n_cand)
        b2, need = _pick_bin(hist_mid, need, 1 << MID)
        hist_low = tl.zeros([256], tl.int32)
        for c0 in range(0, n_cand, SCAN):
            idx = c0 + tl.arange(0, SCAN)
            low = tl.load(cand_low + idx, mask=idx < n_cand, other=0)
            hist_low += tl.histogram(low & 255, 256, mask=(idx < n_cand) & ((low >> 8) == b2))
        b3, need = _pick_bin(hist_low, need, 256)
        threshold = (b2 << 8) | b3
        written = 1 + n_above
        ties = 0
        for c0 in range(0, n_cand, SCAN):
            idx = c0 + tl.arange(0, SCAN)
            cm = idx < n_cand
            low = tl.load(cand_low + idx, mask=cm, other=0)
            page = tl.load(cand_page + idx, mask=cm, other=0)
            tie = cm & (low == threshold)
            take = (cm & (low > threshold)) | (tie & (ties + tl.cumsum(tie.to(tl.int32), axis=0) - 1 < need))
            tl.store(out_row + written + tl.cumsum(take.to(tl.int32), axis=0) - 1, page, mask=take)
            written += tl.sum(take.to(tl.int32), axis=0)
            ties += tl.sum(tie.to(tl.int32), axis=0)
        tl.store(out_row, 0)
        tl.store(out_row + K - 1, recent)
        tl.debug_barrier()
        row = tl.load(out_row + slot, mask=slot < K, other=2147483647)
        tl.store(out_row + slot, tl.sort(row), mask=slot < K)
