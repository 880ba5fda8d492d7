// Page scores of score_select in CUDA (locks.md §2): the contract of kernels/score/transposed.py, for r8i4
// summaries, d = 128, bf16 queries and G <= 16 (kernels/score/cuda.py checks that and compiles this with NVRTC).
//
// Grid (S * Hkv, chunks), CTA_WARPS warps per program; each program scores the tiles [t_begin, t_end) of
// TILE = 4 pages of one (sequence, KV head) for its G query heads (the mma's M = 16 rows; rows >= G are zero
// queries), warp w taking tiles t_begin + w, + CTA_WARPS, ... (more warps per SM hide the load latency that
// one-warp programs left exposed: 17.8 µs at 128K bs1 with one warp, grid-limited to ~8 warps per SM).
// Each warp's tiles stream through STAGES shared-memory stages (bulk copies, below); from there every operand is
// read in the register layout of the mma that takes it, and no word is shuffled between lanes before the
// epilogue. Lane l is (g = l / 4, t = l % 4) of the PTX fragment tables.
//
// Query: per head, X = q / 2^e in 32-bit fixed point (e from the head's largest |q|: every bf16 element within
// 2^23 of it is exact), split into four signed bytes X = 2^24 p3 + 2^16 p2 + 2^8 p1 + p0 (24 bits, three bytes,
// where G > 8: then every element within 2^15 of the largest is exact, the rest rounded by at most 2^-24 of it;
// with |q| spread over decades that is up to ~7e-5 of a score, docs/results/archive/fixed-point-query-emulation-*).
// The int8 mma then reads the int4 codes and the int8 centroids as they are stored: a nibble needs one LOP3 to
// become a byte operand (the bf16 mma needed a LOP3, an HFMA2 and a shift per two nibbles). Two bytes (16 bits)
// were off the fp64 reference by up to 1e-2 where a head's |q| spans decades (outlier dims); three at G <= 8
// leave two rows of every other mma zero, and the compiler rebuilt those register quads before each mma.
// Dims: a k-step's 32 K slots are any 32 dims, provided the A operand (q) and the B operands (basis, centroid)
// agree. Lane t holds dims 32t .. 32t + 31 of every operand: one 16-byte load per basis column. In k-step j
// (j = 0..3), slot 4t + i is dim 32t + 8j + 2i and slot 16 + 4t + i is dim 32t + 8j + 2i + 1, which is exactly
// what `word & 0x0F0F0F0F` (and `(word >> 4) & 0x0F0F0F0F`) pulls out of basis word j (nibble i = dim i of the
// word's 8).
//  1. V^T q, per page: m16n8k32 s8 x u8 -> s32 (exact), A = byte pieces of X, B = basis codes n + 8
//     (unsigned nibbles; -8 sum(piece) later turns a piece's dot into its dot with n - 8). With G <= 8 two mmas a
//     k-step: rows g, g + 8 are head g's (p3, p2), then (p1, p0); else three, p2 .. p0 of 16 heads. Column n of
//     the n-tile is basis column g. V^T q / 2^e = 2^16 (256 p3. + p2.) + (256 p1. + p0.), both brackets exact in
//     int32 (three pieces: 2^16 p2. + (256 p1. + p0.)).
//  2. q . mu for the tile's 4 pages: one n-tile (s8 x s8) whose columns 2p and 2p + 1 both are page p's centroid
//     bytes (so lane t ends with page t's dot in its own registers), four k-steps per tile.
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
// X's byte pieces: 4 (two mmas a k-step of two pieces each) with one head per lane, 3 (three mmas of 16 heads,
// 24 bits: four spilled at the 128-register cap) with two.
#define PIECES (LANE_ROWS == 1 ? 4 : 3)
#define Q_MMAS (LANE_ROWS == 1 ? 2 : 3)  // mmas per k-step of V^T q

#ifndef STAGES
// Tiles per warp in shared memory: the one scored and STAGES - 1 in flight. Two beat three by 0.7-1.0 µs at 512K / 1M
// bs1 and 32K x 16 on the H200 (docs/decisions.md, "The score kernel").
#define STAGES 2
#endif
#ifndef MIN_WARPS_PER_SM
#define MIN_WARPS_PER_SM 16  // caps registers at 128
#endif
// A measuring instrument, never a served path (harness/lab/score_probe.py): 1 streams the rows and skips the
// arithmetic (what the loads alone cost), 2 skips the copies and scores whatever the stages hold (the arithmetic
// alone); 3 reads each page's scales as three aligned 32-bit pairs, as a [token, column, centroid] scale order would
// allow (what 12 fewer shared loads a tile are worth); 4 takes q's raw words as its digits (what the prologue's
// conversion costs); 5 replaces the log-sum-exp's ex2 and lg2 by identities (what the MUFU work costs). All five
// write garbage scores.
#ifndef SCORE_PROBE
#define SCORE_PROBE 0
#endif

typedef unsigned int u32;
typedef unsigned short u16;

// Row layout (kernels/reference/packing.py), passed by the compiler options: ROW_BYTES, COEF_OFF, BASIS_OFF,
// SCALE_OFF; ROW_OFFSET_T is unsigned int where the rows buffer is under 4 GiB (32-bit offset math for the bulk copies).
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

// d += A (16 x 32, s8) B (32 x 8, u8 or s8), exact in s32.
__device__ __forceinline__ void mma_s8u8(int (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.u8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The first k-step: d = A B (a zero accumulator: RZ, no register moves).
__device__ __forceinline__ void mma_s8u8_from(int (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.u8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(0));
}

__device__ __forceinline__ void mma_s8s8_from(int (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(0));
}

__device__ __forceinline__ void mma_s8s8(int (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
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
#if SCORE_PROBE == 5
__device__ __forceinline__ float ex2(float x) { return x; }
__device__ __forceinline__ float lg2(float x) { return x; }
#else
__device__ __forceinline__ float ex2(float x) { return exp2f(x); }
__device__ __forceinline__ float lg2(float x) { return __log2f(x); }
#endif

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

// X . v from the dots of its byte pieces plus their biases: 2^16 hi + lo with hi = 256 p3. + p2. + bias_hi (three
// pieces: p2. + bias_hi) and lo = 256 p1. + p0. + bias_lo, each exact in int32.
__device__ __forceinline__ float x_dot(int d3, int d2, int d1, int d0, int bias_hi, int bias_lo) {
    return fmaf((float)(256 * d3 + d2 + bias_hi), 65536.0f, (float)(256 * d1 + d0 + bias_lo));
}

__device__ __forceinline__ float x_dot3(int d2, int d1, int d0, int bias_hi, int bias_lo) {
    return fmaf((float)(d2 + bias_hi), 65536.0f, (float)(256 * d1 + d0 + bias_lo));
}

__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" : : "r"(bar), "r"(count) : "memory");
}

// The barriers' init visible to the bulk copies (the async proxy) before any copy signals them.
__device__ __forceinline__ void fence_mbar_init() { asm volatile("fence.mbarrier_init.release.cluster;" : : : "memory"); }

__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" : : "r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 : : "r"(dst), "l"(__cvta_generic_to_global(src)), "r"(bytes), "r"(bar) : "memory");
}

__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    u32 done;
    do {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
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

    const int* table_row = block_table + seq * s_bt;
    // The tile's 4 summary rows reach shared memory by bulk copies (one per row, issued by lanes 0-3, completing on
    // the stage's mbarrier) STAGES - 1 tiles ahead of the one being scored: a warp's loads then overlap its own
    // arithmetic instead of following it (loads issued per tile and waited on at once left the kernel at ~55% of
    // the HBM bandwidth with 16 warps per SM, whatever the instruction count).
    __shared__ __align__(128) unsigned char stage_rows[CTA_WARPS][STAGES][TILE * ROW_BYTES];
    __shared__ __align__(8) unsigned long long stage_bar[CTA_WARPS][STAGES];
    const u32 bar0 = smem_addr(&stage_bar[warp][0]);
    const u32 rows0 = smem_addr(&stage_rows[warp][0][0]);
    if (lane == 0) {
#pragma unroll
        for (int st = 0; st < STAGES; ++st) mbar_init(bar0 + 8 * st, 1);
        fence_mbar_init();
    }
    __syncwarp();
    const int first_tile = t_begin + warp;
    const int n_iter = first_tile < t_end ? (t_end - first_tile + CTA_WARPS - 1) / CTA_WARPS : 0;
    // Block id of page `lane` (lanes 0-3) of the warp's k-th tile; block 0 past n_full or n_iter (any valid row:
    // its results are masked below).
    auto tile_block = [&](int k) -> int {
        const int page = (first_tile + k * CTA_WARPS) * TILE + lane;
        return (lane < TILE && k < n_iter && page < n_full) ? __ldg(table_row + page) : 0;
    };
    auto issue = [&](int k, int blk) {  // the warp's k-th tile into stage k % STAGES
        if (SCORE_PROBE == 2) return;
        const u32 bar = bar0 + 8 * (k % STAGES);
        if (lane == 0) mbar_expect_tx(bar, TILE * ROW_BYTES);
        __syncwarp();
        if (lane < TILE)
            bulk_copy(rows0 + ((k % STAGES) * TILE + lane) * ROW_BYTES,
                      rows + ((ROW_OFFSET_T)blk * num_kv_heads + head) * ROW_BYTES, ROW_BYTES, bar);
    };
#pragma unroll
    for (int k = 0; k < STAGES - 1; ++k) {
        const int blk = tile_block(k);
        if (k < n_iter) issue(k, blk);
    }
    int next_blk = tile_block(STAGES - 1);  // one tile further ahead: its copy then waits on no table load
    // (The first tiles' copies go out before q's conversion below, which they do not need: at 16K-32K a warp
    // scores one or two tiles, and their DRAM round trip then overlaps the conversion.)
    // q as the A operand of every k-step (see the top comment): qa[m][j] is mma m's A in k-step j. bias_hi[h2] and
    // bias_lo[h2] turn row g + 8 h2's dots with the stored codes n + 8 into dots with n - 8 (-8 sum of 256 p3 + p2,
    // or of p2; -8 sum of 256 p1 + p0); lane_scale[h2] = its 2^e, times log2(e) scale.
    u32 qa[Q_MMAS][4][4];
    int bias_hi[LANE_ROWS], bias_lo[LANE_ROWS];
    float lane_scale[LANE_ROWS];
#if SCORE_PROBE == 4
    {
        const uint4* src = reinterpret_cast<const uint4*>(q + seq * s_qs + (long long)(head * group + g % group) * s_qh + 32 * t);
        u32 w[16];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const uint4 v = __ldg(src + i);
            w[4 * i] = v.x; w[4 * i + 1] = v.y; w[4 * i + 2] = v.z; w[4 * i + 3] = v.w;
        }
#pragma unroll
        for (int m = 0; m < Q_MMAS; ++m)
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int i = 0; i < 4; ++i) qa[m][j][i] = w[(4 * (m + j) + i) % 16];
#pragma unroll
        for (int h2 = 0; h2 < LANE_ROWS; ++h2) {
            bias_hi[h2] = 0;
            bias_lo[h2] = 0;
            lane_scale[h2] = log2_scale;
        }
    }
#else
    {
        u32 even[LANE_ROWS][PIECES][4], odd[LANE_ROWS][PIECES][4];  // [row g, g + 8][highest .. p0][k-step]: bytes of dims 8j + {0,2,4,6} / {1,3,5,7}
#pragma unroll
        for (int h2 = 0; h2 < LANE_ROWS; ++h2) {
            const int row = g + 8 * h2;
            float x[32];
            if (row < group) {
                const uint4* src = reinterpret_cast<const uint4*>(q + seq * s_qs + (long long)(head * group + row) * s_qh + 32 * t);
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const uint4 v = __ldg(src + i);
                    const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                    for (int k = 0; k < 4; ++k) {
                        x[8 * i + 2 * k] = __uint_as_float(w[k] << 16);
                        x[8 * i + 2 * k + 1] = __uint_as_float(w[k] & 0xFFFF0000u);
                    }
                }
            } else {
#pragma unroll
                for (int i = 0; i < 32; ++i) x[i] = 0.0f;
            }
            float amax = 0.0f;
#pragma unroll
            for (int i = 0; i < 32; ++i) amax = fmaxf(amax, fabsf(x[i]));
            amax = fmaxf(amax, shfl_xor(amax, 1));
            amax = fmaxf(amax, shfl_xor(amax, 2));
            // 2^(e + 8 PIECES - 1) > amax (1 + 2^-7): |X| < 2^(8 PIECES - 1) / 1.0078, so X plus a byte's rounding stays
            // in int32 and the top piece in [-127, 127] (a bf16 amax of mantissa 255 would pass the bound at
            // e = exponent - 8 PIECES + 2). Zero heads: X = 0.
            const int e = max(((__float_as_int(amax * 1.0078125f) >> 23) & 0xFF) - 127 - (8 * PIECES - 2), -100);
            const float inv = __int_as_float((127 - e) << 23);
            lane_scale[h2] = __int_as_float((127 + e) << 23) * log2_scale;
            // The balanced byte digits of X (each in [-128, 127], the top one too by the bound on e) are the bytes of
            // (X + 0x80..80) ^ 0x80808080 read as signed bytes: one add and one LOP3 a dim, all before a warp's first
            // tile. A 4 x 4 byte transpose (8 PRMT) gathers digit k of dims 8j + {0, 2, 4, 6} (and {1, 3, 5, 7}) into
            // one word, and a dp4a sums each word's four digits for the bias.
            int sum[PIECES] = {};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                u32 w[8];
#pragma unroll
                for (int i = 0; i < 8; ++i)  // dim 8j + i of this lane's 32
                    w[i] = ((u32)__float2int_rn(x[8 * j + i] * inv) + (PIECES == 4 ? 0x80808080u : 0x808080u)) ^ 0x80808080u;
                u32 digit[2][4];  // [even, odd dims][byte = digit p0 .. p3]
#pragma unroll
                for (int par = 0; par < 2; ++par) {
                    const u32 lo01 = prmt(w[par], w[par + 2], 0x5140u), hi01 = prmt(w[par], w[par + 2], 0x7362u);
                    const u32 lo23 = prmt(w[par + 4], w[par + 6], 0x5140u), hi23 = prmt(w[par + 4], w[par + 6], 0x7362u);
                    digit[par][0] = prmt(lo01, lo23, 0x5410u);
                    digit[par][1] = prmt(lo01, lo23, 0x7632u);
                    digit[par][2] = prmt(hi01, hi23, 0x5410u);
                    digit[par][3] = prmt(hi01, hi23, 0x7632u);
                }
#pragma unroll
                for (int k = 0; k < PIECES; ++k) {  // piece k (top first) is byte PIECES - 1 - k
                    const u32 ev = digit[0][PIECES - 1 - k], od = digit[1][PIECES - 1 - k];
                    sum[k] = __dp4a((int)od, 0x01010101, __dp4a((int)ev, 0x01010101, sum[k]));
                    even[h2][k][j] = ev;
                    odd[h2][k][j] = od;
                }
            }
#pragma unroll
            for (int k = 0; k < PIECES; ++k) {
                sum[k] += __shfl_xor_sync(0xFFFFFFFFu, sum[k], 1);
                sum[k] += __shfl_xor_sync(0xFFFFFFFFu, sum[k], 2);
            }
            bias_hi[h2] = -8 * (PIECES == 4 ? 256 * sum[0] + sum[1] : sum[0]);
            bias_lo[h2] = -8 * (256 * sum[PIECES - 2] + sum[PIECES - 1]);
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#if LANE_ROWS == 1  // mma m: rows g, g + 8 = head g's pieces 2m, 2m + 1 (in p3 .. p0 order)
#pragma unroll
            for (int m = 0; m < 2; ++m) {
                qa[m][j][0] = even[0][2 * m][j]; qa[m][j][1] = even[0][2 * m + 1][j];
                qa[m][j][2] = odd[0][2 * m][j]; qa[m][j][3] = odd[0][2 * m + 1][j];
            }
#else  // mma m: piece m of heads g and g + 8
#pragma unroll
            for (int m = 0; m < 3; ++m) {
                qa[m][j][0] = even[0][m][j]; qa[m][j][1] = even[1][m][j];
                qa[m][j][2] = odd[0][m][j]; qa[m][j][3] = odd[1][m][j];
            }
#endif
        }
    }
#endif
    // Centroid n-tile: columns g = 2p, 2p + 1 are page p's.
    const int mu_page = g >> 1;

    float run_max[LANE_ROWS], run_sum[LANE_ROWS];
#pragma unroll
    for (int h2 = 0; h2 < LANE_ROWS; ++h2) {
        run_max[h2] = NEG_INF;
        run_sum[h2] = 0.0f;
    }
    for (int k = 0; k < n_iter; ++k) {
        const int first = (first_tile + k * CTA_WARPS) * TILE;
        // Every lane has read stage (k - 1) % STAGES before a copy overwrites it: those reads fed the arithmetic
        // of the last tile, so they are complete (a proxy fence here costs a CTA-wide MEMBAR per tile).
        __syncwarp();
        if (k + STAGES - 1 < n_iter) issue(k + STAGES - 1, next_blk);
        next_blk = tile_block(k + STAGES);
        if (SCORE_PROBE != 2) mbar_wait(bar0 + 8 * (k % STAGES), (k / STAGES) & 1);
        if (SCORE_PROBE == 1) continue;
        const unsigned char* tile_rows = &stage_rows[warp][k % STAGES][0];
        uint4 basis[TILE];
#pragma unroll
        for (int p = 0; p < TILE; ++p)
            basis[p] = *reinterpret_cast<const uint4*>(tile_rows + p * ROW_BYTES + BASIS_OFF + g * (HEAD_DIM / 2) + 16 * t);
        uint4 mu_words[2];
        {
            const uint4* src = reinterpret_cast<const uint4*>(tile_rows + mu_page * ROW_BYTES + 32 * t);
            mu_words[0] = src[0];
            mu_words[1] = src[1];
        }
        u16 coef[TILE][2];  // (token 8u + g) coefficients of columns 2t, 2t + 1
        u16 tok_scale_h[TILE][4];  // tokens 2t, 2t + 1, 8 + 2t, 9 + 2t
        u16 col_scale_h[TILE][2];  // columns 2t, 2t + 1
#pragma unroll
        for (int p = 0; p < TILE; ++p) {
            const unsigned char* row = tile_rows + p * ROW_BYTES;
#pragma unroll
            for (int u = 0; u < 2; ++u)
                coef[p][u] = *reinterpret_cast<const u16*>(row + COEF_OFF + (8 * u + g) * RANK + 2 * t);
#if SCORE_PROBE == 3
            const u32* sw = reinterpret_cast<const u32*>(row + SCALE_OFF);
            const u32 tok_lo = sw[t], tok_hi = sw[4 + t], col = sw[8 + t];
            tok_scale_h[p][0] = (u16)tok_lo;
            tok_scale_h[p][1] = (u16)(tok_lo >> 16);
            tok_scale_h[p][2] = (u16)tok_hi;
            tok_scale_h[p][3] = (u16)(tok_hi >> 16);
            col_scale_h[p][0] = (u16)col;
            col_scale_h[p][1] = (u16)(col >> 16);
#else
            const u16* sc = reinterpret_cast<const u16*>(row + SCALE_OFF);
            tok_scale_h[p][0] = sc[1 + 2 * t];
            tok_scale_h[p][1] = sc[2 + 2 * t];
            tok_scale_h[p][2] = sc[9 + 2 * t];
            tok_scale_h[p][3] = sc[10 + 2 * t];
            col_scale_h[p][0] = sc[1 + PAGE + 2 * t];
            col_scale_h[p][1] = sc[2 + PAGE + 2 * t];
#endif
        }
        const u16 mu_scale_h = *reinterpret_cast<const u16*>(tile_rows + t * ROW_BYTES + SCALE_OFF);

        // 2. q . mu of the tile's pages.
        int mu_acc[Q_MMAS][4];
        {
            const u32 mw[8] = {mu_words[0].x, mu_words[0].y, mu_words[0].z, mu_words[0].w,
                               mu_words[1].x, mu_words[1].y, mu_words[1].z, mu_words[1].w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const u32 b0 = prmt(mw[2 * j], mw[2 * j + 1], 0x6420u);  // dims 8j + {0, 2, 4, 6}
                const u32 b1 = prmt(mw[2 * j], mw[2 * j + 1], 0x7531u);  // dims 8j + {1, 3, 5, 7}
#pragma unroll
                for (int m = 0; m < Q_MMAS; ++m) {
                    if (j == 0) mma_s8s8_from(mu_acc[m], qa[m][j], b0, b1);
                    else mma_s8s8(mu_acc[m], qa[m][j], b0, b1);
                }
            }
        }

        float y[TILE][LANE_ROWS][4];  // logits in log2 units: [page][row g, g + 8][token 2t, 2t + 1, 8 + 2t, 9 + 2t]
#pragma unroll
        for (int p = 0; p < TILE; ++p) {
            // 1. V^T q / 2^e of page p: [16 rows, 8 columns]; this lane holds columns 2t, 2t + 1 of rows g, g + 8.
            int acc_q[Q_MMAS][4];
            const u32 bw[4] = {basis[p].x, basis[p].y, basis[p].z, basis[p].w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const u32 b0 = bw[j] & 0x0F0F0F0Fu;
                const u32 b1 = (bw[j] >> 4) & 0x0F0F0F0Fu;
#pragma unroll
                for (int m = 0; m < Q_MMAS; ++m) {
                    if (j == 0) mma_s8u8_from(acc_q[m], qa[m][j], b0, b1);
                    else mma_s8u8(acc_q[m], qa[m][j], b0, b1);
                }
            }
            // 2^e and log2(e) * scale join the column scales: the contraction then yields log2-unit logits per token scale.
            const float c0 = half_to_float(col_scale_h[p][0]);
            const float c1 = half_to_float(col_scale_h[p][1]);
            // A operand of the contraction: slot t = column 2t, slot t + 4 = column 2t + 1 (rows g, g + 8).
#if LANE_ROWS == 2  // mma m: piece m; rows g (registers 0, 1) and g + 8 (2, 3)
#define VQ(r, h2) x_dot3(acc_q[0][r], acc_q[1][r], acc_q[2][r], bias_hi[h2], bias_lo[h2])
            const float a_f[4] = {VQ(0, 0) * (c0 * lane_scale[0]), VQ(2, 1) * (c0 * lane_scale[1]),
                                  VQ(1, 0) * (c1 * lane_scale[0]), VQ(3, 1) * (c1 * lane_scale[1])};
#else  // mma m: pieces 2m (row g: registers 0, 1), 2m + 1 (row g + 8: 2, 3)
#define VQ(c) x_dot(acc_q[0][c], acc_q[0][2 + c], acc_q[1][c], acc_q[1][2 + c], bias_hi[0], bias_lo[0])
            const float a_f[4] = {VQ(0) * (c0 * lane_scale[0]), 0.0f, VQ(1) * (c1 * lane_scale[0]), 0.0f};
#endif
#undef VQ
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
        const float mu_scale = half_to_float(mu_scale_h);
#pragma unroll
        for (int h2 = 0; h2 < LANE_ROWS; ++h2) {
            const float s = (odd ? kept[1][h2] : kept[0][h2]) + shfl_xor(odd ? kept[0][h2] : kept[1][h2], 1);
            const float m = t == 0 ? gmax[0][h2] : t == 1 ? gmax[1][h2] : t == 2 ? gmax[2][h2] : gmax[3][h2];
            // mu_acc: column 2t is page t (centroid bytes are signed: no bias)
#if LANE_ROWS == 2
            const float x_mu = x_dot3(mu_acc[0][2 * h2], mu_acc[1][2 * h2], mu_acc[2][2 * h2], 0, 0);
#else
            const float x_mu = x_dot(mu_acc[0][0], mu_acc[0][2], mu_acc[1][0], mu_acc[1][2], 0, 0);
#endif
            const float score = m + lg2(s) + x_mu * (mu_scale * lane_scale[h2]);  // log2 units
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
