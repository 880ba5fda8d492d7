"""Group combine + top-(k-2) page selection of score_select: the key helpers both paths use, and the chunked
path (`ScoreTuning.select_path="chunked"`: three launches after the score kernel; the backend runs it where the
merge path, merge.py, declines a budget its candidate tile cannot hold).

Reference: `reference.select.combine_group` (page_mask = `config.scored_pages`) and `select_pages`.

Keys: each contested page's group key (log of its share-average / group-max share / mass fraction,
all <= 0; the reference's order) as 23-bit fixed point, 2^-17 steps over [-64, 0]: log shares below
-64 (share < 2e-28) all map to 0, and keys within 2^-17 (7.6e-6 in log share, under the checks'
1e-5 tie tolerance) tie. Ties go to the lower page id, as exact ties do in the reference.

Top-(k-2) by a two-level radix select (13 + 10 bits) in which every pass over pages or candidates is
spread over (pair, chunk) programs. Each launch ends with the pair's last program to arrive (one
acq_rel counter; no program waits for another, so the grid needs no co-residency) doing the pair's
serial step once, whose result the next launch reads: a threshold pick, or the final row, O(chunks + k)
whatever the key distribution. (A resolution that walked all candidates of the threshold bin in one
program took 473 us per layer at 128K on the H200 with flat attention against 31 us on random queries.)
1. `_keys_kernel`: merges the score kernel's chunk normalizers, writes the keys, and adds their top 13
   bits to the pair's histogram; last program: threshold bin b1 (and the pages still needed from it),
   histogram zeroed.
2. `_gather_kernel`: pages above b1 go to the output (atomic slot counter, unordered), pages in it to
   the chunk's candidate list (page order, inside the chunk's own page range) and their low 10 bits to
   the pair's second histogram; last program: low-bit threshold b2 (and the ties still needed), second
   histogram zeroed.
3. `_resolve_kernel`: candidates above b2 go to the output, ties (low == b2) stay in the chunk's list,
   compacted in place, and are counted; last program: the first `need` ties in chunk order (= page
   order), sink and recent, sorted ascending; the slot counter zeroed. Pages <= k: every page, -1
   padded (the dense fallback, decided on the device).
Histogram atomics are pre-aggregated per block when the block's digits span < 64 bins (a flat
distribution would otherwise send every lane's atomic to one address).
"""

from __future__ import annotations

import triton
import triton.language as tl

KEYS_BLOCK = 512  # pages per iteration of the key, gather and resolve kernels
KEYS_WARPS = 8
FINAL_WARPS = 8  # the resolve kernel's: its last program's [k, chunks] tie lookup is up to 16K elements (4 warps: 255 registers)
HIST_BINS = 8192  # top 13 of the 23 key bits
# Each pair's histogram row also holds COARSE_BINS counts of the digits' top 6 bits (after the 8192),
# so a threshold pick reads 64 + 128 counts instead of scanning 8192 (when every gather, resolve and
# finalize program repeated the pick, the scan cost ~5-8 us per launch at 128K bs1 on the H200).
COARSE_BINS = 64
HIST_ROW = HIST_BINS + COARSE_BINS
_COUNTS_TAIL = tl.constexpr(6)  # a counts row past its 2C per-chunk counts: slot counter, arrivals, four picks
_COARSE = tl.constexpr(COARSE_BINS)
LOW_BITS = 10  # resolved by the second histogram
KEY_STEPS_PER_UNIT = 1 << 17  # fixed-point steps per unit of log share
AGG_WINDOW = 64  # digit span below which a block counts locally before its atomics


def counts_width(max_chunks: int) -> int:
    """Ints per pair of the counts workspace (`_count_row`)."""
    return 2 * max_chunks + _COUNTS_TAIL.value


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
        coarse = tl.load(row_ptr + NB + tl.arange(0, _COARSE), cache_modifier=".cg")
        coarse_bin, need_in_bin = _pick_bin(coarse, need, _COARSE)
        fine = tl.load(row_ptr + coarse_bin * FINE + tl.arange(0, FINE), cache_modifier=".cg")
        fine_bin, rest = _pick_bin(fine, need_in_bin, FINE)
        picked = coarse_bin * FINE + fine_bin
    else:
        picked, rest = _pick_bin(tl.load(row_ptr + tl.arange(0, NB), cache_modifier=".cg"), need, NB)
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
    scores_ptr, chunk_max_ptr, chunk_sum_ptr, keys_ptr, hist_ptr, counts_ptr, seq_lens_ptr,
    num_kv_heads, max_pages, num_chunks, K, num_score_chunks,
    G: tl.constexpr, GS: tl.constexpr, MAXC: tl.constexpr, B: tl.constexpr, RULE: tl.constexpr,
    BLOCK: tl.constexpr, NBINS: tl.constexpr, LOW_BITS: tl.constexpr, STEPS: tl.constexpr, WINDOW: tl.constexpr,
    SCP: tl.constexpr, COARSE_PICK: tl.constexpr = True,
):
    """Group key of every contested page as a 23-bit fixed-point log share, plus its top-digit histogram;
    the pair's last program picks the threshold bin b1 from it and leaves the histogram zeroed.

    The normalizers come from the score kernel's `num_score_chunks` chunks; this kernel's own page
    ranges (and every later kernel's) are `num_chunks` selection chunks, which may be fewer."""
    pair, chunk, num_pages = _program_pages(seq_lens_ptr, num_kv_heads, B)
    if num_pages > K:
        _chunk_keys(scores_ptr, chunk_max_ptr, chunk_sum_ptr, keys_ptr, hist_ptr, pair, chunk, num_pages,
                    max_pages, num_chunks, num_score_chunks, G, GS, MAXC, RULE, BLOCK, NBINS, LOW_BITS, STEPS, WINDOW, SCP)
        count_row = _count_row(counts_ptr, pair, MAXC)
        if _last_to_arrive(_arrivals(count_row, MAXC), num_chunks):
            hist_row = hist_ptr + pair * (NBINS + _COARSE)
            b1, need = _pick_top_bin(hist_row, K - 2, NBINS, COARSE_PICK)
            _clear_histogram_row(hist_row, NBINS)
            tl.store(_picks(count_row, MAXC), b1)
            tl.store(_picks(count_row, MAXC) + 1, need)


@triton.jit
def _count_row(counts_ptr, pair, MAXC: tl.constexpr):
    """A pair's row of the counts workspace (`counts_width(MAXC)` ints): candidates per chunk [0, C), the
    output slot counter C, ties per chunk [C+1, 2C+1), the arrival counter 2C+1, then the picks (b1, pages
    still needed after b1's bin, b2, ties still needed) at 2C+2 .. 2C+5."""
    return counts_ptr + pair * (2 * MAXC + _COUNTS_TAIL)


@triton.jit
def _arrivals(count_row, MAXC: tl.constexpr):
    """The chunked path's arrival counter in a pair's counts row."""
    return count_row + 2 * MAXC + 1


@triton.jit
def _picks(count_row, MAXC: tl.constexpr):
    """The pair's picks in its counts row: b1, pages still needed after b1's bin, b2, ties still needed."""
    return count_row + 2 * MAXC + 2


@triton.jit
def _last_to_arrive(counter, num_chunks):
    """True in the last of the pair's `num_chunks` programs of this launch to arrive at `counter`, which it
    resets for the next launch. Every other program's writes are visible to it: the barrier orders each
    thread's writes before the acq_rel arrival (read other programs' plain stores with ".cg": L1 is not
    coherent across SMs)."""
    tl.debug_barrier()
    last = tl.atomic_add(counter, 1, sem="acq_rel") == num_chunks - 1
    if last:
        tl.store(counter, 0)
    return last


@triton.jit
def _group_normalizer(chunk_max_ptr, chunk_sum_ptr, pair, num_score_chunks,
                      G: tl.constexpr, GS: tl.constexpr, MAXC: tl.constexpr, RULE: tl.constexpr, SCP: tl.constexpr):
    """(heads with shares [GS], log Z_g [GS], the rule's offset) of one pair from the score kernel's
    `num_score_chunks` chunk normalizers (SCP: their count rounded up to a power of two; MAXC is only the
    workspace stride)."""
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
    return has_mass, log_norm, offset


@triton.jit
def _page_keys(sc, pm, has_mass, log_norm, offset, RULE: tl.constexpr, STEPS: tl.constexpr):
    """Fixed-point group keys [N] (int32, 0 .. 64 * STEPS - 1) of the pages whose scores sc [N, GS] were
    loaded (pm: the lanes holding a page)."""
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
    return tl.minimum(fixed, 64 * STEPS - 1)


@triton.jit
def _chunk_keys(
    scores_ptr, chunk_max_ptr, chunk_sum_ptr, keys_ptr, hist_ptr, pair, chunk, num_pages,
    max_pages, num_chunks, num_score_chunks,
    G: tl.constexpr, GS: tl.constexpr, MAXC: tl.constexpr, RULE: tl.constexpr,
    BLOCK: tl.constexpr, NBINS: tl.constexpr, LOW_BITS: tl.constexpr, STEPS: tl.constexpr, WINDOW: tl.constexpr,
    SCP: tl.constexpr, HISTOGRAM: tl.constexpr = True,
):
    """Keys of the contested pages of one selection chunk of one pair, and (HISTOGRAM) their counts in the
    pair's histogram row."""
    has_mass, log_norm, offset = _group_normalizer(chunk_max_ptr, chunk_sum_ptr, pair, num_score_chunks, G, GS, MAXC, RULE, SCP)
    g = tl.arange(0, GS)
    gm = g < G
    first, last = _chunk_range(num_pages, chunk, num_chunks)
    score_rows = scores_ptr + pair.to(tl.int64) * max_pages * GS
    lane = tl.arange(0, BLOCK)
    # Each block's scores are loaded one iteration ahead: waiting on a block's own loads was ~40% of the
    # kernel's stall samples (ncu, 1M bs1, one block of 8 warps per SM).
    sc = tl.load(score_rows + (first + lane)[:, None] * GS + g[None, :],
                 mask=((first + lane) < last)[:, None] & gm[None, :], other=float("-inf"))
    for start in range(first, last, BLOCK):
        page = start + lane
        pm = page < last
        ahead = page + BLOCK
        sc_next = tl.load(score_rows + ahead[:, None] * GS + g[None, :], mask=(ahead < last)[:, None] & gm[None, :],
                          other=float("-inf"))
        fixed = _page_keys(sc, pm, has_mass, log_norm, offset, RULE, STEPS)
        tl.store(keys_ptr + pair.to(tl.int64) * max_pages + page, fixed, mask=pm)
        if HISTOGRAM:
            digit = fixed >> LOW_BITS
            hist_row = hist_ptr + pair * (NBINS + _COARSE)
            _add_to_histogram(hist_row, digit, pm, WINDOW, NBINS)
            _add_to_histogram(hist_row + NBINS, digit // (NBINS // _COARSE), pm, _COARSE, _COARSE)
        sc = sc_next


@triton.jit
def _gather_kernel(
    keys_ptr, low_hist_ptr, counts_ptr, cand_low_ptr, cand_page_ptr, seq_lens_ptr, out_ptr,
    num_kv_heads, max_pages, num_chunks, K,
    B: tl.constexpr, MAXC: tl.constexpr, BLOCK: tl.constexpr, LOW_BITS: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """Pages above the threshold bin go to the output; pages inside it become the chunk's candidates. The
    pair's last program picks the low-bit threshold b2 and leaves the low histogram zeroed."""
    pair, chunk, num_pages = _program_pages(seq_lens_ptr, num_kv_heads, B)
    if num_pages > K:
        count_row = _count_row(counts_ptr, pair, MAXC)
        b1 = tl.load(_picks(count_row, MAXC))
        first, last = _chunk_range(num_pages, chunk, num_chunks)
        row = pair.to(tl.int64) * max_pages
        out_row = out_ptr + pair.to(tl.int64) * K
        low_row = low_hist_ptr + pair * (1 << LOW_BITS)
        lane = tl.arange(0, BLOCK)
        tl.static_assert(BLOCK < 65536)  # both counts of a block in one reduction, 16 bits each
        n_cand = 0
        u = tl.load(keys_ptr + row + first + lane, mask=first + lane < last, other=0)  # a block ahead, as the keys
        for start in range(first, last, BLOCK):
            page = start + lane
            pm = page < last
            u_next = tl.load(keys_ptr + row + page + BLOCK, mask=page + BLOCK < last, other=0)
            digit = u >> LOW_BITS
            above = pm & (digit > b1)
            inside = pm & (digit == b1)
            counts = tl.sum(above.to(tl.int32) + (inside.to(tl.int32) << 16), axis=0)
            n_up = counts & 0xFFFF
            n_in = counts >> 16
            if n_up > 0:  # fewer than k - 2 pages in all: the counter sees few atomics
                base = tl.atomic_add(count_row + MAXC, n_up, sem="relaxed")
                tl.store(out_row + 1 + base + tl.cumsum(above.to(tl.int32), axis=0) - 1, page, mask=above)
            if n_in > 0:  # real attention leaves most blocks without a page of the threshold bin
                low = u & ((1 << LOW_BITS) - 1)
                pos = first + n_cand + tl.cumsum(inside.to(tl.int32), axis=0) - 1
                tl.store(cand_low_ptr + row + pos, low, mask=inside)
                tl.store(cand_page_ptr + row + pos, page, mask=inside)
                _add_to_histogram(low_row, low, inside, WINDOW, 1 << LOW_BITS)
            n_cand += n_in
            u = u_next
        tl.store(count_row + chunk, n_cand)
        if _last_to_arrive(_arrivals(count_row, MAXC), num_chunks):
            bins = tl.arange(0, 1 << LOW_BITS)
            low_hist = tl.load(low_row + bins, cache_modifier=".cg")
            b2, need = _pick_bin(low_hist, tl.load(_picks(count_row, MAXC) + 1), 1 << LOW_BITS)
            tl.store(low_row + bins, tl.zeros([1 << LOW_BITS], tl.int32))  # each lane zeroes the counts it read
            tl.store(_picks(count_row, MAXC) + 2, b2)
            tl.store(_picks(count_row, MAXC) + 3, need)


@triton.jit
def _resolve_kernel(
    counts_ptr, cand_low_ptr, cand_page_ptr, seq_lens_ptr, out_ptr,
    num_kv_heads, max_pages, num_chunks, K,
    B: tl.constexpr, MAXC: tl.constexpr, BLOCK: tl.constexpr, K_PAD: tl.constexpr,
    CHUNKS_PAD: tl.constexpr = 128,  # >= num_chunks (a power of two)
):
    """Candidates above the low-bit threshold go to the output; ties stay, compacted, in the chunk's list;
    the pair's last program takes the first ties it still needs and writes the sorted row. Pages <= k:
    every page, -1 padded (the dense fallback, decided on the device)."""
    pair, chunk, num_pages = _program_pages(seq_lens_ptr, num_kv_heads, B)
    out_row = out_ptr + pair.to(tl.int64) * K
    if num_pages > K:
        count_row = _count_row(counts_ptr, pair, MAXC)
        b2 = tl.load(_picks(count_row, MAXC) + 2)
        first, _ = _chunk_range(num_pages, chunk, num_chunks)
        row = pair.to(tl.int64) * max_pages + first
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
        if _last_to_arrive(_arrivals(count_row, MAXC), num_chunks):
            _finish_pair(count_row, cand_page_ptr, pair, num_pages, out_row, max_pages, num_chunks, K,
                         MAXC, K_PAD, CHUNKS_PAD)
    elif chunk == 0:
        _dense_row(out_row, num_pages, K, K_PAD)


@triton.jit
def _dense_row(out_row, num_pages, K, K_PAD: tl.constexpr):
    """Pages <= k: every page, -1 padded (the dense fallback, decided on the device)."""
    slot = tl.arange(0, K_PAD)
    tl.store(out_row + slot, tl.where(slot < num_pages, slot, -1), mask=slot < K)


@triton.jit
def _clear_histogram_row(row_ptr, NB: tl.constexpr):
    """Zero a pair's histogram row (fine and coarse counts) for the next call, once every lane has read it."""
    tl.debug_barrier()  # every lane has read its counts before any lane zeroes them
    tl.store(row_ptr + tl.arange(0, NB), tl.zeros([NB], tl.int32))
    tl.store(row_ptr + NB + tl.arange(0, _COARSE), tl.zeros([_COARSE], tl.int32))


@triton.jit
def _finish_pair(
    count_row, cand_page_ptr, pair, num_pages, out_row, max_pages, num_chunks, K,
    MAXC: tl.constexpr, K_PAD: tl.constexpr, CHUNKS_PAD: tl.constexpr,
):
    """One sparse pair's last step: the first `need` ties in page order + sink + recent, ascending; the slot
    counter is left zeroed for the next call. Other programs' writes are read with ".cg"."""
    slot = tl.arange(0, K_PAD)
    need = tl.load(_picks(count_row, MAXC) + 3)
    n_above = tl.load(count_row + MAXC, cache_modifier=".cg")
    tl.store(count_row + MAXC, 0)  # the slot counter starts at zero on the next call
    ch = tl.arange(0, CHUNKS_PAD)
    ties = tl.load(count_row + MAXC + 1 + ch, mask=ch < num_chunks, other=0, cache_modifier=".cg")
    tie_end = tl.cumsum(ties, axis=0)  # inclusive: ties in chunks 0..c
    # Slot j < need takes tie number j in chunk order: chunk c = #chunks whose ties end at or before j.
    done = tie_end[None, :] <= slot[:, None]  # [K_PAD, CHUNKS_PAD]
    c = tl.sum(done.to(tl.int32), axis=1)
    c_start = tl.max(tl.where(done, tie_end[None, :], 0), axis=1)
    chunk_first = _chunk_range(num_pages, c, num_chunks)[0]
    take = slot < need
    pos = chunk_first + slot - c_start
    page = tl.load(cand_page_ptr + pair.to(tl.int64) * max_pages + pos, mask=take, other=0, cache_modifier=".cg")
    tl.store(out_row + 1 + n_above + slot, page, mask=take)
    tl.store(out_row, 0)
    tl.store(out_row + K - 1, num_pages - 1)  # the recent page
    tl.debug_barrier()
    row = tl.load(out_row + slot, mask=slot < K, other=2147483647, cache_modifier=".cg")
    tl.store(out_row + slot, tl.sort(row), mask=slot < K)
