"""Page scoring + GQA combine + top-k page selection (locks.md §2-3), in four launches.

Reference: `reference.score.summary_page_scores`, `reference.select.combine_group` (page_mask =
the scored pages, page < (seq_len - 1) // B: every page before the recent one, `config.scored_pages`) and `reference.select.select_pages`.

1. `_score_kernel`, grid (S * Hkv, num_chunks): each program streams a contiguous range of tiles
   of P_TILE pages of one (sequence, KV head). A tile's rows are read ONCE for all G query heads:
   centroid and basis columns go through tl.dot (int values are exact in bf16/fp16, so the tensor
   cores see exact products; scales are applied after the product in fp32), the coefficient
   contraction runs on CUDA cores. It writes the per-head LSE scores s[g, j] (fp32 scratch) and
   an online (max, sum-exp) per head and chunk, so the softmax normalizer needs no second pass
   over the summaries. Loop bounds come from seq_lens on the device: work tracks the live pages.
   Bytes: row_bytes per scored page (832 for r8i4, d=128) + 4*G written (+ re-read below).
2. `_keys_kernel`, grid (S * Hkv, num_chunks): merges the chunk normalizers and writes each
   contested page's group key (the log of its share-average / group-max share / mass fraction,
   all <= 0; same order as the reference) as 30-bit fixed point (2^-24 steps), and adds its
   top-13-bit histogram into a per-(sequence, KV head) global histogram (atomics, 8192 bins).
3. `_gather_kernel`, grid (S * Hkv, num_chunks): each program re-derives the threshold bin from
   the finished histogram, scans its chunk of keys, appends the pages above the bin to the output
   (atomic slot counter) and compacts the pages inside it, in page order, into its own page range.
   Bytes: 32 KB of histogram (L2) per program + 4 per contested page + 8 per candidate.
4. `_select_kernel`, grid (S * Hkv,): the remaining 17 bits are resolved among the candidates
   (9 + 8 bit histograms; ties to the lower page id, as the reference), then sink + recent, sorted
   ascending. Its work does not grow with the context. Pages <= k: every page, -1 padded (dense
   fallback decided on the device). Key resolution: log shares below -64 (share < 2e-28) all tie
   at 0, and keys within 2^-24 in log share tie; both go to the lower page id.
All scratch lives in `ScoreSelectWorkspace` (allocated once by the caller; CUDA-graph safe).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import mm

# Cost model (r8i4, G=8, d=128): the scorer is bound by instruction issue and stalls, not bytes: ~1400
# SASS per thread per 16-page tile (int4 unpack, operand shuffles through shared memory, address math)
# against 0.4 us to stream the tile at 4.23 TB/s / 132 SMs. Measured on the H200 (harness/score_sweep.py,
# 2026-11-29): 8 warps x 128 registers (2 programs/SM) 91.6 us at 128K bs1, 4 warps x 128 registers
# (4 programs/SM) 57.2 us, uncapped registers slower still; software pipelining (tl.range stages=2)
# and the int-to-float nibble path were 5-10% slower. More resident warps hide the latency of each
# tile's loads and barriers; reaching the floor needs a few hundred instructions per tile.
P_TILE = 16  # pages per tile: the N of every tl.dot
MAX_CHUNKS = 64  # score programs per (sequence, KV head) at most; fixed by the workspace
SCORE_WARPS = 4
SCORE_MAXNREG = 128  # r8i4, G=8, d=128 at 8 warps: 165 registers uncapped; capped at 128: no spill (aot.py)
# Programs do equal work, so the launch fills at most one wave (2.06 waves take 3 waves' time, one
# wave of twice the pages takes 2): the grid is floor(slots / pairs) chunks per pair, slots =
# programs resident per SM (64K registers / (maxnreg x threads)) x SMs.


@dataclass(frozen=True)
class ScoreTuning:
    """Launch shape of the score kernel (the kernel bench's --sweep-score times alternatives; results
    must not depend on it beyond fp32 summation order). maxnreg None: the compiler's choice, and the
    grid assumes one program per SM; stages > 1 software-pipelines the tile loop (tl.range)."""

    warps: int = SCORE_WARPS
    maxnreg: int | None = SCORE_MAXNREG
    tile: int = P_TILE
    stages: int = 1
    mantissa_nibbles: bool = True  # False: int-to-float conversion of the int4 codes (the older path)

    @property
    def programs_per_sm(self) -> int:
        return max(1, 65536 // (self.maxnreg * self.warps * 32)) if self.maxnreg else 1  # uncapped: assume 1


DEFAULT_TUNING = ScoreTuning()
KEYS_BLOCK = 512  # pages per iteration of the key kernel
KEYS_WARPS = 8
# Candidates (pages in the threshold bin, 2^-7 wide in log share: usually a handful) per iteration of
# the select kernel's three resolve passes; tl.histogram costs elements x bins per lane (512 / 32).
CAND_BLOCK = 256  # [CAND, MAX_CHUNKS] chunk lookup: 512 spills on sm_90 at 16 warps
_CAND = tl.constexpr(CAND_BLOCK)  # as a global the jit reads it at compile time
SELECT_WARPS = 16
HIST_BINS = 8192  # top 13 of the 30 key bits; the select kernel resolves the low 17 bits among one bin
LOW_BITS = 17
COMBINE_CODES = {"share_average": 0, "group_max": 1, "group_mass": 2}


@dataclass(frozen=True)
class ScoreSelectWorkspace:
    """Scratch of score_select (R = max_num_seqs * num_kv_heads, GS = next_pow2(G), C = MAX_CHUNKS):
    scores [R, maxP, GS] fp32, chunk_max/chunk_sum [R, C, GS] fp32, keys/cand_low/cand_page
    [R, maxP] int32, hist [R, HIST_BINS] int32 and counts [R, C + 1] int32 (both must start zeroed;
    every call leaves them zeroed: counts[:, C] is the above-slot counter, counts[:, :C] per-chunk counts)."""

    scores: torch.Tensor
    chunk_max: torch.Tensor
    chunk_sum: torch.Tensor
    keys: torch.Tensor
    hist: torch.Tensor
    cand_low: torch.Tensor
    cand_page: torch.Tensor
    counts: torch.Tensor

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
def _nibble_value(n, DOT_T: tl.constexpr):
    """int32 codes 0..15 -> (n - 8) in DOT_T, exactly, without an int-to-float conversion.

    n goes into the mantissa of a float whose ulp is 1 (bf16 128, fp16 1024, fp32 2^23); one exact
    subtraction then gives n - 8. The loop does 64 such conversions per thread per tile (r8i4, d=128):
    as I2F (16/clk/SM on sm_90, a quarter of the ALU rate) they cost ~2K cycles per SM per tile pair,
    about a third of the scorer's issue budget; OR + subtract run at full rate.
    """
    if DOT_T == tl.bfloat16:
        return (n | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True) - 136.0
    elif DOT_T == tl.float16:
        return (n | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1032.0
    else:
        return ((n | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0).to(DOT_T)


@triton.jit
def _score_kernel(
    q_ptr, rows_u8, rows_i8, rows_f16, block_table_ptr, seq_lens_ptr,
    scores_ptr, chunk_max_ptr, chunk_sum_ptr,
    s_qs, s_qh, s_bt, num_kv_heads, row_bytes, max_pages, num_chunks, scale,
    G: tl.constexpr, G_DOT: tl.constexpr, GS: tl.constexpr, MAXC: tl.constexpr,
    D: tl.constexpr, D_PAD: tl.constexpr, B: tl.constexpr, R: tl.constexpr, BITS: tl.constexpr,
    COEF_OFF: tl.constexpr, BASIS_OFF: tl.constexpr, SCALE_OFF: tl.constexpr,
    P: tl.constexpr, RP: tl.constexpr, FP32: tl.constexpr, STAGES: tl.constexpr = 1, MANTISSA: tl.constexpr = True,
):
    pair = tl.program_id(0)
    chunk = tl.program_id(1)
    s = pair // num_kv_heads
    h = pair % num_kv_heads
    n_full = tl.maximum(tl.load(seq_lens_ptr + s) - 1, 0) // B  # scored pages: all before the recent one
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
    # q^T [d, G] is the B operand of every dot: pages x columns are M (a multiple of 16) and the G heads
    # are N (8 for mma). With G as M the mma pads M=8 to 16 and the padding rows carry into the
    # coefficient contraction, which then ran twice per element.
    q_cols = q_ptr + s * s_qs + (h * G + g)[None, :] * s_qh
    q_full = tl.load(q_cols + d[:, None], mask=dm[:, None] & gm[None, :], other=0.0).to(DOT_T)
    q_even = tl.load(q_cols + 2 * jh[:, None], mask=jhm[:, None] & gm[None, :], other=0.0).to(DOT_T)
    q_odd = tl.load(q_cols + 2 * jh[:, None] + 1, mask=jhm[:, None] & gm[None, :], other=0.0).to(DOT_T)
    tok = tl.arange(0, B)

    run_max = tl.full([G_DOT], float("-inf"), tl.float32)
    run_sum = tl.zeros([G_DOT], tl.float32)
    # Every load of a tile is issued before its first tl.dot: a dot's operand shuffle has a barrier
    # the compiler will not hoist loads across, so per-column loads would cost a round trip each.
    n = tl.arange(0, P * RP)  # (page, basis column) pairs of a tile, column fastest
    n_page = n // RP
    n_col = n % RP
    # The coefficient contraction is a batched fp32 dot (ieee: FMA, fp32 like the old sum over c) with K
    # padded to 16 (tl.dot's minimum): column c of the coefficients sits at k = c * F, zeros between.
    KC: tl.constexpr = 16 if RP < 16 else RP
    F: tl.constexpr = KC // RP
    c3 = tl.arange(0, KC)
    c3_col = c3 // F
    c3_ok = (c3 % F == 0) & (c3_col < R)
    f_pad = tl.arange(0, F)
    for t in tl.range(t_begin, t_end, num_stages=STAGES):
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
        coef_idx = tok[None, :, None] * R + c3_col[None, None, :]  # element index inside the [B, r] block
        coef_mask = (page3 < n_full) & c3_ok[None, None, :]
        if BITS == 16:
            mu = tl.load(rows_f16 + row[:, None] // 2 + d[None, :], mask=pm[:, None] & dm[None, :], other=0.0)
            v = tl.load(rows_f16 + row_n[:, None] // 2 + BASIS_OFF // 2 + n_col[:, None] * D + d[None, :],
                        mask=nm[:, None] & dm[None, :], other=0.0)
            coef = tl.load(rows_f16 + (row3 + COEF_OFF) // 2 + coef_idx, mask=coef_mask, other=0.0).to(tl.float32)
            q_mu = mm(mu.to(tl.float32), q_full, True)  # [P, G_DOT]
            vq = mm(v.to(tl.float32), q_full, True)  # [P*RP, G_DOT]
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
            q_mu = mm(mu.to(tl.float32).to(DOT_T), q_full, FP32) * mu_scale[:, None]
            if BITS == 4:
                if MANTISSA:
                    low = _nibble_value(packed & 15, DOT_T)  # dims 0, 2, 4, ...
                    high = _nibble_value(packed >> 4, DOT_T)  # dims 1, 3, 5, ...
                else:
                    low = ((packed & 15) - 8).to(tl.float32).to(DOT_T)
                    high = ((packed >> 4) - 8).to(tl.float32).to(DOT_T)
                vq = mm(low, q_even, FP32) + mm(high, q_odd, FP32)
            else:
                vq = mm(v.to(tl.float32).to(DOT_T), q_full, FP32)
            vq = vq * col_scale[:, None]
            tok_scale = tok_scale.to(tl.float32)
        # Coefficient contraction on CUDA cores: acc[p, i, g] = sum_c (V^T q)[p, c, g] * C[p, i, c].
        vq_pad = tl.where((f_pad == 0)[None, None, :, None], tl.reshape(vq, [P, RP, 1, G_DOT]), 0.0)
        acc = tl.dot(coef, tl.reshape(vq_pad, [P, KC, G_DOT]), input_precision="ieee")  # [P, B, G_DOT]
        logits = (q_mu[:, None, :] + acc * tok_scale[:, :, None]) * scale  # [P, B, G_DOT]
        page_max = tl.max(logits, axis=1)
        score = page_max + tl.log(tl.sum(tl.exp(logits - page_max[:, None, :]), axis=1))  # [P, G_DOT]
        score = tl.where(pm[:, None], score, float("-inf"))
        out = scores_ptr + (pair.to(tl.int64) * max_pages + page[:, None]) * GS + g[None, :]
        tl.store(out, score, mask=pm[:, None] & gm[None, :])
        new_max = tl.maximum(run_max, tl.max(score, axis=0))
        run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(score - new_max[None, :]), axis=0)
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
def _gather_kernel(
    keys_ptr, hist_ptr, counts_ptr, cand_low_ptr, cand_page_ptr, seq_lens_ptr, out_ptr,
    num_kv_heads, max_pages, num_chunks, K,
    B: tl.constexpr, MAXC: tl.constexpr, BLOCK: tl.constexpr, NBINS: tl.constexpr, LOW_BITS: tl.constexpr,
):
    """Pages above the threshold bin go straight to the output; pages inside it become candidates.

    Same (pair, chunk) split as the key kernel, so the scan of every key is spread over the whole GPU
    (it was one program per pair: ~2.9K instructions per thread per 8192 keys on one SM, 8 passes at 1M).
    Each program re-derives the threshold bin from the finished histogram (32 KB, L2 hits). Above pages
    are unordered (atomic slot counter; the select kernel sorts), candidates keep page order: chunk c
    compacts them into its own page range [first_c, last_c) of cand_*, and its count goes to counts[c].
    """
    pair = tl.program_id(0)
    chunk = tl.program_id(1)
    s = pair // num_kv_heads
    num_pages = tl.cdiv(tl.load(seq_lens_ptr + s), B)
    if num_pages > K:
        hist = tl.load(hist_ptr + pair * NBINS + tl.arange(0, NBINS))
        b1, _ = _pick_bin(hist, K - 2, NBINS)
        recent = num_pages - 1
        per_chunk = tl.cdiv(recent - 1, num_chunks)
        first = 1 + chunk * per_chunk
        last = tl.minimum(first + per_chunk, recent)
        key_row = keys_ptr + pair.to(tl.int64) * max_pages
        cand_low = cand_low_ptr + pair.to(tl.int64) * max_pages + first
        cand_page = cand_page_ptr + pair.to(tl.int64) * max_pages + first
        out_row = out_ptr + pair.to(tl.int64) * K
        count_row = counts_ptr + pair * (MAXC + 1)
        n_cand = 0
        for start in range(first, last, BLOCK):
            page = start + tl.arange(0, BLOCK)
            pm = page < last
            u = tl.load(key_row + page, mask=pm, other=0)
            digit = u >> LOW_BITS
            above = pm & (digit > b1)
            inside = pm & (digit == b1)
            n_up = tl.sum(above.to(tl.int32), axis=0)
            if n_up > 0:  # fewer than k - 2 pages in all: the counter sees few atomics
                base = tl.atomic_add(count_row + MAXC, n_up, sem="relaxed")
                tl.store(out_row + 1 + base + tl.cumsum(above.to(tl.int32), axis=0) - 1, page, mask=above)
            pos = n_cand + tl.cumsum(inside.to(tl.int32), axis=0) - 1
            tl.store(cand_low + pos, u & ((1 << LOW_BITS) - 1), mask=inside)
            tl.store(cand_page + pos, page, mask=inside)
            n_cand += tl.sum(inside.to(tl.int32), axis=0)
        tl.store(count_row + chunk, n_cand)


@triton.jit
def _cand_block(cand_low, cand_page, seg_first, per_chunk, c_end, n_cand, f0, CAND: tl.constexpr):
    """Candidates f0 .. f0+CAND-1 of the chunk lists laid end to end (chunk order = page order).

    c_end [MAXC]: inclusive prefix sum of the per-chunk counts. Returns (low bits, page, valid) [CAND].
    """
    f = f0 + tl.arange(0, CAND)
    done = c_end[None, :] <= f[:, None]  # [CAND, MAXC]: chunks wholly before f
    c = tl.sum(done.to(tl.int32), axis=1)
    c_start = tl.max(tl.where(done, c_end[None, :], 0), axis=1)
    valid = f < n_cand
    pos = seg_first + c * per_chunk + f - c_start
    low = tl.load(cand_low + pos, mask=valid, other=0)
    page = tl.load(cand_page + pos, mask=valid, other=0)
    return low, page, valid


@triton.jit
def _select_kernel(
    hist_ptr, counts_ptr, cand_low_ptr, cand_page_ptr, seq_lens_ptr, out_ptr,
    num_kv_heads, max_pages, num_chunks, K,
    B: tl.constexpr, MAXC: tl.constexpr, NBINS: tl.constexpr, LOW_BITS: tl.constexpr, K_PAD: tl.constexpr,
):
    """Resolves the threshold bin among its candidates (ties to the lower page id) + sink + recent, ascending.

    Work is O(NBINS + candidates + k), independent of the context: the keys were scanned in parallel
    by _gather_kernel. At bs1 this is a chain of ~6 dependent memory round trips on one SM per pair.
    """
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
        _, need = _pick_bin(hist, K - 2, NBINS)
        count_row = counts_ptr + pair * (MAXC + 1)
        ch = tl.arange(0, MAXC)
        c_end = tl.cumsum(tl.load(count_row + ch, mask=ch < num_chunks, other=0), axis=0)
        n_cand = tl.sum(tl.where(ch == MAXC - 1, c_end, 0), axis=0)
        n_above = tl.load(count_row + MAXC)
        tl.store(count_row + MAXC, 0)  # the above-slot counter starts at zero on the next call
        recent = num_pages - 1
        per_chunk = tl.cdiv(recent - 1, num_chunks)
        cand_low = cand_low_ptr + pair.to(tl.int64) * max_pages
        cand_page = cand_page_ptr + pair.to(tl.int64) * max_pages
        # Resolve the remaining LOW_BITS (= 9 + 8) bits among the candidates (usually one block).
        MID: tl.constexpr = LOW_BITS - 8
        hist_mid = tl.zeros([1 << MID], tl.int32)
        for f0 in range(0, n_cand, _CAND):
            low, page, cm = _cand_block(cand_low, cand_page, 1, per_chunk, c_end, n_cand, f0, _CAND)
            hist_mid += tl.histogram(low >> 8, 1 << MID, mask=cm)
        b2, need = _pick_bin(hist_mid, need, 1 << MID)
        hist_low = tl.zeros([256], tl.int32)
        for f0 in range(0, n_cand, _CAND):
            low, page, cm = _cand_block(cand_low, cand_page, 1, per_chunk, c_end, n_cand, f0, _CAND)
            hist_low += tl.histogram(low & 255, 256, mask=cm & ((low >> 8) == b2))
        b3, need = _pick_bin(hist_low, need, 256)
        threshold = (b2 << 8) | b3
        written = 1 + n_above
        ties = 0
        for f0 in range(0, n_cand, _CAND):
            low, page, cm = _cand_block(cand_low, cand_page, 1, per_chunk, c_end, n_cand, f0, _CAND)
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
