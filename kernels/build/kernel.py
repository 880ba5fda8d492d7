"""Summary build kernel (locks.md §1): one warp per program, P (block, KV head) pages per program, fp32 registers.

Reference: `reference.summary.build_page_summaries` + `reference.packing.pack_summaries`.

Per page: centroid, 16x16 Gram, parallel cyclic Jacobi (round-robin ordering: 15 rounds of 8
disjoint rotations per sweep), sort eigenpairs descending, fix signs like the reference
(largest-|.| entry of each U column positive), drop zero modes with the reference threshold,
basis V = D^T U S^-1, coefficients C = U S, symmetric quantization (float16-rounded scales,
round-half-even) and the packed store with zero padding.

Cost model (H200: 132 SMs x 4 schedulers, 1.98 GHz). The bytes are tiny (4 KB of bf16 keys read
per page, 832 B written for r8i4), so the build is bound by instruction issue and the latency of
the sequential Jacobi rounds. The previous kernel ran one page per 4-warp program, did each round
as three dense 16x16x16 `tl.dot`s through shared memory with CTA barriers, held 255 registers
(2 pages in flight per SM), and its convergence bound sat below fp32's rounding floor, so pages
with dominant modes (real keys) always ran all 10 sweeps (150 rounds). This one:
  * runs each program on ONE warp: reductions and partner exchanges are warp shuffles, and the
    few layout conversions left in a round (small vectors) synchronize one warp only;
  * applies a rotation as what it is, a 2-sparse row/column combination (the partner row/column
    is a `tl.gather`); sm_90, d=128: 713 SASS per round (89 SHFL, 32 MUFU), 168 registers, no
    spill -> 12 one-warp programs (pages) in flight per SM;
  * stops at off <= (B eps)^2 total (below), ~5.5 sweeps instead of 6-10;
  * streams the head dim in chunks of DC half-dims: keys are re-read from L1/L2 for the basis
    (3 x 4 KB per page, free next to the compute) so the registers stay low.
Expected: prompt build of 32768 pages (128K tokens x 4 KV heads) ~ 32768 x 82 rounds x 713 SASS
+ ~11K SASS of Gram/basis per page = 2.3e9 warp instructions = 2.2 ms at full issue (1.05e12/s),
MUFU 0.7 ms and SHFL 0.9 ms of pipe time underneath; with 3 warps per scheduler ~50-75% issue:
3-4.5 ms per layer (was 18.5). Decode-time build (4 pages, 4 programs, one warp each) is pure
latency: a lone warp issues <= 1 instruction per cycle, so ~82 rounds x 713-1000 cycles =
30-45 us per layer (was 80-90); going lower needs fewer instructions per round, not more pages.
P > 1 pages per program ([P, 16, 16] tiles, one uniform convergence test per tile) is supported
and tested but not the default: nothing in a round is shared between pages, so SASS per page
stays the same, while P = 2 needs 168-218 registers and spills for some formats; the bench
(`python -m locks_toolkit.harness.lab.build_bench --pages-per-program 2`) can try it.
"""

from __future__ import annotations

import triton
import triton.language as tl

MAX_SWEEPS = 10  # fp32 Jacobi on 16x16 converges in 5-6 sweeps (bound in the kernel); exits early when converged
PAGES_PER_PROGRAM = 1  # prompt builds: pages per one-warp program (see the module docstring for P > 1)
SMALL_BUILD_ITEMS = 1024  # builds of <= this many (block, head) items (decode time): one page per program
DIM_CHUNK = 16  # half-dims per streamed key chunk (the minimum tl.dot K); keeps registers low
NUM_WARPS = 1  # one warp per program: no CTA-wide barrier in the Jacobi loop
_ROUND_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23: (x + M) - M rounds half-to-even for |x| < 2**22


@triton.jit
def _rint(x):
    """Round half to even in fp32 (|x| < 2**22), matching torch.round."""
    return (x + _ROUND_MAGIC) - _ROUND_MAGIC


@triton.jit
def _quantize(x, scale, QMAX: tl.constexpr):
    """x / scale rounded half-even and clamped to [-QMAX, QMAX]; 0 where the scale is 0."""
    safe = tl.where(scale > 0, scale, 1.0)
    q = _rint(tl.math.div_rn(x, safe))
    q = tl.minimum(tl.maximum(q, -QMAX * 1.0), QMAX * 1.0)
    return tl.where(scale > 0, q, 0.0).to(tl.int32)


@triton.jit
def _scale_of(absmax, QMAX: tl.constexpr):
    """float16-rounded symmetric scale, returned as fp32."""
    return tl.math.div_rn(absmax, QMAX * 1.0).to(tl.float16).to(tl.float32)


@triton.jit
def _jacobi_round(A, U, t, P: tl.constexpr, B: tl.constexpr):
    """One round of the round-robin parallel Jacobi on [P, B, B]: rotate the 8 disjoint pairs (i, partner(i))."""
    rows = tl.arange(0, B)
    # Round-robin pairing on 16 players: 15 is paired with t, i with (2t - i) mod 15 otherwise.
    partner = tl.where(rows == 15, t, tl.where(rows == t, 15, (2 * t - rows + 15) % 15))
    eye = (rows[:, None] == rows[None, :])[None, :, :]
    pick = (rows[None, :] == partner[:, None])[None, :, :]
    # Row-indexed parameter vectors (reductions over axis 2). Computing them column-indexed or on a
    # flat [P * B] vector looks cheaper but makes Triton pick layouts that spill at P = 2 (tried).
    diag = tl.sum(tl.where(eye, A, 0.0), axis=2)  # [P, B]
    a_ij = tl.sum(tl.where(pick, A, 0.0), axis=2)
    if P == 1:  # a vector gather saves a 16-lane reduction (-8% SASS per round); at P = 2 it spills
        a_jj = tl.gather(diag, tl.broadcast_to(partner[None, :], (P, B)), axis=1)
    else:
        a_jj = tl.sum(tl.where(pick, diag[:, None, :], 0.0), axis=2)
    is_lo = (rows < partner)[None, :]
    a_pp = tl.where(is_lo, diag, a_jj)
    a_qq = tl.where(is_lo, a_jj, diag)
    # Golub-Van Loan sym.schur2: tau = (a_qq - a_pp) / (2 a_pq), t = sign(tau) / (|tau| + sqrt(1 + tau^2)).
    rotate = a_ij != 0.0
    tau = (a_qq - a_pp) / tl.where(rotate, 2.0 * a_ij, 1.0)
    # Four MUFU ops per element (rcp, sqrt, rcp, rsqrt): the special-function unit is the scarcest
    # pipe here (each thread evaluates P x 8 replicated parameters per round).
    abs_tau = tl.abs(tau)
    huge = abs_tau > 1e15  # sqrt(1 + tau^2) ~ |tau| (and keeps tau * tau finite): tan ~ 1 / (2 tau)
    root = tl.where(huge, abs_tau, tl.sqrt(1.0 + tl.where(huge, 0.0, tau * tau)))
    tan = tl.where(tau >= 0, 1.0, -1.0) / (abs_tau + root)
    tan = tl.where(rotate, tan, 0.0)
    cos = tl.math.rsqrt(1.0 + tan * tan)
    # J = I with J[i, i] = cos, J[lo, hi] = sin, J[hi, lo] = -sin, so for every index k:
    # (X J)[:, k] = cos_k X[:, k] + g_k X[:, partner(k)] and (J^T X)[k, :] = cos_k X[k, :] + g_k X[partner(k), :].
    g = tl.where(is_lo, -tan * cos, tan * cos)  # [P, B]
    idx_rows = tl.broadcast_to(partner[None, :, None], (P, B, B))
    idx_cols = tl.broadcast_to(partner[None, None, :], (P, B, B))
    A = cos[:, :, None] * A + g[:, :, None] * tl.gather(A, idx_rows, axis=1)  # J^T A
    A = cos[:, None, :] * A + g[:, None, :] * tl.gather(A, idx_cols, axis=2)  # (J^T A) J
    U = cos[:, None, :] * U + g[:, None, :] * tl.gather(U, idx_cols, axis=2)
    return A, U


@triton.jit
def _load_chunk(k_ptr, base, tok, j, c, valid, s_tok, s_dim, DH: tl.constexpr):
    """Keys of chunk c as (even, odd) halves, fp32 [P, B, DC] each: dims 2j and 2j+1 (nibble pairs without shuffles)."""
    jj = c + j
    m = valid[:, None, None] & (jj < DH)[None, None, :]
    kp = k_ptr + base[:, None, None] + tok[None, :, None] * s_tok + (2 * jj)[None, None, :] * s_dim
    k_even = tl.load(kp, mask=m, other=0.0).to(tl.float32)
    k_odd = tl.load(kp + s_dim, mask=m, other=0.0).to(tl.float32)
    return k_even, k_odd


@triton.jit
def _chunk_basis(k_ptr, base, tok, j, c, valid, s_tok, s_dim, U, inv_sigma, B: tl.constexpr, DH: tl.constexpr):
    """Chunk c's centroid halves [P, DC] and unit basis halves [P, DC, B] = (k - mu)^T U / sigma (even, odd dims)."""
    k_even, k_odd = _load_chunk(k_ptr, base, tok, j, c, valid, s_tok, s_dim, DH)
    mu_even = tl.sum(k_even, axis=1) / B
    mu_odd = tl.sum(k_odd, axis=1) / B
    basis_even = tl.dot(tl.permute(k_even - mu_even[:, None, :], (0, 2, 1)), U, input_precision="ieee") * inv_sigma[:, None, :]
    basis_odd = tl.dot(tl.permute(k_odd - mu_odd[:, None, :], (0, 2, 1)), U, input_precision="ieee") * inv_sigma[:, None, :]
    return mu_even, mu_odd, basis_even, basis_odd


@triton.jit
def _build_kernel(
    k_ptr, block_ids_ptr, rows_u8, rows_i8, rows_f16,
    s_blk, s_tok, s_head, s_dim, num_kv_heads, num_items, row_bytes,
    D: tl.constexpr, DH_PAD: tl.constexpr, DC: tl.constexpr, P: tl.constexpr, B: tl.constexpr, R: tl.constexpr,
    BITS: tl.constexpr, COEF_OFF: tl.constexpr, BASIS_OFF: tl.constexpr, SCALE_OFF: tl.constexpr, USED: tl.constexpr,
    MAX_SWEEPS_C: tl.constexpr, EPS: tl.constexpr, LAYERED: tl.constexpr = False, K_DTYPE: tl.constexpr = None,
):
    DH: tl.constexpr = D // 2
    if LAYERED:
        # Grid axis 1 = layer: k_ptr and rows_u8 are int64 address tables [L] of same-shaped tensors,
        # so one launch builds a completed page on every layer (a decode-time build is pure latency).
        layer = tl.program_id(1)
        k_ptr = tl.load(k_ptr + layer).to(tl.pointer_type(K_DTYPE))
        row_addr = tl.load(rows_u8 + layer)
        rows_u8 = row_addr.to(tl.pointer_type(tl.uint8))
        rows_i8 = row_addr.to(tl.pointer_type(tl.int8))
        rows_f16 = row_addr.to(tl.pointer_type(tl.float16))
    item = tl.program_id(0) * P + tl.arange(0, P)  # work item = block index * Hkv + head
    in_range = item < num_items
    blk = tl.load(block_ids_ptr + item // num_kv_heads, mask=in_range, other=-1)
    h = item % num_kv_heads
    valid = in_range & (blk >= 0)
    blk = tl.where(valid, blk, 0)
    base = blk.to(tl.int64) * s_blk + h * s_head  # [P]
    tok = tl.arange(0, B)
    j = tl.arange(0, DC)
    rows = tl.arange(0, B)
    cols = tl.arange(0, B)

    # Pass 1 over the head dim: Gram of the deviations, key energy, centroid absmax (its int8 scale).
    gram = tl.zeros((P, B, B), dtype=tl.float32)
    key_energy = tl.zeros((P,), dtype=tl.float32)
    mu_absmax = tl.zeros((P,), dtype=tl.float32)
    for c in range(0, DH_PAD, DC):
        k_even, k_odd = _load_chunk(k_ptr, base, tok, j, c, valid, s_tok, s_dim, DH)
        mu_even = tl.sum(k_even, axis=1) / B  # [P, DC]
        mu_odd = tl.sum(k_odd, axis=1) / B
        dev_even = k_even - mu_even[:, None, :]  # padded dims load 0 and stay 0
        dev_odd = k_odd - mu_odd[:, None, :]
        gram = tl.dot(dev_even, tl.permute(dev_even, (0, 2, 1)), gram, input_precision="ieee")
        gram = tl.dot(dev_odd, tl.permute(dev_odd, (0, 2, 1)), gram, input_precision="ieee")
        key_energy += tl.sum(tl.sum(k_even * k_even + k_odd * k_odd, axis=2), axis=1)
        mu_absmax = tl.maximum(mu_absmax, tl.max(tl.maximum(tl.abs(mu_even), tl.abs(mu_odd)), axis=1))

    # Eigendecomposition gram = U diag(lam) U^T by parallel cyclic Jacobi, all P pages in lockstep.
    eye = (rows[:, None] == cols[None, :])[None, :, :]
    A = gram
    U = tl.zeros((P, B, B), dtype=tl.float32) + tl.where(eye, 1.0, 0.0)
    total = tl.sum(tl.sum(A * A, axis=2), axis=1)  # [P], invariant under rotations
    off = tl.sum(tl.sum(tl.where(eye, 0.0, A * A), axis=2), axis=1)
    # Converged when off <= (B eps)^2 total. The old bound, 1e-14 total, sits BELOW fp32's rounding
    # floor (each rotation leaves ~eps |A| per entry, off ~ B eps^2 total ~ 2e-13 total): pages with
    # a dominant mode (real keys) then never converged and ran all MAX_SWEEPS (measured in a numpy
    # fp32 model: 8.8 sweeps mean on such pages, 5.6 with this bound; Gaussian pages 5 either way).
    # Off-diagonal mass (B eps)^2 total moves eigenvalues by O(off / gap), far below the zero-mode
    # threshold B eps lam_max, and eigenvectors by ~B eps, far below the fp16/int storage step.
    tol = (EPS * B) * (EPS * B) * total
    todo = tl.max((off > tol).to(tl.int32), axis=0)  # uniform: sweep until every page of the tile converged
    sweep = 0
    while (sweep < MAX_SWEEPS_C) & (todo > 0):
        # A runtime loop on purpose: unrolled, the compiler hoists all 15 rounds' partner indices
        # out of the sweep loop and they alone fill the register file.
        for t in range(B - 1):
            A, U = _jacobi_round(A, U, t, P, B)
        off = tl.sum(tl.sum(tl.where(eye, 0.0, A * A), axis=2), axis=1)
        todo = tl.max((off > tol).to(tl.int32), axis=0)
        sweep += 1
    lam = tl.sum(tl.where(eye, A, 0.0), axis=2)  # [P, B], index = column of U

    # Sort descending (ties by index): rank[i] = #{j: lam_j > lam_i or (lam_j == lam_i and j < i)}.
    earlier = (cols[None, :] < rows[:, None])[None, :, :]
    before = (lam[:, None, :] > lam[:, :, None]) | ((lam[:, None, :] == lam[:, :, None]) & earlier)
    rank = tl.sum(before.to(tl.int32), axis=2)  # [P, B]
    perm = rank[:, :, None] == cols[None, None, :]  # perm[p, i, k]: eigenpair i goes to position k
    source = tl.sum(tl.where(perm, rows[None, :, None], 0), axis=1)  # [P, B]: the eigenpair at position k
    U = tl.gather(U, tl.broadcast_to(source[:, None, :], (P, B, B)), axis=2)
    lam = tl.sum(tl.where(perm, lam[:, :, None], 0.0), axis=1)

    # Reference sign convention: the largest-magnitude entry of each U column is positive.
    absU = tl.abs(U)
    col_max = tl.max(absU, axis=1)  # [P, B]
    pivot = tl.min(tl.where(absU == col_max[:, None, :], rows[None, :, None], B), axis=1)
    pivot_val = tl.sum(tl.where(rows[None, :, None] == pivot[:, None, :], U, 0.0), axis=1)
    U = U * tl.where(pivot_val < 0, -1.0, 1.0)[:, None, :]

    # Zero modes: lam <= max(B eps lam_max, (B eps)^2 sum ||k||^2) (reference.summary threshold).
    lam_max = tl.maximum(tl.max(lam, axis=1), 0.0)
    threshold = tl.maximum(EPS * B * lam_max, (EPS * B) * (EPS * B) * key_energy)  # [P]
    cm = (cols < R)[None, :]
    kept = (lam > threshold[:, None]) & cm  # [P, B]
    sigma = tl.sqrt_rn(tl.where(kept, lam, 1.0))
    coef = tl.where(kept[:, None, :], U * sigma[:, None, :], 0.0)  # [P, B tokens, B modes]
    inv_sigma = tl.where(kept, 1.0 / sigma, 0.0)

    row = (blk.to(tl.int64) * num_kv_heads + h) * row_bytes  # [P]
    vm = valid[:, None, None]
    if BITS == 16:
        # rNfp: float16 centroid [d], coefficients [B, r], basis columns [r, d]; no scales.
        f_row = row // 2
        c_ptr = rows_f16 + f_row[:, None, None] + COEF_OFF // 2 + tok[None, :, None] * R + cols[None, None, :]
        tl.store(c_ptr, coef.to(tl.float16), mask=vm & cm[:, None, :])
        for c in range(0, DH_PAD, DC):
            mu_even, mu_odd, basis_even, basis_odd = _chunk_basis(k_ptr, base, tok, j, c, valid, s_tok, s_dim, U,
                                                                  inv_sigma, B, DH)
            jm = (c + j < DH)[None, :]
            m_ptr = rows_f16 + f_row[:, None] + 2 * (c + j)[None, :]
            tl.store(m_ptr, mu_even.to(tl.float16), mask=valid[:, None] & jm)
            tl.store(m_ptr + 1, mu_odd.to(tl.float16), mask=valid[:, None] & jm)
            b_ptr = (rows_f16 + f_row[:, None, None] + BASIS_OFF // 2 + cols[None, None, :] * D
                     + 2 * (c + j)[None, :, None])
            bm = vm & jm[:, :, None] & cm[:, None, :]
            tl.store(b_ptr, basis_even.to(tl.float16), mask=bm)
            tl.store(b_ptr + 1, basis_odd.to(tl.float16), mask=bm)
    else:
        QMAX: tl.constexpr = 7 if BITS == 4 else 127
        s_mu = _scale_of(mu_absmax, 127)  # [P]
        tok_scale = _scale_of(tl.max(tl.where(cm[:, None, :], tl.abs(coef), 0.0), axis=2), 127)  # [P, B]
        q_coef = _quantize(coef, tok_scale[:, :, None], 127)
        c_ptr = rows_i8 + row[:, None, None] + COEF_OFF + tok[None, :, None] * R + cols[None, None, :]
        tl.store(c_ptr, q_coef.to(tl.int8), mask=vm & cm[:, None, :])
        # Pass 2: basis column absmax (its scale); pass 3 recomputes each basis chunk and stores it quantized.
        col_absmax = tl.zeros((P, B), dtype=tl.float32)
        for c in range(0, DH_PAD, DC):
            _, _, basis_even, basis_odd = _chunk_basis(k_ptr, base, tok, j, c, valid, s_tok, s_dim, U, inv_sigma, B, DH)
            col_absmax = tl.maximum(col_absmax, tl.max(tl.maximum(tl.abs(basis_even), tl.abs(basis_odd)), axis=1))
        s_col = _scale_of(col_absmax, QMAX)  # [P, B] (modes)
        for c in range(0, DH_PAD, DC):
            mu_even, mu_odd, basis_even, basis_odd = _chunk_basis(k_ptr, base, tok, j, c, valid, s_tok, s_dim, U,
                                                                  inv_sigma, B, DH)
            jm = (c + j < DH)[None, :]
            m_ptr = rows_i8 + row[:, None] + 2 * (c + j)[None, :]
            tl.store(m_ptr, _quantize(mu_even, s_mu[:, None], 127).to(tl.int8), mask=valid[:, None] & jm)
            tl.store(m_ptr + 1, _quantize(mu_odd, s_mu[:, None], 127).to(tl.int8), mask=valid[:, None] & jm)
            q_even = _quantize(basis_even, s_col[:, None, :], QMAX)
            q_odd = _quantize(basis_odd, s_col[:, None, :], QMAX)
            bm = vm & jm[:, :, None] & cm[:, None, :]
            if BITS == 4:
                packed = (q_even + 8) + (q_odd + 8) * 16  # element 2j low nibble, 2j+1 high, value + 8
                b_ptr = rows_u8 + row[:, None, None] + BASIS_OFF + cols[None, None, :] * DH + (c + j)[None, :, None]
                tl.store(b_ptr, packed.to(tl.uint8), mask=bm)
            else:
                b_ptr = rows_i8 + row[:, None, None] + BASIS_OFF + cols[None, None, :] * D + 2 * (c + j)[None, :, None]
                tl.store(b_ptr, q_even.to(tl.int8), mask=bm)
                tl.store(b_ptr + 1, q_odd.to(tl.int8), mask=bm)
        f_scales = (row + SCALE_OFF) // 2  # [P]
        tl.store(rows_f16 + f_scales, s_mu.to(tl.float16), mask=valid)
        tl.store(rows_f16 + f_scales[:, None] + 1 + tok[None, :], tok_scale.to(tl.float16), mask=valid[:, None])
        tl.store(rows_f16 + f_scales[:, None] + 1 + B + cols[None, :], s_col.to(tl.float16), mask=valid[:, None] & cm)
    pad = tl.arange(0, 64)
    tl.store(rows_u8 + row[:, None] + USED + pad[None, :], tl.zeros([P, 64], dtype=tl.uint8),
             mask=valid[:, None] & (USED + pad < row_bytes)[None, :])


def build_tile(num_items: int) -> int:
    """Pages per program for a build of num_items (block, head) pairs: 1 for small (decode) builds, else the tile."""
    return 1 if num_items <= SMALL_BUILD_ITEMS else PAGES_PER_PROGRAM
