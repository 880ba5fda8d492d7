// Page scores of score_select in CUDA (locks.md §2): the contract of kernels/triton/score_t.py, for r8i4
// summaries, d = 128, bf16 queries and G <= 16 (kernels/cuda/score.py checks that and compiles this with NVRTC).
//
// Grid (S * Hkv, chunks), CTA_WARPS warps per program; each program scores the tiles [t_begin, t_end) of
// TILE = 4 pages of one (sequence, KV head) for its G query heads (the mma's M = 16 rows; rows >= G are zero
// queries), warp w taking tiles t_begin + w, + CTA_WARPS, ... (more warps per SM hide the load latency that
// one-warp programs left exposed: 17.8 µs at 128K bs1 with one warp, grid-limited to ~8 warps per SM).
// Every operand is built in the register layout of the mma that reads it, so no layout goes through shared
// memory and no word is shuffled between lanes before the epilogue. Lane l is (g = l / 4, t = l % 4) of the
// PTX fragment tables.
//
// Dims: a k-step's 16 K slots are any 16 dims, provided the A operand (q) and the B operands (basis, centroid)
// agree. Lane t holds dims 32t .. 32t + 31 of every operand: one 16-byte load per basis column. In k-step
// (w, hh) (w = 0..3, hh = 0..1), slot 2t + e is dim 32t + 8w + 2hh + 4e and slot 2t + 8 + e is dim
// 32t + 8w + 2hh + 1 + 4e, which is exactly what `((word >> 8hh) & 0x000F000F)` (and `>> 8hh + 4`) pulls out
// of a basis word (nibble i = dim i of the word's 8).
//  1. V^T q, per page: m16n8k16 bf16, A = q (exact), B = basis codes n - 8 (exact in bf16: one LOP3 places
//     nibbles in the mantissas of 128.0, one bf16x2 FMA subtracts 136), fp32 accumulate. Column n of the
//     n-tile is basis column g.
//  2. q . mu for the tile's 4 pages: one n-tile whose column g is page g / 2's centroid, high nibble (g even)
//     or low nibble (g odd) of each int8 (mu = 16 hi + lo; both exact in bf16 the same way).
//  3. Contraction with the coefficients: m16n8k8 tf32. The accumulator of step 1 holds columns (2t, 2t + 1);
//     mapping K slot t to column 2t and slot t + 4 to column 2t + 1 makes those registers the A operand as
//     they are. V^T q goes in as two tf32 terms (hi = top 11 bits, lo = the rest rounded: 22 bits), the int8
//     coefficients are exact in tf32.
//  4. Epilogue: per (page, head) log-sum-exp over the 16 tokens (each lane holds 4), reduced across the quad
//     so that lane t ends with page t's two rows, where step 2 left that page's q . mu.

#ifndef CTA_WARPS
#define CTA_WARPS 4
#endif
// LANE_ROWS 2: G <= 16, each lane's rows g and g + 8 are heads. LANE_ROWS 1: G <= 8, rows 8..15 of the
// contraction carry the lo term of V^T q (one tf32 mma per token block instead of two; rows g and g + 8 are
// added where they live) and the epilogue runs on one row per lane.
#ifndef LANE_ROWS
#define LANE_ROWS 2
#endif
#ifndef MIN_WARPS_PER_SM
#define MIN_WARPS_PER_SM 16  // caps registers at 128
#endif

typedef unsigned int u32;
typedef unsigned short u16;

// Row layout (kernels/reference/packing.py), passed by the compiler options: ROW_BYTES, COEF_OFF, BASIS_OFF,
// SCALE_OFF; ROW_OFFSET_T is unsigned int where the rows buffer is under 4 GiB (32-bit offset math).
#ifndef ROW_OFFSET_T
#define ROW_OFFSET_T unsigned long long
#endif
#define HEAD_DIM 128
#define PAGE 16
#define RANK 8
#define TILE 4
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

// (x & 0x000F000F) ^ magic, then one bf16x2 FMA: x * 1 + neg_bias (both halves exact).
// (One LOP3 in asm: written in C, the two constants cost an AND and an OR.)
__device__ __forceinline__ u32 nibble_pair(u32 x, u32 magic, u32 neg_bias) {
    u32 y, d;
    asm("lop3.b32 %0, %1, %2, %3, 0x6A;" : "=r"(y) : "r"(x), "r"(0x000F000Fu), "r"(magic));  // (x & b) ^ c
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(y), "r"(0x3F803F80u), "r"(neg_bias));
    return d;
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma_tf32(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 tf32_round(float x) {
    u32 d;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(d) : "f"(x));
    return d;
}

__device__ __forceinline__ float half_to_float(u16 h) {
    float f;
    asm("{ .reg .b16 t; mov.b16 t, %1; cvt.f32.f16 %0, t; }" : "=f"(f) : "h"(h));
    return f;
}

// With --use_fast_math these are single MUFU instructions (ex2.approx.ftz, lg2.approx.ftz), like Triton's.
__device__ __forceinline__ float ex2(float x) { return exp2f(x); }
__device__ __forceinline__ float lg2(float x) { return __log2f(x); }

// (m, s) <- the log-sum-exp pair of (m, s) and (m2, s2): s counts 2^(x - m) (log2 units); (-inf, 0) is empty.
__device__ __forceinline__ void merge_lse(float& m, float& s, float m2, float s2) {
    float top = fmaxf(m, m2);
    if (top == NEG_INF) {
        s = 0.0f;
    } else {
        s = s * ex2(m - top) + s2 * ex2(m2 - top);
    }
    m = top;
}

__device__ __forceinline__ float shfl_xor(float v, int mask) { return __shfl_xor_sync(0xFFFFFFFFu, v, mask); }

extern "C" __global__ void __launch_bounds__(32 * CTA_WARPS, MIN_WARPS_PER_SM / CTA_WARPS) locks_score_t(
    const u16* __restrict__ q, const unsigned char* __restrict__ rows, const int* __restrict__ block_table,
    const int* __restrict__ seq_lens, float* __restrict__ scores, float* __restrict__ chunk_max,
    float* __restrict__ chunk_sum, long long s_qs, long long s_qh, long long s_bt, int num_kv_heads,
    int max_pages, int num_chunks, int max_chunks, int group, int group_slots, float log2_scale) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int pair = blockIdx.x;
    const int chunk = blockIdx.y;
    const int seq = pair / num_kv_heads;
    const int head = pair - seq * num_kv_heads;
    const int n_full = max(seq_lens[seq] - 1, 0) / PAGE;  // scored pages: all before the recent one
    const int n_tiles = (n_full + TILE - 1) / TILE;
    const int per_chunk = (n_tiles + num_chunks - 1) / num_chunks;
    const int t_begin = chunk * per_chunk;
    const int t_end = min(t_begin + per_chunk, n_tiles);

    // q as the A operand of every k-step: rows g and g + 8, dims 32t .. 32t + 31 (see the top comment).
    u32 qa[8][4];
    {
        u32 lo_row[16], hi_row[16];
        const int rows_g[2] = {g, g + 8};
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            u32* dst = half ? hi_row : lo_row;
            const int row = rows_g[half];
            if (row < group) {
                const uint4* src = reinterpret_cast<const uint4*>(q + seq * s_qs + (long long)(head * group + row) * s_qh + 32 * t);
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    uint4 v = __ldg(src + i);
                    dst[4 * i] = v.x; dst[4 * i + 1] = v.y; dst[4 * i + 2] = v.z; dst[4 * i + 3] = v.w;
                }
            } else {
#pragma unroll
                for (int i = 0; i < 16; ++i) dst[i] = 0u;
            }
        }
#pragma unroll
        for (int w = 0; w < 4; ++w) {
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int i = 4 * w + hh;  // word of dims (32t + 8w + 2hh, +1); word i + 2 holds +4, +5
                qa[2 * w + hh][0] = prmt(lo_row[i], lo_row[i + 2], 0x5410);
                qa[2 * w + hh][1] = prmt(hi_row[i], hi_row[i + 2], 0x5410);
                qa[2 * w + hh][2] = prmt(lo_row[i], lo_row[i + 2], 0x7632);
                qa[2 * w + hh][3] = prmt(hi_row[i], hi_row[i + 2], 0x7632);
            }
        }
    }
    // Centroid n-tile: column g is page g / 2, high nibbles (g even: mu >> 4 = (nibble ^ 8) - 8) or low ones.
    const bool high_part = (g & 1) == 0;
    const u32 mu_shift = high_part ? 4u : 0u;
    const u32 mu_magic = high_part ? 0x43084308u : 0x43004300u;
    const u32 mu_bias = high_part ? 0xC308C308u : 0xC300C300u;  // -136, -128
    const int mu_page = g >> 1;

    float run_max[LANE_ROWS], run_sum[LANE_ROWS];
#pragma unroll
    for (int h2 = 0; h2 < LANE_ROWS; ++h2) {
        run_max[h2] = NEG_INF;
        run_sum[h2] = 0.0f;
    }
    const int* table_row = block_table + seq * s_bt;
    // Block ids one tile ahead (lane l holds page l % 4's; block 0 past n_full: any valid row, its results
    // masked below): a tile's row loads then wait on one round trip, not two.
    int next_blk;
    {
        const int page = (t_begin + warp) * TILE + t;
        next_blk = (t_begin + warp < t_end && page < n_full) ? __ldg(table_row + page) : 0;
    }
    for (int tile = t_begin + warp; tile < t_end; tile += CTA_WARPS) {
        const int first = tile * TILE;
        ROW_OFFSET_T row_off[TILE];
#pragma unroll
        for (int p = 0; p < TILE; ++p)
            row_off[p] = ((ROW_OFFSET_T)__shfl_sync(0xFFFFFFFFu, next_blk, p) * num_kv_heads + head) * ROW_BYTES;
        {
            const int page = first + CTA_WARPS * TILE + t;
            next_blk = (tile + CTA_WARPS < t_end && page < n_full) ? __ldg(table_row + page) : 0;
        }
        // Every load of the tile first.
        uint4 basis[TILE];
#pragma unroll
        for (int p = 0; p < TILE; ++p)
            basis[p] = __ldg(reinterpret_cast<const uint4*>(rows + row_off[p] + BASIS_OFF + g * (HEAD_DIM / 2) + 16 * t));
        // Lane-dependent picks among the tile's rows by selects (an indexed register array would spill).
        const ROW_OFFSET_T mu_row = mu_page == 0 ? row_off[0] : mu_page == 1 ? row_off[1] : mu_page == 2 ? row_off[2] : row_off[3];
        const ROW_OFFSET_T own_row = t == 0 ? row_off[0] : t == 1 ? row_off[1] : t == 2 ? row_off[2] : row_off[3];
        uint4 mu_words[2];
        {
            const uint4* src = reinterpret_cast<const uint4*>(rows + mu_row + 32 * t);
            mu_words[0] = __ldg(src);
            mu_words[1] = __ldg(src + 1);
        }
        u16 coef[TILE][2];  // (token 8u + g) coefficients of columns 2t, 2t + 1
        u16 tok_scale_h[TILE][4];  // tokens 2t, 2t + 1, 8 + 2t, 9 + 2t
        u16 col_scale_h[TILE][2];  // columns 2t, 2t + 1
#pragma unroll
        for (int p = 0; p < TILE; ++p) {
            const unsigned char* row = rows + row_off[p];
#pragma unroll
            for (int u = 0; u < 2; ++u)
                coef[p][u] = __ldg(reinterpret_cast<const u16*>(row + COEF_OFF + (8 * u + g) * RANK + 2 * t));
            const u16* sc = reinterpret_cast<const u16*>(row + SCALE_OFF);
            tok_scale_h[p][0] = __ldg(sc + 1 + 2 * t);
            tok_scale_h[p][1] = __ldg(sc + 2 + 2 * t);
            tok_scale_h[p][2] = __ldg(sc + 9 + 2 * t);
            tok_scale_h[p][3] = __ldg(sc + 10 + 2 * t);
            col_scale_h[p][0] = __ldg(sc + 1 + PAGE + 2 * t);
            col_scale_h[p][1] = __ldg(sc + 2 + PAGE + 2 * t);
        }
        const u16 mu_scale_h = __ldg(reinterpret_cast<const u16*>(rows + own_row + SCALE_OFF));

        // 2. q . mu of the tile's pages.
        float mu_acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        {
            const u32 mw[8] = {mu_words[0].x, mu_words[0].y, mu_words[0].z, mu_words[0].w,
                               mu_words[1].x, mu_words[1].y, mu_words[1].z, mu_words[1].w};
#pragma unroll
            for (int w = 0; w < 4; ++w) {
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    // bytes of dims (8w + 2hh, 8w + 2hh + 4) and (+1, +5) into the low byte of each half
                    const u32 x0 = prmt(mw[2 * w], mw[2 * w + 1], hh ? 0x0602u : 0x0400u);
                    const u32 x1 = prmt(mw[2 * w], mw[2 * w + 1], hh ? 0x0703u : 0x0501u);
                    mma_bf16(mu_acc, qa[2 * w + hh], nibble_pair(x0 >> mu_shift, mu_magic, mu_bias),
                             nibble_pair(x1 >> mu_shift, mu_magic, mu_bias));
                }
            }
        }

        float y[TILE][LANE_ROWS][4];  // logits in log2 units: [page][row g, g + 8][token 2t, 2t + 1, 8 + 2t, 9 + 2t]
#pragma unroll
        for (int p = 0; p < TILE; ++p) {
            // 1. V^T q of page p: [16 heads, 8 columns]; this lane holds columns 2t, 2t + 1 of rows g, g + 8.
            float vq[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            const u32 bw[4] = {basis[p].x, basis[p].y, basis[p].z, basis[p].w};
#pragma unroll
            for (int w = 0; w < 4; ++w) {
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    mma_bf16(vq, qa[2 * w + hh], nibble_pair(bw[w] >> (8 * hh), 0x43004300u, 0xC308C308u),
                             nibble_pair(bw[w] >> (8 * hh + 4), 0x43004300u, 0xC308C308u));
                }
            }
            // log2(e) * scale joins the column scales: the contraction then yields log2-unit logits per token scale
            const float cs0 = half_to_float(col_scale_h[p][0]) * log2_scale;
            const float cs1 = half_to_float(col_scale_h[p][1]) * log2_scale;
            // A operand of the contraction: slot t = column 2t, slot t + 4 = column 2t + 1.
            const float a_f[4] = {vq[0] * cs0, vq[2] * cs0, vq[1] * cs1, vq[3] * cs1};
            u32 a_hi[4], a_lo[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                a_hi[i] = __float_as_uint(a_f[i]) & 0xFFFFE000u;
                a_lo[i] = tf32_round(a_f[i] - __uint_as_float(a_hi[i]));
            }
            // 3. Contraction with the tokens 8u .. 8u + 7 (this lane: token 8u + g as B, 8u + 2t, +1 as C).
#pragma unroll
            for (int u = 0; u < 2; ++u) {
                const u32 c = coef[p][u];
                const u32 b0 = __float_as_uint((float)(signed char)(c & 0xFFu));
                const u32 b1 = __float_as_uint((float)(signed char)(c >> 8));
                float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                const float ts0 = half_to_float(tok_scale_h[p][2 * u]);
                const float ts1 = half_to_float(tok_scale_h[p][2 * u + 1]);
#if LANE_ROWS == 2
                mma_tf32(acc, a_lo[0], a_lo[1], a_lo[2], a_lo[3], b0, b1);
                mma_tf32(acc, a_hi[0], a_hi[1], a_hi[2], a_hi[3], b0, b1);
                y[p][1][2 * u] = acc[2] * ts0;
                y[p][1][2 * u + 1] = acc[3] * ts1;
#else  // rows 8..15: the lo terms of rows 0..7
                mma_tf32(acc, a_hi[0], a_lo[0], a_hi[2], a_lo[2], b0, b1);
                acc[0] += acc[2];
                acc[1] += acc[3];
#endif
                y[p][0][2 * u] = acc[0] * ts0;
                y[p][0][2 * u + 1] = acc[1] * ts1;
            }
        }
        // 4. Per (page, row): the max over the quad (all four lanes then share it), this lane's 4 terms, and the
        // sums reduced across the quad so that lane t ends with page t: lanes t < 2 keep pages 0-1 (xor 2), then
        // lane t keeps page t (xor 1). Rows of pages past n_full hold garbage and stay in their own groups.
        float gmax[TILE][LANE_ROWS], gsum[TILE][LANE_ROWS];
#pragma unroll
        for (int p = 0; p < TILE; ++p) {
#pragma unroll
            for (int h2 = 0; h2 < LANE_ROWS; ++h2) {
                const float* v = y[p][h2];
                float m = fmaxf(fmaxf(v[0], v[1]), fmaxf(v[2], v[3]));
                m = fmaxf(m, shfl_xor(m, 1));
                m = fmaxf(m, shfl_xor(m, 2));
                gmax[p][h2] = m;
                gsum[p][h2] = (ex2(v[0] - m) + ex2(v[1] - m)) + (ex2(v[2] - m) + ex2(v[3] - m));
            }
        }
        const bool upper = t >= 2;
        const bool odd = (t & 1) != 0;
        float kept[2][LANE_ROWS];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
#pragma unroll
            for (int h2 = 0; h2 < LANE_ROWS; ++h2) {
                const float send = upper ? gsum[i][h2] : gsum[2 + i][h2];
                kept[i][h2] = (upper ? gsum[2 + i][h2] : gsum[i][h2]) + shfl_xor(send, 2);
            }
        }
        const int page = first + t;
        const bool valid = page < n_full;
        const float mu_scale = half_to_float(mu_scale_h) * log2_scale;
#pragma unroll
        for (int h2 = 0; h2 < LANE_ROWS; ++h2) {
            const float s = (odd ? kept[1][h2] : kept[0][h2]) + shfl_xor(odd ? kept[0][h2] : kept[1][h2], 1);
            const float m = t == 0 ? gmax[0][h2] : t == 1 ? gmax[1][h2] : t == 2 ? gmax[2][h2] : gmax[3][h2];
            // mu_acc: columns 2t (high nibbles) and 2t + 1 (low) of page t, rows g (0, 1) and g + 8 (2, 3)
            const float q_mu = 16.0f * mu_acc[2 * h2] + mu_acc[2 * h2 + 1];
            const float score = m + lg2(s) + q_mu * mu_scale;  // log2 units
            const int row = g + 8 * h2;
            if (valid) {
                if (row < group)
                    scores[((long long)pair * max_pages + page) * group_slots + row] = score * 0.6931471805599453f;
                const float top = fmaxf(run_max[h2], score);  // finite: the running max starts at -inf only
                run_sum[h2] = run_sum[h2] * ex2(run_max[h2] - top) + ex2(score - top);
                run_max[h2] = top;
            }
        }
    }
    // The chunk's (max, sum) per row: over the quad's pages, then over the warps.
    __shared__ float warp_max[CTA_WARPS][16], warp_sum[CTA_WARPS][16];
#pragma unroll
    for (int h2 = 0; h2 < LANE_ROWS; ++h2) {
        merge_lse(run_max[h2], run_sum[h2], shfl_xor(run_max[h2], 1), shfl_xor(run_sum[h2], 1));
        merge_lse(run_max[h2], run_sum[h2], shfl_xor(run_max[h2], 2), shfl_xor(run_sum[h2], 2));
        if (t == 0) {
            warp_max[warp][g + 8 * h2] = run_max[h2];
            warp_sum[warp][g + 8 * h2] = run_sum[h2];
        }
    }
    __syncthreads();
    if ((int)threadIdx.x < 8 * LANE_ROWS && (int)threadIdx.x < group_slots) {
        const int row = threadIdx.x;
        float m = warp_max[0][row], s = warp_sum[0][row];
#pragma unroll
        for (int w = 1; w < CTA_WARPS; ++w) merge_lse(m, s, warp_max[w][row], warp_sum[w][row]);
        const long long part = ((long long)pair * max_chunks + chunk) * group_slots + row;
        chunk_max[part] = m * 0.6931471805599453f;
        chunk_sum[part] = s;
    }
}
