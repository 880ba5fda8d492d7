"""Page scoring for score_select (locks.md §2): its first launch; combine + top-k follow (select/merge.py, select/chunked.py).

Reference: `reference.score.summary_page_scores` over the scored pages (`config.scored_pages`: every
page before the recent one).

`_score_kernel`, grid (S * Hkv, num_chunks): each program streams a contiguous range of tiles of
P_TILE pages of one (sequence, KV head). A tile's rows are read ONCE for all G query heads: centroid
and basis columns go through tl.dot (int values are exact in bf16/fp16, so the tensor cores see
exact products; scales are applied after the product in fp32), and so does the coefficient
contraction (`_coef_mma`: V^T q as three bf16 terms; an fp32 FMA dot where that does not apply). It writes the per-head LSE scores s[g, j] (fp32 scratch) and an online (max,
sum-exp) per head and chunk, so the softmax normalizer needs no second pass over the summaries.
Loop bounds come from seq_lens on the device: work tracks the live pages. Bytes: row_bytes per
scored page (832 for r8i4, d=128) + 4*G written.
All scratch lives in `ScoreSelectWorkspace` (allocated once by the caller; CUDA-graph safe).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..config import SCORER_KERNELS as _SCORER_KERNEL_NAMES
from ..config import SELECT_PATHS
from ..triton_common import mm

# Cost model (r8i4, G=8, d=128): the scorer streams 832 B per scored page but is bound by latency,
# not bytes. Its 16-page tile is ~1700 SASS per thread (harness/lab/compile_report.py, specialised like production: int4
# decode, the fp32 coefficient contraction, dot operand shuffles through shared memory with ~20
# barriers) against 0.4 us to stream the tile at 4.23 TB/s / 132 SMs. ncu (H200, 2026-11-29, 128K bs1,
# 128 chunks): 9 cycles per issued instruction, stalled on global loads (long scoreboard), the shared
# memory queue (MIO throttle) and shared loads, with 3x the ideal global sectors and 2x the ideal shared
# wavefronts. What helped, measured (harness/lab/score_sweep.py): filling every program slot (64 -> 128
# chunks: 57.2 -> 46.6 us), fewer and wider loads per tile (42.4 us). Launch tuning beyond that is
# exhausted: 8 warps, uncapped registers, software pipelining and int-to-float decode were all slower.
# H200 (2026-11-30, bs1): one warp per program over 4-page tiles
# (no barriers across warps; 16 programs per SM, each hiding its own latency) took 37.8 us at 128K against
# 42.2 for 4 warps x 16 pages; with the coefficient contraction on the tensor cores (`_coef_mma`) 29.3
# (10.0 against 12.8 at 32K). With 4 warps the same contraction gained only 1.5 us.
LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x * LOG2E)
LN2 = tl.constexpr(0.6931471805599453)
P_TILE = 4  # pages per tile (the dots' M is P * next_pow2(r))
MAX_CHUNKS = 512  # workspace capacity: score programs per (sequence, KV head); ScoreTuning.max_chunks caps the grid
SCORE_CHUNKS = 512  # the default cap: every program slot of a bs1 launch of one-warp programs (4 KV heads: 528)
# Selection chunks per pair at most (select/chunked.py's launches). Its last pass is O(chunks + k): on the H200
# (2026-11-29, 128K bs1, coarse picks) selection took 21.9 us over 32 chunks, 23.4 over 64 and 28.6 over
# 128, so it stays at 32 while the score grid fills every program slot.
SELECT_CHUNKS = 32
SCORE_WARPS = 1
SCORE_MAXNREG = 128  # r8i4, G=8, d=128: no spill at 1 warp x 4 pages (108 used with the tensor-core contraction; compile_report.py)
# Programs do equal work, so the launch fills at most one wave (2.06 waves take 3 waves' time, one
# wave of twice the pages takes 2): the grid is floor(slots / pairs) chunks per pair, slots =
# programs resident per SM (64K registers / (maxnreg x threads)) x SMs.


@dataclass(frozen=True)
class ScoreTuning:
    """Launch shape of the score kernel (harness/lab/score_sweep.py times alternatives; results
    must not depend on it beyond fp32 summation order). maxnreg None: the compiler's choice, and the
    grid assumes one program per SM; stages > 1 software-pipelines the tile loop (tl.range)."""

    warps: int = SCORE_WARPS
    maxnreg: int | None = SCORE_MAXNREG
    tile: int = P_TILE
    stages: int = 1
    mantissa_nibbles: bool = True  # False: int-to-float conversion of the int4 codes (the older path)
    # True: the int4 basis is read as 32-bit words and decoded two codes per operation (`_word_codes`);
    # used only where the layout allows it (`word_decode_fits`), else the byte path runs.
    word_nibbles: bool = True
    # True: each token's r int8 coefficients in one vector load, spread to the dot's K in registers
    # (29 vs 43 global loads in the sm_90 compile; more loop instructions and a few spill accesses, yet
    # faster: the scorer waits on loads and shared memory, not issue, once 128 chunks fill the SMs).
    # H200 2026-11-29, 128K bs1, 128 chunks: 46.6 us (neither), 46.3 (words), 44.6 (vector), 42.4 (both).
    coef_vector: bool = True
    # True: the coefficient contraction runs on the tensor cores (`_coef_mma`: one batched dot per tile,
    # V^T q split into three bf16 terms that carry fp32's 24 bits) instead of the fp32 FMA dot with K
    # padded from r to 16, whose operands go through shared memory. Used where r >= 4 (K = 4 * next_pow2(r))
    # and, on bf16/fp16 dots, G >= 8 (N < 8 is not an mma shape: the GPU check battery failed there).
    coef_mma: bool = True
    # narrow_offsets: row byte offsets in 32-bit math where the rows buffer is under 2 GiB (else 64-bit), and
    # shifts instead of signed divisions.
    narrow_offsets: bool = False
    # transposed: query heads as the dots' M (`score_t.py`): V^T q stays in the accumulator's registers as the
    # coefficient contraction's A operand, one block-diagonal dot per tile, log2 epilogue; int4 word path with
    # tile * next_pow2(r) >= 16 only (else this kernel runs). H200 (bs1): 27.9 / 12.2 µs at 128K / 32K over
    # 4-page tiles, 25.8 / 8.9 over 2-page tiles, against 29.5 / 10.0 for this kernel.
    transposed: bool = False
    # cuda: the CUDA kernel (kernels/score/score_t.cu) where `kernels.cuda.score.fits` accepts the call (r8i4,
    # d = 128, bf16 q, G <= 16, sm_90); the kernel this tuning otherwise names runs elsewhere.
    cuda: bool = False
    # Selection after the score kernel (config.SELECT_PATHS): "merge" (select/merge.py: each chunk's top-(k-2),
    # merged by the pair's last program; one launch) or "chunked" (select/chunked.py: keys, gather, resolve; also
    # where merge declines a budget). H100 kernel bench: merge 9.8 / 20.6 µs at 16K / 1M bs1 against the chunked
    # path's 17.4 / 36.4 (docs/decisions.md).
    select_path: str = "merge"
    # Chunks per (sequence, KV head) at most. At 64 a bs1 launch (4 KV heads) filled 256 of the 528
    # program slots; ncu on the H200 (2026-11-29, 128K bs1) saw 0.5 waves, 1.9 active warps per
    # scheduler and an issue every 3.2 cycles: the kernel waits on loads with too few warps to hide
    # them, so the default fills every slot (the grid is still capped at slots // pairs).
    max_chunks: int = SCORE_CHUNKS
    select_chunks: int = SELECT_CHUNKS  # chunks of the selection kernels at most (<= the score grid's)
    # True: threshold picks read 64 coarse + 128 fine histogram counts (select/chunked.py); False: all 8192.
    coarse_pick: bool = True

    def __post_init__(self) -> None:
        if self.select_path not in SELECT_PATHS:
            raise ValueError(f"select_path {self.select_path!r} must be one of {SELECT_PATHS}")
        for name in ("max_chunks", "select_chunks"):
            if not 1 <= getattr(self, name) <= MAX_CHUNKS:
                raise ValueError(f"{name} {getattr(self, name)} must be in 1..{MAX_CHUNKS} (the workspace capacity)")

    @property
    def programs_per_sm(self) -> int:
        return max(1, 65536 // (self.maxnreg * self.warps * 32)) if self.maxnreg else 1  # uncapped: assume 1


DEFAULT_TUNING = ScoreTuning()
# config.SCORER_KERNELS -> the ScoreTuning fields each name sets (the backend's `scorer_kernel` setting).
SCORER_KERNELS: dict[str, dict] = {
    "cuda": {"cuda": True, "transposed": True, "narrow_offsets": True, "tile": 2},  # the transposed kernel where it declines
    "transposed": {"transposed": True, "narrow_offsets": True, "tile": 2},
    "pages": {},
}
assert tuple(SCORER_KERNELS) == _SCORER_KERNEL_NAMES


def word_decode_fits(basis_bits: int, head_dim: int, row_bytes: int, basis_offset: int) -> bool:
    """The word path needs int4 codes, whole 32-bit words per basis column and row, and K = d/8 a
    power of two >= 16 for tl.dot (d = 128, 256)."""
    k = head_dim // 8
    return (basis_bits == 4 and head_dim % 8 == 0 and k >= 16 and k & (k - 1) == 0
            and row_bytes % 4 == 0 and basis_offset % 4 == 0)


@dataclass(frozen=True)
class ScoreSelectWorkspace:
    """Scratch of score_select (R = max_num_seqs * num_kv_heads, GS = next_pow2(G), C = MAX_CHUNKS):
    scores [R, maxP, GS] fp32, chunk_max/chunk_sum [R, C, GS] fp32, keys/cand_low/cand_page [R, maxP]
    int32, hist [R, 8192 + 64] (fine counts, then coarse ones) and low_hist [R, 1024] int32 and counts [R, 2C + 6] int32
    (select/chunked.py `_count_row`; the histograms, counts[:, C] and counts[:, 2C+1] must start zeroed and every
    call leaves them zeroed; counts[:, C] is the chunked path's output slot counter, counts[:, 2C+1] the
    arrival counter of both paths; the rest is rewritten by every call; the merge path writes its chunks' lists
    to cand_low (keys) and cand_page)."""

    scores: torch.Tensor
    chunk_max: torch.Tensor
    chunk_sum: torch.Tensor
    keys: torch.Tensor
    hist: torch.Tensor
    low_hist: torch.Tensor
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
def _word_codes(words, SHIFT: tl.constexpr, DOT_T: tl.constexpr):
    """int32 words of packed int4 codes -> (lo, hi) = codes of nibble SHIFT/4 of bytes 0 and 2, minus 8.

    Byte b of a word holds dims 2b (low nibble) and 2b+1 (high); SHIFT 0, 4, 8, 12 gives the dims
    (0, 4), (1, 5), (2, 6), (3, 7) of the word's 8. For 16-bit DOT_T one AND+OR (a single LOP3) places
    both codes in the mantissas of two halves whose ulp is 1, so two codes cost about 3 operations
    instead of ~9 on the byte path (the H200 scorer is bound by instruction issue).
    """
    if DOT_T == tl.bfloat16:
        t = ((words >> SHIFT) & 0x000F000F) | 0x43004300
        lo = (t & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True) - 136.0
        hi = (t >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True) - 136.0
    elif DOT_T == tl.float16:
        t = ((words >> SHIFT) & 0x000F000F) | 0x64006400
        lo = (t & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True) - 1032.0
        hi = (t >> 16).to(tl.int16).to(tl.float16, bitcast=True) - 1032.0
    else:
        lo = _nibble_value((words >> SHIFT) & 15, DOT_T)
        hi = _nibble_value((words >> (SHIFT + 16)) & 15, DOT_T)
    return lo, hi


@triton.jit
def _token_vectors(tok, page3, n_full, R: tl.constexpr, RP: tl.constexpr):
    """(index, mask) [P, B, RP] of each token's r coefficients inside a row's [B, r] block (one vector load)."""
    c_r = tl.arange(0, RP)
    return tok[None, :, None] * R + c_r[None, None, :], (page3 < n_full) & (c_r < R)[None, None, :]


@triton.jit
def _spread_columns(coef, f_pad, P: tl.constexpr, B: tl.constexpr, KC: tl.constexpr):
    """[P, B, RP] coefficients -> fp32 [P, B, KC] with column c at k = c * F and zeros between (F = KC / RP)."""
    wide = tl.where((f_pad == 0)[None, None, None, :], coef.to(tl.float32)[:, :, :, None], 0.0)
    return tl.reshape(wide, [P, B, KC])


@triton.jit
def _mma(a, b, acc, FP32: tl.constexpr):
    """acc + a @ b (fp32 accumulator), with `mm`'s precision rule."""
    if FP32:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _coef_mma(coef, vq, P: tl.constexpr, B: tl.constexpr, RP: tl.constexpr, G_DOT: tl.constexpr, FP32: tl.constexpr):
    """acc[p, i, g] = sum_c coef[p, i, c] * vq[p * RP + c, g] ([P, B, RP] x [P * RP, G_DOT] -> fp32 [P, B, G_DOT])
    as one batched tensor-core dot with K = 4 RP: K segment j holds term j of vq = hi + mid + lo (bf16 each,
    24 significant bits in all: the fp32 result up to its last bit or so; segment 3 is zero) and the
    coefficients repeat in every segment (int8 codes are exact in bf16). With FP32 the terms are fp32
    (mid = lo = 0) and the dot runs ieee: the interpreter's path, and the fp16-format one."""
    SPLIT_T = tl.float32 if FP32 else tl.bfloat16
    v = tl.reshape(vq, [P, RP, G_DOT])
    hi = v.to(SPLIT_T)
    rest = v - hi.to(tl.float32)
    mid = rest.to(SPLIT_T)
    lo = (rest - mid.to(tl.float32)).to(SPLIT_T)
    terms = tl.join(tl.join(hi, mid), tl.join(lo, tl.zeros_like(lo)))  # [P, RP, G, 2 (i), 2 (a)]: term i + 2a
    terms = tl.reshape(tl.permute(terms, (0, 4, 3, 1, 2)), [P, 4 * RP, G_DOT])  # k = term * RP + c
    a = coef.to(tl.float32).to(SPLIT_T)
    a = tl.join(a, a)
    a = tl.join(a, a)  # [P, B, RP, 2, 2]
    a = tl.reshape(tl.permute(a, (0, 1, 4, 3, 2)), [P, B, 4 * RP])
    return _mma(a, terms, tl.zeros([P, B, G_DOT], tl.float32), FP32)


@triton.jit
def _q_part(q_cols, OFF: tl.constexpr, D_PAD: tl.constexpr, gm, DOT_T: tl.constexpr):
    """q^T rows 8j + OFF (j < D/8) [D/8, G_DOT]: the dims `_word_codes` yields for one SHIFT and half
    (the word path runs only where D = D_PAD, `word_decode_fits`)."""
    j = tl.arange(0, D_PAD // 8)
    return tl.load(q_cols + 8 * j[:, None] + OFF, mask=gm[None, :], other=0.0).to(DOT_T)


@triton.jit
def _row_offset(blk, num_kv_heads, h, row_bytes, ROWS32: tl.constexpr):
    """Byte offset of a (block, KV head) summary row. ROWS32 (the rows buffer is under 2 GiB): 32-bit
    products, one IMAD each; else 64-bit products, several instructions each."""
    if ROWS32:
        return (blk * num_kv_heads + h) * row_bytes
    else:
        return (blk.to(tl.int64) * num_kv_heads + h) * row_bytes


@triton.jit
def _in_units(offset, LOG2_SIZE: tl.constexpr, ROWS32: tl.constexpr):
    """A row byte offset (>= 0, a multiple of the unit) in units of 2^LOG2_SIZE bytes: a shift on the
    32-bit path, where the 64-bit signed division needs a fix-up."""
    if ROWS32:
        return offset >> LOG2_SIZE
    else:
        return offset // (1 << LOG2_SIZE)


@triton.jit
def _paired_codes(words, SHIFT: tl.constexpr, M: tl.constexpr, D_PAD: tl.constexpr, DOT_T: tl.constexpr):
    """[M, D/8] words -> [M, D/4]: column 2j + c is half c of word j's `_word_codes(SHIFT)` (dim 8j + SHIFT/4
    + 4c). A 16-bit pair is then one 32-bit register, as an mma operand holds consecutive K (score_t.py)."""
    lo, hi = _word_codes(words, SHIFT, DOT_T)
    return tl.reshape(tl.join(lo, hi), [M, D_PAD // 4])


@triton.jit
def _program_tiles(seq_lens_ptr, num_kv_heads, num_chunks, B: tl.constexpr, P: tl.constexpr):
    """A score program's (pair, chunk, sequence, KV head, scored pages, first tile, end tile): the pages
    before the recent one, in tiles of P, split evenly over the pair's chunks (from seq_lens on the device)."""
    pair = tl.program_id(0)
    chunk = tl.program_id(1)
    s = pair // num_kv_heads
    h = pair % num_kv_heads
    n_full = tl.maximum(tl.load(seq_lens_ptr + s) - 1, 0) // B  # scored pages: all before the recent one
    n_tiles = tl.cdiv(n_full, P)
    per_chunk = tl.cdiv(n_tiles, num_chunks)
    t_begin = chunk * per_chunk
    return pair, chunk, s, h, n_full, t_begin, tl.minimum(t_begin + per_chunk, n_tiles)


@triton.jit
def _score_kernel(
    q_ptr, rows_u8, rows_i8, rows_f16, block_table_ptr, seq_lens_ptr,
    scores_ptr, chunk_max_ptr, chunk_sum_ptr,
    s_qs, s_qh, s_bt, num_kv_heads, row_bytes, max_pages, num_chunks, scale,
    G: tl.constexpr, G_DOT: tl.constexpr, GS: tl.constexpr, MAXC: tl.constexpr,
    D: tl.constexpr, D_PAD: tl.constexpr, B: tl.constexpr, R: tl.constexpr, BITS: tl.constexpr,
    COEF_OFF: tl.constexpr, BASIS_OFF: tl.constexpr, SCALE_OFF: tl.constexpr,
    P: tl.constexpr, RP: tl.constexpr, FP32: tl.constexpr, STAGES: tl.constexpr = 1, MANTISSA: tl.constexpr = True,
    WORDS: tl.constexpr = False, COEF_VEC: tl.constexpr = False,
    COEF_MMA: tl.constexpr = False, ROWS32: tl.constexpr = False,
):
    pair, chunk, s, h, n_full, t_begin, t_end = _program_tiles(seq_lens_ptr, num_kv_heads, num_chunks, B, P)

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
    # The word path's operands (unused, and compiled away, on the byte path): the dims each (SHIFT,
    # half) of `_word_codes` yields, in its order. Defined unconditionally: the compiler does not carry
    # names bound inside a constexpr branch into the tile loop.
    q_w0 = _q_part(q_cols, 0, D_PAD, gm, DOT_T)
    q_w4 = _q_part(q_cols, 4, D_PAD, gm, DOT_T)
    q_w1 = _q_part(q_cols, 1, D_PAD, gm, DOT_T)
    q_w5 = _q_part(q_cols, 5, D_PAD, gm, DOT_T)
    q_w2 = _q_part(q_cols, 2, D_PAD, gm, DOT_T)
    q_w6 = _q_part(q_cols, 6, D_PAD, gm, DOT_T)
    q_w3 = _q_part(q_cols, 3, D_PAD, gm, DOT_T)
    q_w7 = _q_part(q_cols, 7, D_PAD, gm, DOT_T)
    jw = tl.arange(0, D_PAD // 8)
    rows_i32 = rows_u8.to(tl.pointer_type(tl.int32))
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
        blk = tl.load(block_table_ptr + s * s_bt + page, mask=pm, other=0)
        row = _row_offset(blk, num_kv_heads, h, row_bytes, ROWS32)  # [P] byte offset of each page's row
        page_n = t * P + n_page
        nm = (page_n < n_full) & (n_col < R)
        blk_n = tl.load(block_table_ptr + s * s_bt + page_n, mask=page_n < n_full, other=0)
        row_n = _row_offset(blk_n, num_kv_heads, h, row_bytes, ROWS32)  # [P*RP] the same rows, per (page, column)
        # The coefficient block is addressed in its own 3D layout (block ids loaded again, L1 hits)
        # so its loads need no layout shuffle of `row` (a barrier) before they can issue.
        page3 = t * P + tl.arange(0, P)[:, None, None]
        blk3 = tl.load(block_table_ptr + s * s_bt + page3, mask=page3 < n_full, other=0)
        row3 = _row_offset(blk3, num_kv_heads, h, row_bytes, ROWS32)
        coef_idx = tok[None, :, None] * R + c3_col[None, None, :]  # [P, B, KC] element index inside the [B, r] block
        coef_mask = (page3 < n_full) & c3_ok[None, None, :]
        if BITS == 16:
            mu = tl.load(rows_f16 + _in_units(row, 1, ROWS32)[:, None] + d[None, :], mask=pm[:, None] & dm[None, :], other=0.0)
            v = tl.load(rows_f16 + _in_units(row_n, 1, ROWS32)[:, None] + BASIS_OFF // 2 + n_col[:, None] * D + d[None, :],
                        mask=nm[:, None] & dm[None, :], other=0.0)
            if COEF_MMA or COEF_VEC:  # [P, B, RP]: each token's coefficients in one vector load
                cv_idx, cv_mask = _token_vectors(tok, page3, n_full, R, RP)
                coef = tl.load(rows_f16 + _in_units(row3 + COEF_OFF, 1, ROWS32) + cv_idx, mask=cv_mask, other=0.0)
                if not COEF_MMA:
                    coef = _spread_columns(coef, f_pad, P, B, KC)
            else:
                coef = tl.load(rows_f16 + _in_units(row3 + COEF_OFF, 1, ROWS32) + coef_idx, mask=coef_mask, other=0.0).to(tl.float32)
            q_mu = mm(mu.to(tl.float32), q_full, True)  # [P, G_DOT]
            vq = mm(v.to(tl.float32), q_full, True)  # [P*RP, G_DOT]
            tok_scale = tl.full([P, B], 1.0, tl.float32)
        else:
            f_scales = _in_units(row + SCALE_OFF, 1, ROWS32)
            mu_scale = tl.load(rows_f16 + f_scales, mask=pm, other=0.0).to(tl.float32)
            col_scale = tl.load(rows_f16 + _in_units(row_n + SCALE_OFF, 1, ROWS32) + 1 + B + n_col, mask=nm, other=0.0).to(tl.float32)
            tok_scale = tl.load(rows_f16 + f_scales[:, None] + 1 + tok[None, :], mask=pm[:, None], other=0.0)
            if COEF_MMA or COEF_VEC:  # [P, B, RP]: each token's coefficients in one vector load
                cv_idx, cv_mask = _token_vectors(tok, page3, n_full, R, RP)
                coef = tl.load(rows_i8 + row3 + COEF_OFF + cv_idx, mask=cv_mask, other=0)
                if not COEF_MMA:
                    coef = _spread_columns(coef, f_pad, P, B, KC)
            else:
                coef = tl.load(rows_i8 + row3 + COEF_OFF + coef_idx, mask=coef_mask, other=0).to(tl.float32)  # [P, B, KC]
            # The basis (largest field) before the centroid: the compiler places each operand shuffle
            # right after its load, and loads after a shuffle wait for the shuffled data.
            if BITS == 4:  # bytes of 2 codes, or on the word path 32-bit words of 8
                if WORDS:  # other: code 8 in every nibble (value 0)
                    words = tl.load(rows_i32 + _in_units(row_n[:, None] + BASIS_OFF, 2, ROWS32) + n_col[:, None] * (D // 8) + jw[None, :],
                                     mask=nm[:, None], other=-2004318072)
                else:
                    packed = tl.load(rows_u8 + row_n[:, None] + BASIS_OFF + n_col[:, None] * (D // 2) + jh[None, :],
                                     mask=nm[:, None] & jhm[None, :], other=0x88).to(tl.int32)
            else:
                v = tl.load(rows_i8 + row_n[:, None] + BASIS_OFF + n_col[:, None] * D + d[None, :],
                            mask=nm[:, None] & dm[None, :], other=0)
            mu = tl.load(rows_i8 + row[:, None] + d[None, :], mask=pm[:, None] & dm[None, :], other=0)
            q_mu = mm(mu.to(tl.float32).to(DOT_T), q_full, FP32) * mu_scale[:, None]
            if BITS == 4:
                if WORDS:  # the eight K = d/8 products accumulate in the dot (no separate adds)
                    lo, hi = _word_codes(words, 0, DOT_T)
                    vq = _mma(hi, q_w4, _mma(lo, q_w0, tl.zeros([P * RP, G_DOT], tl.float32), FP32), FP32)
                    lo, hi = _word_codes(words, 4, DOT_T)
                    vq = _mma(hi, q_w5, _mma(lo, q_w1, vq, FP32), FP32)
                    lo, hi = _word_codes(words, 8, DOT_T)
                    vq = _mma(hi, q_w6, _mma(lo, q_w2, vq, FP32), FP32)
                    lo, hi = _word_codes(words, 12, DOT_T)
                    vq = _mma(hi, q_w7, _mma(lo, q_w3, vq, FP32), FP32)
                elif MANTISSA:
                    low = _nibble_value(packed & 15, DOT_T)  # dims 0, 2, 4, ...
                    high = _nibble_value(packed >> 4, DOT_T)  # dims 1, 3, 5, ...
                    vq = mm(low, q_even, FP32) + mm(high, q_odd, FP32)
                else:
                    low = ((packed & 15) - 8).to(tl.float32).to(DOT_T)
                    high = ((packed >> 4) - 8).to(tl.float32).to(DOT_T)
                    vq = mm(low, q_even, FP32) + mm(high, q_odd, FP32)
            else:
                vq = mm(v.to(tl.float32).to(DOT_T), q_full, FP32)
            vq = vq * col_scale[:, None]
            tok_scale = tok_scale.to(tl.float32)
        # Coefficient contraction: acc[p, i, g] = sum_c (V^T q)[p, c, g] * C[p, i, c].
        if COEF_MMA:
            acc = _coef_mma(coef, vq, P, B, RP, G_DOT, FP32)
        else:  # on CUDA cores (an fp32 FMA dot)
            vq_pad = tl.where((f_pad == 0)[None, None, :, None], tl.reshape(vq, [P, RP, 1, G_DOT]), 0.0)
            acc = tl.dot(coef, tl.reshape(vq_pad, [P, KC, G_DOT]), input_precision="ieee")  # [P, B, G_DOT]
        out = scores_ptr + (pair.to(tl.int64) * max_pages + page[:, None]) * GS + g[None, :]
        logits = (q_mu[:, None, :] + acc * tok_scale[:, :, None]) * scale  # [P, B, G_DOT]
        page_max = tl.max(logits, axis=1)
        score = page_max + tl.log(tl.sum(tl.exp(logits - page_max[:, None, :]), axis=1))  # [P, G_DOT]
        score = tl.where(pm[:, None], score, float("-inf"))
        tl.store(out, score, mask=pm[:, None] & gm[None, :])
        new_max = tl.maximum(run_max, tl.max(score, axis=0))
        run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(score - new_max[None, :]), axis=0)
        run_max = new_max
    part = (pair * MAXC + chunk) * GS + g
    tl.store(chunk_max_ptr + part, run_max, mask=g < GS)
    tl.store(chunk_sum_ptr + part, run_sum, mask=g < GS)
