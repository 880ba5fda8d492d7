"""The score kernel with query heads as the dots' M ("transposed"; ScoreTuning.transposed).

Same contract as `score_select._score_kernel` (same arguments, same scratch outputs), for int4 bases read as
32-bit words (`score_select.word_decode_fits`). The difference is where V^T q lives: here the basis dot is
q [M, d] x V^T [d, P*RP], so (V^T q)^T comes out as an mma accumulator whose registers are already the A
operand of the coefficient contraction (query heads stay the rows). That contraction is one dot against the
tile's coefficients laid out block-diagonally, [P*RP, P*B], with no shared-memory round trip for V^T q; the
ncu measurements put the scorer's time in such operand shuffles.

M is max(16, next_pow2(G)). Where M = 2 next_pow2(G) (G = 8: the mma's 16 rows), the second half of the rows
repeats the queries and carries the next bf16 term of V^T q through the same dot; the halves are added in the
threads that hold them (rows i and i + 8 of an mma accumulator share a thread), so the epilogue runs on G rows.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .pages import LN2, LOG2E, _in_units, _mma, _paired_codes, _program_tiles, _row_offset


@triton.jit
def _q_shifts(q, M: tl.constexpr, D_PAD: tl.constexpr):
    """q [M, D] -> the four [M, D/4] operands in `_paired_codes`' K order: for shift 4S, column 2j + c is
    dim 8j + S + 4c. Split in registers from one contiguous load (four gathers of 2-byte elements cost the
    prologue ~70 loads per thread)."""
    parts = tl.reshape(q, [M, D_PAD // 8, 2, 2, 2])  # dim 8j + 4c + 2 s1 + s0 -> [m, j, c, s1, s0]
    even, odd = tl.split(parts)  # s0
    s0, s2 = tl.split(even)  # s1
    s1, s3 = tl.split(odd)
    return (tl.reshape(s0, [M, D_PAD // 4]), tl.reshape(s1, [M, D_PAD // 4]),
            tl.reshape(s2, [M, D_PAD // 4]), tl.reshape(s3, [M, D_PAD // 4]))


@triton.jit
def _score_t_kernel(
    q_ptr, rows_u8, rows_i8, rows_f16, block_table_ptr, seq_lens_ptr,
    scores_ptr, chunk_max_ptr, chunk_sum_ptr,
    s_qs, s_qh, s_bt, num_kv_heads, row_bytes, max_pages, num_chunks, scale,
    G: tl.constexpr, G_DOT: tl.constexpr, GS: tl.constexpr, MAXC: tl.constexpr, M: tl.constexpr,
    D: tl.constexpr, D_PAD: tl.constexpr, B: tl.constexpr, R: tl.constexpr,
    COEF_OFF: tl.constexpr, BASIS_OFF: tl.constexpr, SCALE_OFF: tl.constexpr,
    P: tl.constexpr, RP: tl.constexpr, FP32: tl.constexpr, SPLIT: tl.constexpr, ROWS32: tl.constexpr = False,
):
    pair, chunk, s, h, n_full, t_begin, t_end = _program_tiles(seq_lens_ptr, num_kv_heads, num_chunks, B, P)

    DOT_T = tl.float32 if FP32 else q_ptr.dtype.element_ty
    # V^T q in bf16 terms for 16-bit queries (SPLIT), one fp32 term for fp32 ones. The interpreter (FP32 dots:
    # it cannot multiply bf16) rounds the same terms and widens them, so it runs the GPU's term logic.
    TERM_T = tl.bfloat16 if SPLIT else tl.float32
    MMA_T = tl.float32 if FP32 else tl.bfloat16
    HALVES: tl.constexpr = M == 2 * G_DOT  # rows G_DOT.. repeat the queries and carry the next term
    OUT: tl.constexpr = G_DOT if HALVES else M  # rows of the epilogue
    m = tl.arange(0, M)
    head = m % G_DOT if HALVES else m
    q_rows = q_ptr + s * s_qs + (h * G + head)[:, None] * s_qh
    d = tl.arange(0, D_PAD)
    q = tl.load(q_rows + d[None, :], mask=(head < G)[:, None] & (d < D)[None, :], other=0.0).to(DOT_T)
    q_s0, q_s1, q_s2, q_s3 = _q_shifts(q, M, D_PAD)
    # the centroid dot's rows beyond the heads are zero (with HALVES its halves are added like the others)
    q_full = tl.where((m < G)[:, None], q, tl.zeros_like(q))
    g = tl.arange(0, OUT)
    g_ok = g < G
    jw = tl.arange(0, D_PAD // 8)
    rows_i32 = rows_u8.to(tl.pointer_type(tl.int32))
    n = tl.arange(0, P * RP)  # basis columns of a tile, (page, column), column fastest
    n_page = n // RP
    n_col = n % RP
    c = tl.arange(0, P * B)  # tokens of a tile, (page, token), token fastest
    c_page = c // B
    c_tok = c % B
    log2_scale = scale * LOG2E

    run_max = tl.full([OUT], float("-inf"), tl.float32)
    run_sum = tl.zeros([OUT], tl.float32)
    for t in tl.range(t_begin, t_end):
        page = t * P + tl.arange(0, P)
        pm = page < n_full
        blk = tl.load(block_table_ptr + s * s_bt + page, mask=pm, other=0)
        row = _row_offset(blk, num_kv_heads, h, row_bytes, ROWS32)
        page_n = t * P + n_page
        nm = (page_n < n_full) & (n_col < R)
        blk_n = tl.load(block_table_ptr + s * s_bt + page_n, mask=page_n < n_full, other=0)
        row_n = _row_offset(blk_n, num_kv_heads, h, row_bytes, ROWS32)
        page_c = t * P + c_page
        cm = page_c < n_full
        blk_c = tl.load(block_table_ptr + s * s_bt + page_c, mask=cm, other=0)
        row_c = _row_offset(blk_c, num_kv_heads, h, row_bytes, ROWS32)
        # Loads first (a dot's operand shuffle is a barrier loads are not hoisted across), basis first.
        words = tl.load(rows_i32 + _in_units(row_n[:, None] + BASIS_OFF, 2, ROWS32) + n_col[:, None] * (D // 8) + jw[None, :],
                        mask=nm[:, None], other=-2004318072)  # other: code 8 (value 0) in every nibble
        coef = tl.load(rows_i8 + row_c[None, :] + COEF_OFF + c_tok[None, :] * R + n_col[:, None],
                       mask=(n_page[:, None] == c_page[None, :]) & nm[:, None] & cm[None, :], other=0)  # [P*RP, P*B] block-diagonal
        mu = tl.load(rows_i8 + row[:, None] + d[None, :], mask=pm[:, None] & (d < D)[None, :], other=0)
        col_scale = tl.load(rows_f16 + _in_units(row_n + SCALE_OFF, 1, ROWS32) + 1 + B + n_col, mask=nm, other=0.0).to(tl.float32)
        f_scales = _in_units(row + SCALE_OFF, 1, ROWS32)
        mu_scale = tl.load(rows_f16 + f_scales, mask=pm, other=0.0).to(tl.float32)
        tok_scale = tl.load(rows_f16 + _in_units(row_c + SCALE_OFF, 1, ROWS32) + 1 + c_tok, mask=cm, other=0.0).to(tl.float32)
        # (V^T q)^T [M, P*RP]: four dots of K = d/4, one per nibble shift.
        vq = _mma(q_s0, tl.trans(_paired_codes(words, 0, P * RP, D_PAD, DOT_T)), tl.zeros([M, P * RP], tl.float32), FP32)
        vq = _mma(q_s1, tl.trans(_paired_codes(words, 4, P * RP, D_PAD, DOT_T)), vq, FP32)
        vq = _mma(q_s2, tl.trans(_paired_codes(words, 8, P * RP, D_PAD, DOT_T)), vq, FP32)
        vq = _mma(q_s3, tl.trans(_paired_codes(words, 12, P * RP, D_PAD, DOT_T)), vq, FP32)
        vq = vq * col_scale[None, :]
        q_mu = _mma(q_full, tl.trans(mu.to(tl.float32).to(DOT_T)), tl.zeros([M, P], tl.float32), FP32)  # [M, P]
        # Coefficient contraction [M, P*RP] x [P*RP, P*B]: V^T q in three bf16 terms (24 significant bits;
        # int8 coefficients are exact in bf16), each straight from the accumulator's registers.
        # (fp32 queries: one term, mid = lo = 0.)
        bd = coef.to(tl.float32).to(MMA_T)
        hi = vq.to(TERM_T)
        rest = vq - hi.to(tl.float32)
        mid = rest.to(TERM_T)
        lo = (rest - mid.to(tl.float32)).to(TERM_T)
        if HALVES:  # hi (top rows) and mid (bottom rows) in one dot, then lo in the top rows
            top = (m < G_DOT)[:, None]
            acc = _mma(tl.where(top, hi, mid).to(MMA_T), bd, tl.zeros([M, P * B], tl.float32), FP32)
            if SPLIT:
                acc = _mma(tl.where(top, lo, tl.zeros_like(lo)).to(MMA_T), bd, acc, FP32)
            # rows i and i + G_DOT hold the same head: added where they live (one thread holds both)
            acc = tl.sum(tl.reshape(acc, [2, G_DOT, P * B]), axis=0)
            q_mu = tl.sum(tl.reshape(q_mu, [2, G_DOT, P]), axis=0)  # bottom rows are zero queries
        else:
            acc = _mma(hi.to(MMA_T), bd, tl.zeros([M, P * B], tl.float32), FP32)
            if SPLIT:
                acc = _mma(mid.to(MMA_T), bd, acc, FP32)
                acc = _mma(lo.to(MMA_T), bd, acc, FP32)
        # Logits in log2 units; the centroid term is constant over a page's tokens, so it joins after the LSE.
        y = tl.reshape(acc * (tok_scale * log2_scale)[None, :], [OUT, P, B])
        page_max = tl.max(y, axis=2)
        lse = page_max + tl.log2(tl.sum(tl.exp2(y - page_max[:, :, None]), axis=2))  # [OUT, P]
        score = lse + q_mu * (mu_scale * log2_scale)[None, :]
        score = tl.where(pm[None, :], score, float("-inf"))
        out = scores_ptr + (pair.to(tl.int64) * max_pages + page[None, :]) * GS + g[:, None]
        tl.store(out, score * LN2, mask=pm[None, :] & g_ok[:, None])
        new_max = tl.maximum(run_max, tl.max(score, axis=1))
        run_sum = run_sum * tl.exp2(run_max - new_max) + tl.sum(tl.exp2(score - new_max[:, None]), axis=1)
        run_max = new_max
    part = (pair * MAXC + chunk) * GS + g
    tl.store(chunk_max_ptr + part, run_max * LN2, mask=g < GS)
    tl.store(chunk_sum_ptr + part, run_sum, mask=g < GS)
