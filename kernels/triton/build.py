"""Summary build kernel (locks.md §1): one program per (physical block, KV head), all in fp32 registers.

Reference: `reference.summary.build_page_summaries` + `reference.packing.pack_summaries`.

Per program: load the page's 16 keys as even/odd halves of d (so int4 nibble pairs are formed
without shuffles), centroid, 16x16 Gram, parallel cyclic Jacobi (round-robin ordering: 15 rounds
of 8 disjoint rotations per sweep, each round two 16x16x16 fp32 products), sort eigenpairs
descending, fix signs like the reference (largest-|.| entry of each U column positive), drop zero
modes with the reference threshold, basis V = D^T U S^-1, coefficients C = U S, symmetric
quantization (float16-rounded scales, round-half-even) and the packed store with zero padding.

Bytes: reads B*d*elt of K (4 KB for bf16, d=128), writes row_bytes (832 for r8i4): the build is
compute-bound (~0.5 MFLOP of Jacobi per page) and runs once per page.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import FP32_EPS

MAX_SWEEPS = 10  # fp32 Jacobi on 16x16 converges in 5-7 sweeps; the loop exits early when converged
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
def _jacobi_round(A, U, t, rows, cols):
    """One round of the round-robin parallel Jacobi: rotate the 8 disjoint pairs (i, partner(i))."""
    # Round-robin pairing on 16 players: 15 is paired with t, i with (2t - i) mod 15 otherwise.
    partner = tl.where(rows == 15, t, tl.where(rows == t, 15, (2 * t - rows + 15) % 15))
    eye = rows[:, None] == cols[None, :]
    pick = cols[None, :] == partner[:, None]
    diag = tl.sum(tl.where(eye, A, 0.0), axis=1)
    a_ij = tl.sum(tl.where(pick, A, 0.0), axis=1)
    a_jj = tl.sum(tl.where(pick, diag[None, :], 0.0), axis=1)
    is_lo = rows < partner
    a_pp = tl.where(is_lo, diag, a_jj)
    a_qq = tl.where(is_lo, a_jj, diag)
    # Golub-Van Loan sym.schur2: tau = (a_qq - a_pp) / (2 a_pq), t = sign(tau) / (|tau| + sqrt(1 + tau^2)).
    rotate = a_ij != 0.0
    tau = (a_qq - a_pp) / tl.where(rotate, 2.0 * a_ij, 1.0)
    huge = tl.abs(tau) > 1e15  # tan ~ 1 / (2 tau); keeps tau * tau finite
    tau_c = tl.where(huge, 0.0, tau)
    tan = tl.where(tau >= 0, 1.0, -1.0) / (tl.abs(tau_c) + tl.sqrt(1.0 + tau_c * tau_c))
    tan = tl.where(huge, 0.5 / tl.where(huge, tau, 1.0), tan)
    tan = tl.where(rotate, tan, 0.0)
    cos = 1.0 / tl.sqrt(1.0 + tan * tan)
    sin = tan * cos
    J = tl.where(eye, cos[:, None], 0.0) + tl.where(pick, tl.where(is_lo, sin, -sin)[:, None], 0.0)
    A = tl.dot(tl.trans(J), tl.dot(A, J, input_precision="ieee"), input_precision="ieee")
    U = tl.dot(U, J, input_precision="ieee")
    return A, U


@triton.jit
def _build_kernel(
    k_ptr, block_ids_ptr, rows_u8, rows_i8, rows_f16,
    s_blk, s_tok, s_head, s_dim, num_kv_heads, row_bytes,
    D: tl.constexpr, DH_PAD: tl.constexpr, B: tl.constexpr, R: tl.constexpr, BITS: tl.constexpr,
    COEF_OFF: tl.constexpr, BASIS_OFF: tl.constexpr, SCALE_OFF: tl.constexpr, USED: tl.constexpr,
    MAX_SWEEPS_C: tl.constexpr, EPS: tl.constexpr,
):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    blk = tl.load(block_ids_ptr + pid)
    if blk >= 0:
        DH: tl.constexpr = D // 2
        tok = tl.arange(0, B)
        j = tl.arange(0, DH_PAD)
        jm = j < DH
        base = blk.to(tl.int64) * s_blk + h * s_head
        kp = k_ptr + base + tok[:, None] * s_tok + (2 * j)[None, :] * s_dim
        k_even = tl.load(kp, mask=jm[None, :], other=0.0).to(tl.float32)  # [B, DH_PAD] dims 0, 2, 4, ...
        k_odd = tl.load(kp + s_dim, mask=jm[None, :], other=0.0).to(tl.float32)
        mu_even = tl.sum(k_even, axis=0) / B
        mu_odd = tl.sum(k_odd, axis=0) / B
        dev_even = tl.where(jm[None, :], k_even - mu_even[None, :], 0.0)
        dev_odd = tl.where(jm[None, :], k_odd - mu_odd[None, :], 0.0)
        gram = tl.dot(dev_even, tl.trans(dev_even), input_precision="ieee")
        gram = tl.dot(dev_odd, tl.trans(dev_odd), gram, input_precision="ieee")  # [B, B]
        key_energy = tl.sum(tl.sum(k_even * k_even + k_odd * k_odd, axis=1), axis=0)

        # Eigendecomposition gram = U diag(lam) U^T by parallel cyclic Jacobi.
        rows = tl.arange(0, B)
        cols = tl.arange(0, B)
        eye = rows[:, None] == cols[None, :]
        A = gram
        U = tl.where(eye, 1.0, 0.0)
        total = tl.sum(tl.sum(A * A, axis=1), axis=0)
        off = total - tl.sum(tl.sum(tl.where(eye, A * A, 0.0), axis=1), axis=0)
        sweep = 0
        while (sweep < MAX_SWEEPS_C) & (off > 1e-14 * total):
            for t in range(B - 1):
                A, U = _jacobi_round(A, U, t, rows, cols)
            off = tl.sum(tl.sum(tl.where(eye, 0.0, A * A), axis=1), axis=0)
            sweep += 1
        lam = tl.sum(tl.where(eye, A, 0.0), axis=1)  # [B], index = column of U

        # Sort descending (ties by index): rank[i] = #{j: lam_j > lam_i or (lam_j == lam_i and j < i)}.
        before = (lam[None, :] > lam[:, None]) | ((lam[None, :] == lam[:, None]) & (cols[None, :] < rows[:, None]))
        rank = tl.sum(before.to(tl.int32), axis=1)
        perm = rank[:, None] == cols[None, :]  # perm[i, k]: eigenpair i goes to position k
        U = tl.dot(U, tl.where(perm, 1.0, 0.0), input_precision="ieee")
        lam = tl.sum(tl.where(perm, lam[:, None], 0.0), axis=0)

        # Reference sign convention: the largest-magnitude entry of each U column is positive.
        absU = tl.abs(U)
        col_max = tl.max(absU, axis=0)
        pivot = tl.min(tl.where(absU == col_max[None, :], rows[:, None], B), axis=0)
        pivot_val = tl.sum(tl.where(rows[:, None] == pivot[None, :], U, 0.0), axis=0)
        U = U * tl.where(pivot_val < 0, -1.0, 1.0)[None, :]

        # Zero modes: lam <= max(B eps lam_max, (B eps)^2 sum ||k||^2) (reference.summary threshold).
        lam_max = tl.maximum(tl.max(lam, axis=0), 0.0)
        threshold = tl.maximum(EPS * B * lam_max, (EPS * B) * (EPS * B) * key_energy)
        kept = (lam > threshold) & (cols < R)
        sigma = tl.sqrt_rn(tl.where(kept, lam, 1.0))
        coef = tl.where(kept[None, :], U * sigma[None, :], 0.0)  # [B tokens, B modes]
        inv_sigma = tl.where(kept, 1.0 / sigma, 0.0)
        basis_even = tl.dot(tl.trans(dev_even), U, input_precision="ieee") * inv_sigma[None, :]  # [DH_PAD, B]
        basis_odd = tl.dot(tl.trans(dev_odd), U, input_precision="ieee") * inv_sigma[None, :]

        row = (blk.to(tl.int64) * num_kv_heads + h) * row_bytes
        cm = cols < R
        if BITS == 16:
            # rNfp: float16 centroid [d], coefficients [B, r], basis columns [r, d]; no scales.
            f_row = row // 2
            tl.store(rows_f16 + f_row + 2 * j, mu_even.to(tl.float16), mask=jm)
            tl.store(rows_f16 + f_row + 2 * j + 1, mu_odd.to(tl.float16), mask=jm)
            c_ptr = rows_f16 + f_row + COEF_OFF // 2 + tok[:, None] * R + cols[None, :]
            tl.store(c_ptr, coef.to(tl.float16), mask=cm[None, :])
            b_ptr = rows_f16 + f_row + BASIS_OFF // 2 + cols[None, :] * D + 2 * j[:, None]
            bm = jm[:, None] & cm[None, :]
            tl.store(b_ptr, basis_even.to(tl.float16), mask=bm)
            tl.store(b_ptr + 1, basis_odd.to(tl.float16), mask=bm)
        else:
            QMAX: tl.constexpr = 7 if BITS == 4 else 127
            s_mu = _scale_of(tl.maximum(tl.max(tl.abs(mu_even), axis=0), tl.max(tl.abs(mu_odd), axis=0)), 127)
            tl.store(rows_i8 + row + 2 * j, _quantize(mu_even, s_mu, 127).to(tl.int8), mask=jm)
            tl.store(rows_i8 + row + 2 * j + 1, _quantize(mu_odd, s_mu, 127).to(tl.int8), mask=jm)
            tok_scale = _scale_of(tl.max(tl.where(cm[None, :], tl.abs(coef), 0.0), axis=1), 127)  # [B]
            q_coef = _quantize(coef, tok_scale[:, None], 127)
            tl.store(rows_i8 + row + COEF_OFF + tok[:, None] * R + cols[None, :], q_coef.to(tl.int8), mask=cm[None, :])
            col_absmax = tl.maximum(tl.max(tl.abs(basis_even), axis=0), tl.max(tl.abs(basis_odd), axis=0))
            s_col = _scale_of(col_absmax, QMAX)  # [B] (modes)
            q_even = _quantize(basis_even, s_col[None, :], QMAX)
            q_odd = _quantize(basis_odd, s_col[None, :], QMAX)
            bm = jm[:, None] & cm[None, :]
            if BITS == 4:
                packed = (q_even + 8) + (q_odd + 8) * 16  # element 2j low nibble, 2j+1 high, value + 8
                tl.store(rows_u8 + row + BASIS_OFF + cols[None, :] * DH + j[:, None], packed.to(tl.uint8), mask=bm)
            else:
                b_ptr = rows_i8 + row + BASIS_OFF + cols[None, :] * D + 2 * j[:, None]
                tl.store(b_ptr, q_even.to(tl.int8), mask=bm)
                tl.store(b_ptr + 1, q_odd.to(tl.int8), mask=bm)
            f_scales = (row + SCALE_OFF) // 2
            tl.store(rows_f16 + f_scales + tok * 0, s_mu.to(tl.float16), mask=tok == 0)
            tl.store(rows_f16 + f_scales + 1 + tok, tok_scale.to(tl.float16))
            tl.store(rows_f16 + f_scales + 1 + B + cols, s_col.to(tl.float16), mask=cm)
        pad = tl.arange(0, 64)
        tl.store(rows_u8 + row + USED + pad, tl.zeros([64], dtype=tl.uint8), mask=USED + pad < row_bytes)
