"""Group combine + top-(k-2) page selection in ONE launch after the score kernel (`select_path="one"`; until
the merge path (merge.py) the backend's choice on block tables up to 3264 pages wide: in the 40-layer engine
this path won at 32K and lost at 64K and 128K, where its last program's serial tail, started with cold
caches, costs more than three parallel launches; see docs/decisions.md).

Reference: `reference.select.combine_group` (page_mask = `config.scored_pages`) and `select_pages`;
keys, histogram and tie rule are chunked.py's (23-bit fixed-point log shares, ties to the lower page id).

`_keys_select_kernel`, grid (S * Hkv, chunks): every program computes the keys of its chunk and adds
their top 13 bits to the pair's histogram (chunked.py `_chunk_keys`), then arrives at the pair's counter.
The program that arrives last (it alone sees count = chunks - 1; no program ever waits, so the grid
needs no co-residency and the interpreter's one-program-at-a-time order works) reads threshold bin b1
and the count still needed from it from the finished histogram (coarse pick), then selects in two
short loops over the keys (`_select_by_loops`). This replaces chunked.py's two launches after the keys
(gather, resolve), each ~4-6 µs at bs1 on the H200 whatever the context.

Memory order: each program's stores and histogram atomics, then a CTA barrier, then one acq_rel
atomic on the counter (chunked.py `_last_to_arrive`; Triton issues a scalar atomic from one thread): the CUTLASS
semaphore pattern.
The last program clears the histogram and the counter for the next call (CUDA-graph replays).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..triton_common import enter_dependent
from .chunked import (_COARSE, _chunk_keys, _clear_histogram_row, _count_row, _dense_row, _last_to_arrive, _pick_top_bin,
                   _program_pages)

# Warps of the one-launch kernel. Chained after the score kernel layer by layer (H200, 128K bs1, engine
# table width) 16 warps took 48.8 / 49.6 µs of score + select (flat / random keys) against 49.5 / 52.4 at
# 8 warps; 16 warps cap the kernel at 128 registers and it spills, so 8 stays (255 registers, no spill);
# `ScoreTuning(select_warps=16)` times the other.
SELECT_WARPS = 8
LOOP_BLOCK = 2048  # keys per step of the tail (8 per thread at 8 warps); twice that past LOOP_BLOCK * 9/8 pages
# A threshold bin of at most COMPACT pages is resolved over [COMPACT] lanes in registers; real attention
# puts a handful of pages in it, flat attention nearly all (then a binary search over the list runs).
COMPACT = 256


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
def _search_low(prefix, bits, need, lows):
    """Largest v with #(lows >= v) >= need (lanes outside the bin hold -1), given v in [prefix, prefix +
    2^bits): one reduction per bit of the span, none when the bin is one value."""
    low = prefix
    for i in range(bits):
        test = low | (1 << (bits - 1 - i))
        n = tl.sum((lows >= test).to(tl.int32), axis=0)
        if n >= need:
            low = test
    return low


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
    """The last program's selection in short loops: the code it walks is a few loop bodies, not thousands
    of unrolled lanes. In the engine every layer's GEMMs evict L2 between two calls, so this serial tail
    fetches its code cold; a tail that held the keys in registers (~6K instructions) took 30.3 µs between
    MLP-sized products against 18.0 for this one (H200, 128K bs1, flat keys; docs/decisions.md).

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
        t_low = _search_low(prefix, bits, need_in, lows)
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
    K_PAD: tl.constexpr, COARSE_PICK: tl.constexpr = True, LOOP_BLOCK: tl.constexpr = 2048,
    COMPACT: tl.constexpr = 256, SCP: tl.constexpr = 128, PDL: tl.constexpr = False,
):
    """Keys of every chunk, then the pair's last program writes its k pages: sink, top-(k-2) ascending, recent."""
    enter_dependent(PDL)
    pair, chunk, num_pages = _program_pages(seq_lens_ptr, num_kv_heads, B)
    out_row = out_ptr + pair.to(tl.int64) * K
    if num_pages > K:
        _chunk_keys(scores_ptr, chunk_max_ptr, chunk_sum_ptr, keys_ptr, hist_ptr, pair, chunk, num_pages,
                    max_pages, num_chunks, num_score_chunks, G, GS, MAXC, RULE, BLOCK, NBINS, LOW_BITS, STEPS, WINDOW, SCP)
        if _last_to_arrive(_count_row(counts_ptr, pair, MAXC) + MAXC, num_chunks):  # the slot counter's int
            hist_row = hist_ptr + pair * (NBINS + _COARSE)
            b1, need_in = _pick_top_bin(hist_row, K - 2, NBINS, COARSE_PICK)
            in_bin = tl.load(hist_row + b1)
            _clear_histogram_row(hist_row, NBINS)
            key_row = keys_ptr + pair.to(tl.int64) * max_pages
            low_scratch = cand_low_ptr + pair.to(tl.int64) * max_pages
            recent = num_pages - 1
            contested = recent - 1
            # Steps of LOOP_BLOCK keys up to a context just past it (32K + decode tokens), twice that beyond:
            # H200 between MLP products, flat keys, 2048 / 4096 keys a step: 11.1 / 13.2 µs at 32K (2047
            # contested pages), 19.4 / 18.0 at 128K (8191).
            if contested <= LOOP_BLOCK + LOOP_BLOCK // 8:
                _select_by_loops(key_row, out_row, low_scratch, recent, b1, need_in, in_bin, LOW_BITS, LOOP_BLOCK, COMPACT)
            else:
                _select_by_loops(key_row, out_row, low_scratch, recent, b1, need_in, in_bin, LOW_BITS, 2 * LOOP_BLOCK, COMPACT)
            tl.store(out_row, 0)
            tl.store(out_row + K - 1, recent)
    elif chunk == 0:
        _dense_row(out_row, num_pages, K, K_PAD)
