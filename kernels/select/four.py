"""Group combine + top-(k-2) page selection of score_select: the key and histogram helpers every path
uses, and the four-launch path (`ScoreTuning.select_path="four"`, the backend's choice on wide block
tables); the one-launch path is topk_one.py.

Reference: `reference.select.combine_group` (page_mask = `config.scored_pages`) and `select_pages`.

Keys: each contested page's group key (log of its share-average / group-max share / mass fraction,
all <= 0; the reference's order) as 23-bit fixed point, 2^-17 steps over [-64, 0]: log shares below
-64 (share < 2e-28) all map to 0, and keys within 2^-17 (7.6e-6 in log share, under the checks'
1e-5 tie tolerance) tie. Ties go to the lower page id, as exact ties do in the reference.

Top-(k-2) by a two-level radix select (13 + 10 bits) in which every pass over pages or candidates is
spread over (pair, chunk) programs; only the last kernel is one program per (sequence, KV head), and
its work is O(chunks + k) whatever the key distribution. (The previous resolution walked all
candidates of the threshold bin in one program: with flat attention every page is a candidate, and it
took 473 us per layer at 128K on the H200 against 31 us on random queries.)
2. `_keys_kernel`: merges the score kernel's chunk normalizers, writes the keys, and adds their top 13
   bits to the pair's histogram.
3. `_gather_kernel`: threshold bin b1 from the finished histogram; pages above it go to the output
   (atomic slot counter, unordered), pages in it to the chunk's candidate list (page order, inside
   the chunk's own page range) and their low 10 bits to the pair's second histogram.
4. `_resolve_kernel`: threshold b2 of the low bits; candidates above it go to the output, ties
   (low == b2) stay in the chunk's list, compacted in place, and are counted.
5. `_finalize_kernel`: the first `need` ties in chunk order (= page order), sink and recent, sorted
   ascending; zeroes both histograms and the slot counter for the next call. Pages <= k: every page,
   -1 padded (the dense fallback, decided on the device).
Histogram atomics are pre-aggregated per block when the block's digits span < 64 bins (a flat
distribution would otherwise send every lane's atomic to one address).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..triton_common import enter_dependent

KEYS_BLOCK = 512  # pages per iteration of the key, gather and resolve kernels
KEYS_WARPS = 8
FINAL_WARPS = 8  # its [k, chunks] tie lookup is up to 16K elements: 4 warps sat at 255 registers
HIST_BINS = 8192  # top 13 of the 23 key bits
# Each pair's histogram row also holds COARSE_BINS counts of the digits' top 6 bits (after the 8192),
# so a threshold pick reads 64 + 128 counts instead of scanning 8192: the gather, resolve and finalize
# programs each repeated that scan (H200: ~5-8 us per launch at 128K bs1, growing with the chunk count).
COARSE_BINS = 64
HIST_ROW = HIST_BINS + COARSE_BINS
_COARSE = tl.constexpr(COARSE_BINS)
LOW_BITS = 10  # resolved by the second histogram
KEY_STEPS_PER_UNIT = 1 << 17  # fixed-point steps per unit of log share
AGG_WINDOW = 64  # digit span below which a block counts locally before its atomics
COMBINE_CODES = {"share_average": 0, "group_max": 1, "group_mass": 2}


@triton.jit
def _pick_bin(hist, need, NB: tl.constexpr):
    """Largest bin b with count(digit >= b) >= need; returns (b, need - count(digit > b))."""
    bins = tl.arange(0, NB)
    at_least = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
    b = tl.max(tl.where(at_least >= need, bins, -1), axis=0)
    above = tl.sum(tl.where(bins == b, at_least - hist, 0), axis=0)
    return b, need - above


@triton.jit
def _pick_top_bin(row_ptr, need, NB: tl.constexpr, COARSE_PICK: tl.constexpr):
    """`_pick_bin` of the NB-bin histogram at row_ptr. COARSE_PICK: from its coarse counts (at row_ptr +
    NB, _COARSE bins of NB / _COARSE digits each) and the fine counts of one coarse bin (192 counts read
    instead of NB, one more dependent load); else from all NB counts."""
    if COARSE_PICK:
        FINE: tl.constexpr = NB // _COARSE
        coarse_bin, need_in_bin = _pick_bin(tl.load(row_ptr + NB + tl.arange(0, _COARSE)), need, _COARSE)
        fine_bin, rest = _pick_bin(tl.load(row_ptr + coarse_bin * FINE + tl.arange(0, FINE)), need_in_bin, FINE)
        picked = coarse_bin * FINE + fine_bin
    else:
        picked, rest = _pick_bin(tl.load(row_ptr + tl.arange(0, NB)), need, NB)
    return picked, rest


@triton.jit
def _add_to_histogram(hist_row, digit, valid, WINDOW: tl.constexpr, NB: tl.constexpr):
    """hist_row[digit] += 1 for the valid lanes; one atomic per bin when the digits span < WINDOW bins (always,
    without looking, when the histogram has no more than WINDOW bins: each block reduction of the span is a
    pair of CTA barriers, and the keys kernel's loop had 20). The span's min and max stay two reductions: one
    `tl.reduce` over both took the interpreter 1.5x as long (the CI's select tests)."""
    if NB <= WINDOW:
        local = tl.histogram(tl.where(valid, digit, 0), NB, mask=valid)
        tl.atomic_add(hist_row + tl.arange(0, NB), local, mask=local > 0, sem="relaxed")
    else:
        lo = tl.min(tl.where(valid, digit, NB), axis=0)
        hi = tl.max(tl.where(valid, digit, -1), axis=0)
        if hi - lo < WINDOW:  # also when no lane is valid (hi - lo < 0): every count is 0, nothing is added
            local = tl.histogram(tl.where(valid, digit - lo, 0), WINDOW, mask=valid)
            tl.atomic_add(hist_row + lo + tl.arange(0, WINDOW), local, mask=local > 0, sem="relaxed")
        else:
            tl.atomic_add(hist_row + digit, 1, mask=valid, sem="relaxed")


@triton.jit
def _program_pages(seq_lens_ptr, num_kv_heads, B: tl.constexpr):
    """(pair = sequence * Hkv + KV head, chunk, pages holding tokens) of this program."""
    pair = tl.program_id(0)
    return pair, tl.program_id(1), tl.cdiv(tl.load(seq_lens_ptr + pair // num_kv_heads), B)


@triton.jit
def _chunk_range(num_pages, chunk, num_chunks):
    """[first, last) of the contested pages 1 .. num_pages-2 that chunk `chunk` of `num_chunks` owns."""
    recent = num_pages - 1
    per_chunk = tl.cdiv(recent - 1, num_chunks)
    first = 1 + chunk * per_chunk
    return first, tl.minimum(first + per_chunk, recent)


@triton.jit
def _keys_kernel(
    scores_ptr, chunk_max_ptr, chunk_sum_ptr, keys_ptr, hist_ptr, seq_lens_ptr,
    num_kv_heads, max_pages, num_chunks, K, num_score_chunks,
    G: tl.constexpr, GS: tl.constexpr, MAXC: tl.constexpr, B: tl.constexpr, RULE: tl.constexpr,
    BLOCK: tl.constexpr, NBINS: tl.constexpr, LOW_BITS: tl.constexpr, STEPS: tl.constexpr, WINDOW: tl.constexpr,
    SCP: tl.constexpr, PDL: tl.constexpr = False,
):
    """Group key of every contested page as a 23-bit fixed-point log share, plus its top-digit histogram.

    The normalizers come from the score kernel's `num_score_chunks` chunks; this kernel's own page
    ranges (and every later kernel's) are `num_chunks` selection chunks, which may be fewer."""
    enter_dependent(PDL)
    pair, chunk, num_pages = _program_pages(seq_lens_ptr, num_kv_heads, B)
    if num_pages > K:
        _chunk_keys(scores_ptr, chunk_max_ptr, chunk_sum_ptr, keys_ptr, hist_ptr, pair, chunk, num_pages,
                    max_pages, num_chunks, num_score_chunks, G, GS, MAXC, RULE, BLOCK, NBINS, LOW_BITS, STEPS, WINDOW, SCP)


@triton.jit
def _chunk_keys(
    scores_ptr, chunk_max_ptr, chunk_sum_ptr, keys_ptr, hist_ptr, pair, chunk, num_pages,
    max_pages, num_chunks, num_score_chunks,
    G: tl.constexpr, GS: tl.constexpr, MAXC: tl.constexpr, RULE: tl.constexpr,
    BLOCK: tl.constexpr, NBINS: tl.constexpr, LOW_BITS: tl.constexpr, STEPS: tl.constexpr, WINDOW: tl.constexpr,
    SCP: tl.constexpr,
):
    """Keys and histogram counts of the contested pages of one selection chunk of one pair (SCP: the
    score chunks' count rounded up to a power of two; MAXC is only the workspace stride)."""
    g = tl.arange(0, GS)
    gm = g < G
    ch = tl.arange(0, SCP)
    part = (pair * MAXC + ch[:, None]) * GS + g[None, :]
    cmask = (ch[:, None] < num_score_chunks) & gm[None, :]
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
    if RULE == 2:  # group_mass: logsumexp_g s - logsumexp over every (g, page)
        log_norm = tl.where(has_mass, log_norm, float("-inf"))
        norm_max = tl.max(log_norm, axis=0)
        offset = norm_max + tl.log(tl.sum(tl.exp(log_norm - norm_max), axis=0))
    elif RULE == 0:  # share_average: log(mean_g share_g)
        offset = tl.log(G * 1.0)
    else:
        offset = 0.0
    first, last = _chunk_range(num_pages, chunk, num_chunks)
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
        fixed = (key * STEPS).to(tl.int32) + 64 * STEPS  # 0 = share <= e^-64
        fixed = tl.minimum(fixed, 64 * STEPS - 1)
        tl.store(keys_ptr + pair.to(tl.int64) * max_pages + page, fixed, mask=pm)
        digit = fixed >> LOW_BITS
        hist_row = hist_ptr + pair * (NBINS + _COARSE)
        _add_to_histogram(hist_row, digit, pm, WINDOW, NBINS)
        _add_to_histogram(hist_row + NBINS, digit // (NBINS // _COARSE), pm, _COARSE, _COARSE)


@triton.jit
def _gather_kernel(
    keys_ptr, hist_ptr, low_hist_ptr, counts_ptr, cand_low_ptr, cand_page_ptr, seq_lens_ptr, out_ptr,
    num_kv_heads, max_pages, num_chunks, K,
    B: tl.constexpr, MAXC: tl.constexpr, BLOCK: tl.constexpr, NBINS: tl.constexpr, LOW_BITS: tl.constexpr,
    WINDOW: tl.constexpr, COARSE_PICK: tl.constexpr = True, PDL: tl.constexpr = False,
):
    """Pages above the threshold bin go to the output; pages inside it become the chunk's candidates."""
    enter_dependent(PDL)
    pair, chunk, num_pages = _program_pages(seq_lens_ptr, num_kv_heads, B)
    if num_pages > K:
        b1, _ = _pick_top_bin(hist_ptr + pair * (NBINS + _COARSE), K - 2, NBINS, COARSE_PICK)
        first, last = _chunk_range(num_pages, chunk, num_chunks)
        row = pair.to(tl.int64) * max_pages
        out_row = out_ptr + pair.to(tl.int64) * K
        count_row = counts_ptr + pair * (2 * MAXC + 2)
        n_cand = 0
        for start in range(first, last, BLOCK):
            page = start + tl.arange(0, BLOCK)
            pm = page < last
            u = tl.load(keys_ptr + row + page, mask=pm, other=0)
            digit = u >> LOW_BITS
            above = pm & (digit > b1)
            inside = pm & (digit == b1)
            n_up = tl.sum(above.to(tl.int32), axis=0)
            if n_up > 0:  # fewer than k - 2 pages in all: the counter sees few atomics
                base = tl.atomic_add(count_row + MAXC, n_up, sem="relaxed")
                tl.store(out_row + 1 + base + tl.cumsum(above.to(tl.int32), axis=0) - 1, page, mask=above)
            low = u & ((1 << LOW_BITS) - 1)
            pos = first + n_cand + tl.cumsum(inside.to(tl.int32), axis=0) - 1
            tl.store(cand_low_ptr + row + pos, low, mask=inside)
            tl.store(cand_page_ptr + row + pos, page, mask=inside)
            _add_to_histogram(low_hist_ptr + pair * (1 << LOW_BITS), low, inside, WINDOW, 1 << LOW_BITS)
            n_cand += tl.sum(inside.to(tl.int32), axis=0)
        tl.store(count_row + chunk, n_cand)


@triton.jit
def _resolve_kernel(
    hist_ptr, low_hist_ptr, counts_ptr, cand_low_ptr, cand_page_ptr, seq_lens_ptr, out_ptr,
    num_kv_heads, max_pages, num_chunks, K,
    B: tl.constexpr, MAXC: tl.constexpr, BLOCK: tl.constexpr, NBINS: tl.constexpr, LOW_BITS: tl.constexpr,
    COARSE_PICK: tl.constexpr = True, PDL: tl.constexpr = False,
):
    """Candidates above the low-bit threshold go to the output; ties stay, compacted, in the chunk's list."""
    enter_dependent(PDL)
    pair, chunk, num_pages = _program_pages(seq_lens_ptr, num_kv_heads, B)
    if num_pages > K:
        _, need = _pick_top_bin(hist_ptr + pair * (NBINS + _COARSE), K - 2, NBINS, COARSE_PICK)
        b2, _ = _pick_bin(tl.load(low_hist_ptr + pair * (1 << LOW_BITS) + tl.arange(0, 1 << LOW_BITS)), need, 1 << LOW_BITS)
        first, _ = _chunk_range(num_pages, chunk, num_chunks)
        row = pair.to(tl.int64) * max_pages + first
        out_row = out_ptr + pair.to(tl.int64) * K
        count_row = counts_ptr + pair * (2 * MAXC + 2)
        n_cand = tl.load(count_row + chunk)
        n_tie = 0
        for start in range(0, n_cand, BLOCK):
            f = start + tl.arange(0, BLOCK)
            valid = f < n_cand
            low = tl.load(cand_low_ptr + row + f, mask=valid, other=0)
            page = tl.load(cand_page_ptr + row + f, mask=valid, other=0)
            up = valid & (low > b2)
            tie = valid & (low == b2)
            n_up = tl.sum(up.to(tl.int32), axis=0)
            if n_up > 0:
                base = tl.atomic_add(count_row + MAXC, n_up, sem="relaxed")
                tl.store(out_row + 1 + base + tl.cumsum(up.to(tl.int32), axis=0) - 1, page, mask=up)
            # In place: a tie is written at or before the slot it was read from, and the whole block
            # is loaded before any of its stores (they depend on the block-wide cumsum).
            tl.store(cand_page_ptr + row + n_tie + tl.cumsum(tie.to(tl.int32), axis=0) - 1, page, mask=tie)
            n_tie += tl.sum(tie.to(tl.int32), axis=0)
        tl.store(count_row + MAXC + 1 + chunk, n_tie)


@triton.jit
def _open_pair_row(seq_lens_ptr, out_ptr, num_kv_heads, K, B: tl.constexpr, K_PAD: tl.constexpr):
    """(pair, pages, output row, slots, sparse) of a one-program-per-pair kernel. With pages <= k the
    dense fallback (every page, -1 padded; decided on the device) is written here and `sparse` is False."""
    pair, _, num_pages = _program_pages(seq_lens_ptr, num_kv_heads, B)
    out_row = out_ptr + pair.to(tl.int64) * K
    slot = tl.arange(0, K_PAD)
    sparse = num_pages > K
    if not sparse:
        _dense_row(out_row, num_pages, K, K_PAD)
    return pair, num_pages, out_row, slot, sparse


@triton.jit
def _dense_row(out_row, num_pages, K, K_PAD: tl.constexpr):
    """Pages <= k: every page, -1 padded (the dense fallback, decided on the device)."""
    slot = tl.arange(0, K_PAD)
    tl.store(out_row + slot, tl.where(slot < num_pages, slot, -1), mask=slot < K)


@triton.jit
def _take_histogram(row_ptr, NB: tl.constexpr):
    """A pair's histogram, left zeroed for the next call."""
    bins = tl.arange(0, NB)
    hist = tl.load(row_ptr + bins)
    tl.store(row_ptr + bins, tl.zeros([NB], tl.int32))
    return hist


@triton.jit
def _take_top_pick(row_ptr, need, NB: tl.constexpr, COARSE_PICK: tl.constexpr):
    """`_pick_top_bin` of a pair's histogram row, which is then left zeroed (fine and coarse counts)."""
    picked, rest = _pick_top_bin(row_ptr, need, NB, COARSE_PICK)
    _clear_histogram_row(row_ptr, NB)
    return picked, rest


@triton.jit
def _clear_histogram_row(row_ptr, NB: tl.constexpr):
    """Zero a pair's histogram row (fine and coarse counts) for the next call, once every lane has read it."""
    tl.debug_barrier()  # every lane has read its counts before any lane zeroes them
    tl.store(row_ptr + tl.arange(0, NB), tl.zeros([NB], tl.int32))
    tl.store(row_ptr + NB + tl.arange(0, _COARSE), tl.zeros([_COARSE], tl.int32))


@triton.jit
def _finalize_kernel(
    hist_ptr, low_hist_ptr, counts_ptr, cand_page_ptr, seq_lens_ptr, out_ptr,
    num_kv_heads, max_pages, num_chunks, K,
    B: tl.constexpr, MAXC: tl.constexpr, NBINS: tl.constexpr, LOW_BITS: tl.constexpr, K_PAD: tl.constexpr,
    COARSE_PICK: tl.constexpr = True, CHUNKS_PAD: tl.constexpr = 128,  # >= num_chunks (a power of two)
    PDL: tl.constexpr = False,
):
    """The first `need` ties in page order + sink + recent, ascending; resets the scratch for the next call."""
    enter_dependent(PDL)
    pair, num_pages, out_row, _, sparse = _open_pair_row(seq_lens_ptr, out_ptr, num_kv_heads, K, B, K_PAD)
    if sparse:
        _finalize_pair(hist_ptr, low_hist_ptr, counts_ptr + pair * (2 * MAXC + 2), cand_page_ptr, pair, num_pages, out_row,
                       max_pages, num_chunks, K, MAXC, NBINS, LOW_BITS, K_PAD, COARSE_PICK, CHUNKS_PAD)


@triton.jit
def _finalize_pair(
    hist_ptr, low_hist_ptr, count_row, cand_page_ptr, pair, num_pages, out_row, max_pages, num_chunks, K,
    MAXC: tl.constexpr, NBINS: tl.constexpr, LOW_BITS: tl.constexpr, K_PAD: tl.constexpr, COARSE_PICK: tl.constexpr,
    CHUNKS_PAD: tl.constexpr,
):
    """One sparse pair's last step: the first `need` ties in page order + sink + recent, ascending; its
    histograms and slot counter are left zeroed for the next call."""
    slot = tl.arange(0, K_PAD)
    _, need = _take_top_pick(hist_ptr + pair * (NBINS + _COARSE), K - 2, NBINS, COARSE_PICK)
    low_hist = _take_histogram(low_hist_ptr + pair * (1 << LOW_BITS), 1 << LOW_BITS)
    _, need = _pick_bin(low_hist, need, 1 << LOW_BITS)
    n_above = tl.load(count_row + MAXC)
    tl.store(count_row + MAXC, 0)  # the slot counter starts at zero on the next call
    ch = tl.arange(0, CHUNKS_PAD)
    ties = tl.load(count_row + MAXC + 1 + ch, mask=ch < num_chunks, other=0)
    tie_end = tl.cumsum(ties, axis=0)  # inclusive: ties in chunks 0..c
    # Slot j < need takes tie number j in chunk order: chunk c = #chunks whose ties end at or before j.
    done = tie_end[None, :] <= slot[:, None]  # [K_PAD, CHUNKS_PAD]
    c = tl.sum(done.to(tl.int32), axis=1)
    c_start = tl.max(tl.where(done, tie_end[None, :], 0), axis=1)
    chunk_first = _chunk_range(num_pages, c, num_chunks)[0]
    take = slot < need
    pos = chunk_first + slot - c_start
    page = tl.load(cand_page_ptr + pair.to(tl.int64) * max_pages + pos, mask=take, other=0)
    tl.store(out_row + 1 + n_above + slot, page, mask=take)
    tl.store(out_row, 0)
    tl.store(out_row + K - 1, num_pages - 1)  # the recent page
    tl.debug_barrier()
    row = tl.load(out_row + slot, mask=slot < K, other=2147483647)
    tl.store(out_row + slot, tl.sort(row), mask=slot < K)
