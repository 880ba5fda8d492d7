"""Group combine + top-(k-2) page selection in ONE launch after the score kernel (`select_path="one"`;
the backend's `select="auto"` runs it on block tables up to config.AUTO_ONE_LAUNCH_MAX_PAGES wide and
topk.py's four launches on wider ones: in the 40-layer engine this path wins at 32K and loses at 64K and
128K, where its last program's serial tail, started with cold caches, costs more than three parallel
launches; H200 sessions 11-12).

Reference: `reference.select.combine_group` (page_mask = `config.scored_pages`) and `select_pages`;
keys, histogram and tie rule are topk.py's (23-bit fixed-point log shares, ties to the lower page id).

`_keys_select_kernel`, grid (S * Hkv, chunks): every program computes the keys of its chunk and adds
their top 13 bits to the pair's histogram (topk.py `_chunk_keys`), then arrives at the pair's counter.
The program that arrives last (it alone sees count = chunks - 1; no program ever waits, so the grid
needs no co-residency and the interpreter's one-program-at-a-time order works) selects, after reading
threshold bin b1 and the count still needed from it from the finished histogram (coarse pick), then
selects by its tail (`ScoreTuning.select_tail`):
- "loops" (the default, `_select_by_loops`): two short loops over the keys at any context;
- "registers", contexts up to 9216 contested pages: every key in registers (a size picked per call from the live
  pages); a threshold bin of at most COMPACT pages is compacted and resolved over [COMPACT] lanes, a
  crowded one searched in place over only the low bits where its keys differ (`_select_in_registers`);
- "memory", and "registers" on longer contexts, passes over memory: a bin of at most CAND pages is ranked in registers and merged
  with the pages above it by counting (ascending, no sort); a crowded bin takes a binary search with
  one pass per bit, then the tie cut-off page, then one ordered output pass.
This replaces topk.py's three launches after the keys (gather, resolve, finalize); on the H200 each
cost ~4-6 µs at bs1 whatever the context (`score-sweep-h200-s4.md`).

Memory order: each program's stores and histogram atomics, then a CTA barrier, then one acq_rel
atomic on the counter (Triton issues a scalar atomic from one thread): the CUTLASS semaphore pattern.
The last program clears the histogram and the counter for the next call (CUDA-graph replays).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import enter_dependent
from .topk import _COARSE, _chunk_keys, _clear_histogram_row, _dense_row, _pick_top_bin, _program_pages

CAND = 64  # bin-b1 pages ranked in registers ([CAND, CAND] compares); more take the slow path
SELECT_BLOCK = 4096  # keys per step of the last program's passes (16 per thread at 8 warps)
# Warps of the one-launch kernel. Chained after the score kernel layer by layer (as the engine runs it;
# H200, session 7, 128K bs1, engine table width) 16 warps took 48.8 / 49.6 µs of score + select (flat /
# random keys) against 49.5 / 52.4 at 8 warps and the four launches' 49.1 / 50.3; at 32K 22.0 / 25.0
# against 21.2 / 23.7 (four: 29.3 / 30.4). 16 warps cap the kernel at 128 registers and it spills (two
# accesses in its loop), so 8 stays (255 registers, no spill); `ScoreTuning(select_warps=16)` times the other.
SELECT_WARPS = 8
TAIL_CODES = {"registers": 0, "memory": 1, "loops": 2}  # config.SELECT_TAILS as the kernel's TAIL constexpr
LOOP_BLOCK = 2048  # keys per step of the loop tail (8 per thread at 8 warps); twice that past LOOP_BLOCK * 9/8 pages
# Register tensor sizes of the last program (contested keys, powers of two): each size S holds S + S/8
# keys in two tensors, so a context just past a power of two (32K or 128K plus its decode tokens) does
# not fall to the next size. Up to 8192 + 1024 pages (147K tokens) the keys stay in registers; longer
# contexts take the passes over memory (~2 µs per pass at 128K on the H200).
REG_SMALL, REG_MID, REG_LARGE = 2048, 4096, 8192
# A threshold bin of at most COMPACT pages is compacted and resolved over [COMPACT] lanes (register path);
# real attention puts a handful of pages in it, flat attention nearly all (then the in-place search runs).
COMPACT = 256


def register_sizes() -> dict:
    """The register-size constexprs of a launch (read at call time, so tests can shrink them)."""
    return {"REG_SMALL": REG_SMALL, "REG_MID": REG_MID, "REG_LARGE": REG_LARGE, "COMPACT": COMPACT}


@triton.jit
def _count_from(key_row, recent, lo, hi, BLOCK: tl.constexpr):
    """Contested pages (1 .. recent-1) whose key u has lo <= u < hi."""
    n = 0
    for start in range(1, recent, BLOCK):
        page = start + tl.arange(0, BLOCK)
        u = tl.load(key_row + page, mask=page < recent, other=-1, cache_modifier=".cg")
        n += tl.sum(((u >= lo) & (u < hi)).to(tl.int32), axis=0)
    return n


@triton.jit
def _crowded_cut(key_row, recent, b1, need_in, LOW_BITS: tl.constexpr, BLOCK: tl.constexpr):
    """(threshold key T, last page taken at T) when bin b1 holds more than CAND pages: the largest low
    part with >= need_in keys of the bin at or above it, by binary search (one pass per bit)."""
    bin_lo = b1 << LOW_BITS
    bin_hi = (b1 + 1) << LOW_BITS
    low = 0
    for bit in tl.static_range(LOW_BITS - 1, -1, -1):
        test = low | (1 << bit)
        if _count_from(key_row, recent, bin_lo | test, bin_hi, BLOCK) >= need_in:
            low = test
    threshold = bin_lo | low
    ties_wanted = need_in - _count_from(key_row, recent, threshold + 1, bin_hi, BLOCK)
    n_tie = 0
    last_page = -1
    for start in range(1, recent, BLOCK):
        page = start + tl.arange(0, BLOCK)
        u = tl.load(key_row + page, mask=page < recent, other=-1, cache_modifier=".cg")
        tie = u == threshold
        rank = n_tie + tl.cumsum(tie.to(tl.int32), axis=0) - 1
        last_page = tl.maximum(last_page, tl.max(tl.where(tie & (rank == ties_wanted - 1), page, -1), axis=0))
        n_tie += tl.sum(tie.to(tl.int32), axis=0)
    return threshold, last_page


@triton.jit
def _select_crowded(key_row, out_row, recent, b1, need_in, LOW_BITS: tl.constexpr, BLOCK: tl.constexpr):
    """Slow path: pages above the cut (and ties up to its page) in page order, one pass."""
    threshold, last_page = _crowded_cut(key_row, recent, b1, need_in, LOW_BITS, BLOCK)
    n_out = 0
    for start in range(1, recent, BLOCK):
        page = start + tl.arange(0, BLOCK)
        u = tl.load(key_row + page, mask=page < recent, other=-1, cache_modifier=".cg")
        take = (u > threshold) | ((u == threshold) & (page <= last_page))
        tl.store(out_row + 1 + n_out + tl.cumsum(take.to(tl.int32), axis=0) - 1, page, mask=take)
        n_out += tl.sum(take.to(tl.int32), axis=0)


@triton.jit
def _select_sparse_bin(key_row, out_row, page_row, low_row, recent, b1, need_in, above,
                       LOW_BITS: tl.constexpr, BLOCK: tl.constexpr, K_PAD: tl.constexpr, CAND: tl.constexpr):
    """Fast path: `above` pages with digit > b1 and need_in of the <= CAND pages of bin b1, ascending."""
    n_up = 0
    n_in = 0
    for start in range(1, recent, BLOCK):
        page = start + tl.arange(0, BLOCK)
        u = tl.load(key_row + page, mask=page < recent, other=-1, cache_modifier=".cg")
        digit = u >> LOW_BITS
        up = (page < recent) & (digit > b1)
        inside = (page < recent) & (digit == b1)
        tl.store(page_row + n_up + tl.cumsum(up.to(tl.int32), axis=0) - 1, page, mask=up)
        pos = above + n_in + tl.cumsum(inside.to(tl.int32), axis=0) - 1
        tl.store(page_row + pos, page, mask=inside)
        tl.store(low_row + pos, u & ((1 << LOW_BITS) - 1), mask=inside)
        n_up += tl.sum(up.to(tl.int32), axis=0)
        n_in += tl.sum(inside.to(tl.int32), axis=0)
    tl.debug_barrier()  # the lists are read back by other threads of this program
    c = tl.arange(0, CAND)
    cm = c < n_in
    b_page = tl.load(page_row + above + c, mask=cm, other=2147483647)
    b_low = tl.load(low_row + above + c, mask=cm, other=-1)
    # Rank in the bin: larger low bits first, then the lower page (list order is page order).
    better = cm[None, :] & ((b_low[None, :] > b_low[:, None]) | ((b_low[None, :] == b_low[:, None]) & (c[None, :] < c[:, None])))
    chosen = cm & (tl.sum(better.to(tl.int32), axis=1) < need_in)
    slot = tl.arange(0, K_PAD)
    a_ok = slot < above
    a_page = tl.load(page_row + slot, mask=a_ok, other=2147483647)
    # Merge by counting: each page's output slot = pages of the other list below it + its own rank.
    chosen_below_a = tl.sum((chosen[None, :] & (b_page[None, :] < a_page[:, None])).to(tl.int32), axis=1)
    tl.store(out_row + 1 + slot + chosen_below_a, a_page, mask=a_ok)
    a_below_b = tl.sum((a_ok[None, :] & (a_page[None, :] < b_page[:, None])).to(tl.int32), axis=1)
    chosen_rank = tl.cumsum(chosen.to(tl.int32), axis=0) - 1
    tl.store(out_row + 1 + a_below_b + chosen_rank, b_page, mask=chosen)


@triton.jit
def _span(lo, hi, LOW_BITS: tl.constexpr):
    """(prefix, bits) with [lo, hi] inside [prefix, prefix + 2^bits): bits = 1 + the highest bit where lo
    and hi differ. Flat attention (dummy weights) gives one value: bits = 0."""
    differ = lo ^ hi
    bits = 0
    for j in tl.static_range(LOW_BITS):
        bits += ((differ >> j) != 0).to(tl.int32)
    return hi - (hi & ((1 << bits) - 1)), bits


@triton.jit
def _search_low(prefix, bits, need, lows_a, lows_b, TWO: tl.constexpr):
    """Largest v with #(lows >= v) >= need (lanes outside the bin hold -1), given v in [prefix, prefix +
    2^bits): one reduction (two with TWO tensors) per bit of the span, none when the bin is one value."""
    low = prefix
    for i in range(bits):
        test = low | (1 << (bits - 1 - i))
        n = tl.sum((lows_a >= test).to(tl.int32), axis=0)
        if TWO:
            n += tl.sum((lows_b >= test).to(tl.int32), axis=0)
        if n >= need:
            low = test
    return low


@triton.jit
def _select_in_registers(key_row, out_row, low_row, page_row, recent, b1, need_in, in_bin, K,
                         LOW_BITS: tl.constexpr, NA: tl.constexpr, NB: tl.constexpr, CM: tl.constexpr, K_PAD: tl.constexpr):
    """Contested keys in two register tensors (pages 1..NA and NA+1..NA+NB; recent - 1 <= NA + NB).

    A threshold bin of at most CM pages (real attention: a handful) is compacted (one scan that also
    places the pages above the bin) and resolved over [CM] lanes, then the k-2 slots are sorted by
    counting. A crowded bin (flat attention) is searched in place, over only the low bits where its
    keys differ (none when they are all equal, as with dummy weights), then cut by two scans.
    Session 6 searched all 10 low bits over every key (~5900 instructions per thread at [8192] + [1024]).
    In this one program every reduction or scan over the [S] keys costs ~1-2 µs at 128K (H200, session 7):
    128K bs1 at the engine's table width went 23.8 -> 18.7 µs (keys + this tail; flat keys 15.6), and a
    variant that cut the pages with one more [S] scan instead of the [CM] sort took 26.5 (flat 20.3).
    (`score-sweep-h200-s7.md`.)"""
    pa = 1 + tl.arange(0, NA)
    pb = 1 + NA + tl.arange(0, NB)
    ua = tl.load(key_row + pa, mask=pa < recent, other=-1, cache_modifier=".cg")
    ub = tl.load(key_row + pb, mask=pb < recent, other=-1, cache_modifier=".cg")
    bin_lo = b1 << LOW_BITS
    in_a = (ua >> LOW_BITS) == b1  # -1 (masked) is in no bin
    in_b = (ub >> LOW_BITS) == b1
    LOW_MASK: tl.constexpr = (1 << LOW_BITS) - 1
    if in_bin <= CM:
        # One packed scan: pages above the bin count in the low 16 bits, the bin's pages in the high 16.
        pk_a = ((ua >> LOW_BITS) > b1).to(tl.int32) + (in_a.to(tl.int32) << 16)
        pk_b = ((ub >> LOW_BITS) > b1).to(tl.int32) + (in_b.to(tl.int32) << 16)
        cs_a = tl.cumsum(pk_a, axis=0)
        cs_b = tl.sum(pk_a, axis=0) + tl.cumsum(pk_b, axis=0)
        tl.store(out_row + (cs_a & 0xFFFF), pa, mask=(pk_a & 1) == 1)  # slot 1 + rank
        tl.store(out_row + (cs_b & 0xFFFF), pb, mask=(pk_b & 1) == 1)
        tl.store(low_row + (cs_a >> 16) - 1, ua & LOW_MASK, mask=in_a)
        tl.store(page_row + (cs_a >> 16) - 1, pa, mask=in_a)
        tl.store(low_row + (cs_b >> 16) - 1, ub & LOW_MASK, mask=in_b)
        tl.store(page_row + (cs_b >> 16) - 1, pb, mask=in_b)
        tl.debug_barrier()  # the lists are read back by other threads of this program
        c = tl.arange(0, CM)
        cm = c < in_bin
        lows = tl.load(low_row + c, mask=cm, other=-1)
        pages = tl.load(page_row + c, mask=cm, other=0)
        prefix, bits = _span(tl.min(tl.where(cm, lows, LOW_MASK), axis=0), tl.max(lows, axis=0), LOW_BITS)
        t_low = _search_low(prefix, bits, need_in, lows, lows, False)
        tie = cm & (lows == t_low)
        ties_wanted = need_in - tl.sum((cm & (lows > t_low)).to(tl.int32), axis=0)
        chosen = cm & ((lows > t_low) | (tie & (tl.cumsum(tie.to(tl.int32), axis=0) <= ties_wanted)))
        # after the K - 2 - need_in pages above the bin (slots 1..)
        tl.store(out_row + K - 2 - need_in + tl.cumsum(chosen.to(tl.int32), axis=0), pages, mask=chosen)
        tl.debug_barrier()
        slot = tl.arange(0, K_PAD)
        v = tl.load(out_row + 1 + slot, mask=slot < K - 2, other=2147483647)
        rank = tl.sum((v[None, :] < v[:, None]).to(tl.int32), axis=1)  # pages are distinct
        tl.debug_barrier()  # every slot is read before any is overwritten
        tl.store(out_row + 1 + rank, v, mask=slot < K - 2)
    else:
        la = tl.where(in_a, ua & LOW_MASK, -1)
        lb = tl.where(in_b, ub & LOW_MASK, -1)
        lo = tl.minimum(tl.min(tl.where(in_a, la, LOW_MASK), axis=0), tl.min(tl.where(in_b, lb, LOW_MASK), axis=0))
        prefix, bits = _span(lo, tl.maximum(tl.max(la, axis=0), tl.max(lb, axis=0)), LOW_BITS)
        low = _search_low(prefix, bits, need_in, la, lb, True)
        threshold = bin_lo | low
        ties_wanted = need_in - tl.sum((in_a & (ua > threshold)).to(tl.int32), axis=0) - tl.sum((in_b & (ub > threshold)).to(tl.int32), axis=0)
        tie_a = ua == threshold
        tie_b = ub == threshold
        take_a = (ua > threshold) | (tie_a & (tl.cumsum(tie_a.to(tl.int32), axis=0) <= ties_wanted))
        ties_in_a = tl.sum(tie_a.to(tl.int32), axis=0)
        take_b = (ub > threshold) | (tie_b & (ties_in_a + tl.cumsum(tie_b.to(tl.int32), axis=0) <= ties_wanted))
        tl.store(out_row + tl.cumsum(take_a.to(tl.int32), axis=0), pa, mask=take_a)  # slot 1 + rank
        taken_in_a = tl.sum(take_a.to(tl.int32), axis=0)
        tl.store(out_row + taken_in_a + tl.cumsum(take_b.to(tl.int32), axis=0), pb, mask=take_b)


@triton.jit
def _count_at_least(row, n, v, BLOCK: tl.constexpr):
    """Entries row[0 .. n) that are >= v (this program's own list: plain loads after a barrier)."""
    c = 0
    for start in range(0, n, BLOCK):
        i = start + tl.arange(0, BLOCK)
        c += tl.sum((tl.load(row + i, mask=i < n, other=-1) >= v).to(tl.int32), axis=0)
    return c


@triton.jit
def _select_by_loops(key_row, out_row, low_row, recent, b1, need_in, in_bin,
                     LOW_BITS: tl.constexpr, BLOCK: tl.constexpr, CM: tl.constexpr):
    """The last program's selection in short loops (`select_tail="loops"`): the code it walks is a few
    loop bodies, not thousands of unrolled lanes. In the engine every layer's GEMMs evict L2 between two
    calls, so this serial tail fetches its code cold; the register tail walks ~6K instructions and took
    30.3 µs between MLP-sized products against 15.1 µs alone (H200 s11, 128K bs1, flat keys), the four
    launches' kernels ~0.4 µs more each. This tail took 18.0 there, but 24.4 in the 40-layer engine
    (`bench trace`), against 19.1 for the four launches' kernels, which the sweep predicts exactly: what
    else the engine costs a serial tail is not known (its kernels run on one stream, 205 registers).

    Pass 1 compacts the low bits of bin b1's keys (page order) and takes their span; threshold low bits
    from [CM] lanes in registers, or for a crowded bin by binary search over the list, one pass per bit of
    the span (none when the bin is one value, as with dummy weights); pass 2 writes, in page order, every
    page above the threshold key and its first ties. Both passes load the next block before working on
    this one, so the L2 latency of a block overlaps the scan of the previous one."""
    LOW_MASK: tl.constexpr = (1 << LOW_BITS) - 1
    lane = tl.arange(0, BLOCK)
    n_in = 0
    lo = LOW_MASK
    hi = 0
    u = tl.load(key_row + 1 + lane, mask=1 + lane < recent, other=-1, cache_modifier=".cg")
    for start in range(1, recent, BLOCK):
        ahead = start + BLOCK + lane
        u_next = tl.load(key_row + ahead, mask=ahead < recent, other=-1, cache_modifier=".cg")
        inside = (u >> LOW_BITS) == b1  # masked lanes (-1) are in no bin
        low = u & LOW_MASK
        tl.store(low_row + n_in + tl.cumsum(inside.to(tl.int32), axis=0) - 1, low, mask=inside)
        n_in += tl.sum(inside.to(tl.int32), axis=0)
        lo = tl.minimum(lo, tl.min(tl.where(inside, low, LOW_MASK), axis=0))
        hi = tl.maximum(hi, tl.max(tl.where(inside, low, 0), axis=0))
        u = u_next
    tl.debug_barrier()  # the list is read back by other threads of this program
    prefix, bits = _span(lo, hi, LOW_BITS)
    if in_bin <= CM:
        c = tl.arange(0, CM)
        lows = tl.load(low_row + c, mask=c < in_bin, other=-1)
        t_low = _search_low(prefix, bits, need_in, lows, lows, False)
        above_in_bin = tl.sum((lows > t_low).to(tl.int32), axis=0)
    else:
        t_low = prefix
        for i in range(bits):
            test = t_low | (1 << (bits - 1 - i))
            if _count_at_least(low_row, in_bin, test, BLOCK) >= need_in:
                t_low = test
        above_in_bin = 0
        if bits > 0:  # with one value in the bin, none is above it
            above_in_bin = _count_at_least(low_row, in_bin, t_low + 1, BLOCK)
    threshold = (b1 << LOW_BITS) | t_low
    ties_wanted = need_in - above_in_bin
    # Pass 2: slot of a taken page = pages above the threshold up to it + ties up to it (at most
    # ties_wanted); one scan per block over both counts packed in 16-bit halves (BLOCK < 2^16).
    tl.static_assert(BLOCK < 65536)
    n_gt = 0
    n_tie = 0
    u = tl.load(key_row + 1 + lane, mask=1 + lane < recent, other=-1, cache_modifier=".cg")
    for start in range(1, recent, BLOCK):
        ahead = start + BLOCK + lane
        u_next = tl.load(key_row + ahead, mask=ahead < recent, other=-1, cache_modifier=".cg")
        gt = u > threshold
        tie = u == threshold
        packed = tl.cumsum(gt.to(tl.int32) + (tie.to(tl.int32) << 16), axis=0)
        gt_upto = n_gt + (packed & 0xFFFF)
        tie_upto = n_tie + (packed >> 16)
        take = gt | (tie & (tie_upto <= ties_wanted))
        tl.store(out_row + gt_upto + tl.minimum(tie_upto, ties_wanted), start + lane, mask=take)  # slot 1 + rank
        n_gt += tl.sum(gt.to(tl.int32), axis=0)
        n_tie += tl.sum(tie.to(tl.int32), axis=0)
        u = u_next


@triton.jit
def _keys_select_kernel(
    scores_ptr, chunk_max_ptr, chunk_sum_ptr, keys_ptr, hist_ptr, counts_ptr, cand_low_ptr, cand_page_ptr,
    seq_lens_ptr, out_ptr,
    num_kv_heads, max_pages, num_chunks, K, num_score_chunks,
    G: tl.constexpr, GS: tl.constexpr, MAXC: tl.constexpr, B: tl.constexpr, RULE: tl.constexpr,
    BLOCK: tl.constexpr, NBINS: tl.constexpr, LOW_BITS: tl.constexpr, STEPS: tl.constexpr, WINDOW: tl.constexpr,
    K_PAD: tl.constexpr, CAND: tl.constexpr, SELECT_BLOCK: tl.constexpr, COARSE_PICK: tl.constexpr = True,
    TAIL: tl.constexpr = 0, LOOP_BLOCK: tl.constexpr = 2048, REG_SMALL: tl.constexpr = 2048, REG_MID: tl.constexpr = 4096,
    REG_LARGE: tl.constexpr = 8192, COMPACT: tl.constexpr = 256,  # register tensor sizes (module constants)
    SCP: tl.constexpr = 128, PDL: tl.constexpr = False,
):
    """Keys of every chunk, then the pair's last program writes its k pages: sink, top-(k-2) ascending, recent."""
    enter_dependent(PDL)
    pair, chunk, num_pages = _program_pages(seq_lens_ptr, num_kv_heads, B)
    out_row = out_ptr + pair.to(tl.int64) * K
    if num_pages > K:
        _chunk_keys(scores_ptr, chunk_max_ptr, chunk_sum_ptr, keys_ptr, hist_ptr, pair, chunk, num_pages,
                    max_pages, num_chunks, num_score_chunks, G, GS, MAXC, RULE, BLOCK, NBINS, LOW_BITS, STEPS, WINDOW, SCP)
        tl.debug_barrier()  # every thread's keys and counts are issued before the arrival
        counter = counts_ptr + pair * (2 * MAXC + 2) + MAXC
        if tl.atomic_add(counter, 1, sem="acq_rel") == num_chunks - 1:
            hist_row = hist_ptr + pair * (NBINS + _COARSE)
            b1, need_in = _pick_top_bin(hist_row, K - 2, NBINS, COARSE_PICK)
            in_bin = tl.load(hist_row + b1)
            _clear_histogram_row(hist_row, NBINS)
            tl.store(counter, 0)
            key_row = keys_ptr + pair.to(tl.int64) * max_pages
            low_scratch = cand_low_ptr + pair.to(tl.int64) * max_pages
            page_scratch = cand_page_ptr + pair.to(tl.int64) * max_pages
            recent = num_pages - 1
            contested = recent - 1
            # The register sizes are picked per call from the live pages: every size is compiled, and a
            # [16384] tensor cost 29 µs at bs1 where [8192] cost 18 (H200, 2026-11-30), so one size
            # fitted to the widest table would make every short context pay for the longest. (The
            # engine ran 32K + decode, 2047-2059 contested pages, in the next size up; now S + S/8.)
            if TAIL == 2:
                # Steps of LOOP_BLOCK keys up to a context just past it (32K + decode tokens), twice that
                # beyond: H200 s11 between MLP products, flat keys, 2048 / 4096 keys a step: 11.1 / 13.2 µs at
                # 32K (2047 contested pages), 19.4 / 18.0 at 128K (8191).
                if contested <= LOOP_BLOCK + LOOP_BLOCK // 8:
                    _select_by_loops(key_row, out_row, low_scratch, recent, b1, need_in, in_bin, LOW_BITS, LOOP_BLOCK, COMPACT)
                else:
                    _select_by_loops(key_row, out_row, low_scratch, recent, b1, need_in, in_bin, LOW_BITS, 2 * LOOP_BLOCK, COMPACT)
            elif TAIL == 0 and contested <= REG_SMALL + REG_SMALL // 8:
                _select_in_registers(key_row, out_row, low_scratch, page_scratch, recent, b1, need_in, in_bin, K, LOW_BITS,
                                     REG_SMALL, REG_SMALL // 8, COMPACT, K_PAD)
            elif TAIL == 0 and contested <= REG_MID + REG_MID // 8:
                _select_in_registers(key_row, out_row, low_scratch, page_scratch, recent, b1, need_in, in_bin, K, LOW_BITS,
                                     REG_MID, REG_MID // 8, COMPACT, K_PAD)
            elif TAIL == 0 and contested <= REG_LARGE + REG_LARGE // 8:
                _select_in_registers(key_row, out_row, low_scratch, page_scratch, recent, b1, need_in, in_bin, K, LOW_BITS,
                                     REG_LARGE, REG_LARGE // 8, COMPACT, K_PAD)
            elif in_bin <= CAND:
                _select_sparse_bin(key_row, out_row, page_scratch, low_scratch, recent, b1,
                                   need_in, K - 2 - need_in, LOW_BITS, SELECT_BLOCK, K_PAD, CAND)
            else:
                _select_crowded(key_row, out_row, recent, b1, need_in, LOW_BITS, SELECT_BLOCK)
            tl.store(out_row, 0)
            tl.store(out_row + K - 1, recent)
    elif chunk == 0:
        _dense_row(out_row, num_pages, K, K_PAD)
