"""Group combine + top-(k-2) page selection in ONE launch after the score kernel, parallel up to its last
step (`select_path="merge"`).

Reference: `reference.select.combine_group` (page_mask = `config.scored_pages`) and `select_pages`; keys
and tie rule are chunked.py's (23-bit fixed-point log shares, ties to the lower page id).

`_merge_select_kernel`, grid (S * Hkv, chunks): every program computes the keys of its chunk of contested
pages (at most BLOCK) and finds the chunk's own top-(k-2) by (key descending, page ascending): a search for
the threshold key over the bits in which the chunk's keys differ (8 trial values a pass on small tiles, binary
on large ones: `log_ways`) that stops at a trial with exactly k-2 keys at or above it, then the ties in page
order.
A page of the pair's top-(k-2) is in its chunk's top-(k-2) (fewer than k-2 pages of the pair come before
it, so fewer of its chunk do), so the chunks' lists hold the answer. Each program writes its list, in page
order, at the head of its chunk's own page range of the candidate buffers (the keys stay as computed) and arrives at the pair's counter; the last program to
arrive (no program waits: the grid needs no co-residency) finds the pair's top-(k-2) among the at most
chunks x (k-2) candidates in registers the same way and writes the row, ascending.

Against chunked.py's three launches this has one launch, no histogram and no atomic but the arrival, and
its serial step is O(chunks * k), not O(pages); against the one-launch path it replaced (a last program that
walked every key: docs/decisions.md) no program passes over every key.
`merge_plan` sizes the chunks: one wave of programs, at least MIN_CHUNK_PAGES pages each, and a candidate
tile of at most MAX_CANDIDATES; where that cannot hold (k very large for the table) the plan is None and the
caller runs the chunked path.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from ..triton_common import cdiv, next_pow2
from .chunked import _arrivals, _chunk_keys, _chunk_range, _count_row, _dense_row, _last_to_arrive, _program_pages

MERGE_WARPS = 8
KEYS_SUB_BLOCK = 512  # pages per step of the key loop (scores [512, GS] a step, as chunked.py)
MAX_BLOCK = 4096  # contested pages of one chunk at most: held in registers (16 keys a thread at 8 warps)
MAX_CANDIDATES = 8192  # the last program's tile, next_pow2(chunks) x next_pow2(k - 2)
MIN_CHUNK_PAGES = 256  # below this many pages a chunk, fewer chunks: the last program's tile shrinks with them
KEY_BITS = 23  # chunked.py's keys: 0 .. 64 * KEY_STEPS_PER_UNIT - 1


@dataclass(frozen=True)
class MergePlan:
    """Launch shape: `chunks` programs per pair, each holding at most `block` contested pages."""

    chunks: int
    block: int


def merge_plan(pairs: int, table_pages: int, page_budget: int, num_sms: int, max_chunks: int) -> MergePlan | None:
    """Chunks for a batch of `pairs` (sequence, KV head) pairs on a block table `table_pages` wide: about one
    wave of programs (at most `max_chunks` a pair), >= MIN_CHUNK_PAGES pages each where the table allows, <=
    MAX_BLOCK; None where the last program's candidate tile would pass MAX_CANDIDATES. (Chunks of at most
    k - 2 pages, all listed, so that only the last program searches, lost: docs/decisions.md.)"""
    contested = max(table_pages - 2, 1)
    chunks = max(1, min(max_chunks, cdiv(num_sms, pairs), cdiv(contested, MIN_CHUNK_PAGES)))
    chunks = max(chunks, cdiv(contested, MAX_BLOCK))
    if next_pow2(chunks) * next_pow2(max(page_budget - 2, 1)) > MAX_CANDIDATES:
        return None
    return MergePlan(chunks=chunks, block=next_pow2(cdiv(contested, chunks)))


@triton.jit
def _span(lo, hi, KEY_BITS: tl.constexpr):
    """(prefix, bits) with [lo, hi] inside [prefix, prefix + 2^bits): bits = 1 + the highest bit where lo
    and hi differ. Flat attention (dummy weights) gives one value: bits = 0."""
    differ = lo ^ hi
    bits = 0
    for j in tl.static_range(KEY_BITS):
        bits += ((differ >> j) != 0).to(tl.int32)
    return hi - (hi & ((1 << bits) - 1)), bits


@triton.jit
def _search_low(prefix, bits, need, key):
    """(v, exact): the largest v with #(key >= v) >= need (lanes without a page hold -1), given v in [prefix,
    prefix + 2^bits), one reduction per bit of the span; or, as soon as a trial has exactly `need` keys at or
    above it, that trial and exact = 1 (the same pages: every key >= v is taken, no tie to break)."""
    low = prefix
    exact = bits * 0
    while (bits > 0) & (exact == 0):
        bits -= 1
        test = low | (1 << bits)
        n = tl.sum((key >= test).to(tl.int32), axis=0)
        if n >= need:
            low = test
        exact = (n == need).to(tl.int32)
    return low, exact


@triton.jit
def _search_top(key, need, prefix, bits, LOG_WAYS: tl.constexpr):
    """`_search_low`'s (v, exact), LOG_WAYS bits a pass: one reduction counts the keys at or above each of the
    pass's 2^LOG_WAYS trial values. A block-wide count is a chain of barriers and shuffles (~300 cycles at 8
    warps), so fewer, wider passes win until the compares outweigh it (`log_ways`)."""
    trial_digit = tl.arange(0, 1 << LOG_WAYS)
    low = prefix
    exact = bits * 0
    while (bits > 0) & (exact == 0):
        step = tl.minimum(bits, LOG_WAYS)
        bits -= step
        trial = low + (trial_digit << bits)  # digit 0 is low itself, which always has `need`
        counts = tl.sum((key[:, None] >= trial[None, :]).to(tl.int32), axis=0)
        fits = (trial_digit < (1 << step)) & (counts >= need)
        low += tl.max(tl.where(fits, trial_digit, 0), axis=0) << bits
        # Counts fall with the digit: the chosen trial has the fewest that fit.
        exact = (tl.min(tl.where(fits, counts, need + 1), axis=0) == need).to(tl.int32)
    return low, exact


def log_ways(lanes: int, warps: int) -> int:
    """Bits a pass of the threshold search over `lanes` keys: 3 (8 trials a pass) where a thread holds at most
    4 keys; else 0, the binary search (`_search_low`). Trials cost registers for the whole kernel: 4 trials
    on 4096 lanes took it from 109 to 172 and the 1M bs4 selection from 30 to 48 µs on the H100 (two programs
    per SM became one), while 8 trials on small tiles took 1 µs off at 16K-32K bs1."""
    return 3 if lanes <= 4 * 32 * warps else 0


@triton.jit
def _count_and_range(n_a, lo_a, hi_a, n_b, lo_b, hi_b):
    return n_a + n_b, tl.minimum(lo_a, lo_b), tl.maximum(hi_a, hi_b)


@triton.jit
def _top_ranks(key, need, KEY_BITS: tl.constexpr, LOG_WAYS: tl.constexpr):
    """Which lanes of key (>= 0; -1: no page) are among the `need` largest by (key descending, lane
    ascending), and each taken lane's rank among them in lane order (0-based). All valid lanes where there
    are at most `need`."""
    valid = key >= 0
    # One block-wide reduction for the count and the range: each is a chain of barriers.
    n_valid, lo, hi = tl.reduce((valid.to(tl.int32), tl.where(valid, key, (1 << KEY_BITS) - 1), key), 0,
                                _count_and_range)
    threshold = 0  # at most `need` pages: every valid key is >= 0, so all are taken below
    # Ties wanted at the threshold; `need` takes them all, right where every key at or above it is taken.
    ties_wanted = need
    if n_valid > need:
        prefix, bits = _span(lo, hi, KEY_BITS)
        if LOG_WAYS == 0:
            threshold, exact = _search_low(prefix, bits, need, key)
        else:
            threshold, exact = _search_top(key, need, prefix, bits, LOG_WAYS)
        if (exact == 0) & (threshold < hi):  # at hi (flat keys among them) no key is above it
            ties_wanted = need - tl.sum((key > threshold).to(tl.int32), axis=0)
    gt = key > threshold
    tie = key == threshold
    # Both running counts in one scan, packed in 16-bit halves (lanes < 2^16).
    packed = tl.cumsum(gt.to(tl.int32) + (tie.to(tl.int32) << 16), axis=0)
    tie_upto = packed >> 16
    take = gt | (tie & (tie_upto <= ties_wanted))
    return take, (packed & 0xFFFF) + tl.minimum(tie_upto, ties_wanted) - 1


@triton.jit
def _merge_select_kernel(
    scores_ptr, chunk_max_ptr, chunk_sum_ptr, keys_ptr, counts_ptr, cand_key_ptr, cand_page_ptr, seq_lens_ptr, out_ptr,
    num_kv_heads, max_pages, num_chunks, K, num_score_chunks,
    G: tl.constexpr, GS: tl.constexpr, MAXC: tl.constexpr, B: tl.constexpr, RULE: tl.constexpr,
    STEPS: tl.constexpr, SCP: tl.constexpr, SUB: tl.constexpr, BLOCK: tl.constexpr,
    CH_PAD: tl.constexpr, KC: tl.constexpr, K_PAD: tl.constexpr, KEY_BITS: tl.constexpr,
    CHUNK_WAYS: tl.constexpr = 0, TILE_WAYS: tl.constexpr = 0,
):
    """Each chunk's top-(k-2), then the pair's last program writes its k pages: sink, top-(k-2) ascending, recent."""
    tl.static_assert(BLOCK < 65536 and CH_PAD * KC < 65536)  # _top_ranks packs two counts in 16 bits each
    pair, chunk, num_pages = _program_pages(seq_lens_ptr, num_kv_heads, B)
    out_row = out_ptr + pair.to(tl.int64) * K
    if num_pages > K:
        need = K - 2
        key_row = keys_ptr + pair.to(tl.int64) * max_pages
        cand_key_row = cand_key_ptr + pair.to(tl.int64) * max_pages
        cand_page_row = cand_page_ptr + pair.to(tl.int64) * max_pages
        _chunk_keys(scores_ptr, chunk_max_ptr, chunk_sum_ptr, keys_ptr, keys_ptr, pair, chunk, num_pages,
                    max_pages, num_chunks, num_score_chunks, G, GS, MAXC, RULE, SUB, 1, 0, STEPS, 1, SCP,
                    HISTOGRAM=False)
        tl.debug_barrier()  # each thread reads back keys other threads of this program stored
        first, last = _chunk_range(num_pages, chunk, num_chunks)
        page = first + tl.arange(0, BLOCK)
        key = tl.load(key_row + page, mask=page < last, other=-1)
        take, rank = _top_ranks(key, need, KEY_BITS, CHUNK_WAYS)
        tl.store(cand_key_row + first + rank, key, mask=take)  # rank <= lane: inside the chunk's range
        tl.store(cand_page_row + first + rank, page, mask=take)
        count_row = _count_row(counts_ptr, pair, MAXC)
        tl.store(count_row + chunk, tl.sum(take.to(tl.int32), axis=0))
        if _last_to_arrive(_arrivals(count_row, MAXC), num_chunks):
            i = tl.arange(0, CH_PAD * KC)
            c = i // KC
            slot = i % KC
            in_tile = c < num_chunks
            listed = tl.load(count_row + c, mask=in_tile, other=0, cache_modifier=".cg")
            at = _chunk_range(num_pages, c, num_chunks)[0] + slot
            # The lists load beside their lengths (one round trip, not two), from anywhere in the pair's row;
            # the lengths then mask the slots past each list (stale, or the next chunk's).
            in_row = in_tile & (at < num_pages)
            cand_key = tl.load(cand_key_row + at, mask=in_row, other=-1, cache_modifier=".cg")
            cand_page = tl.load(cand_page_row + at, mask=in_row, other=0, cache_modifier=".cg")
            cand_key = tl.where(slot < listed, cand_key, -1)
            # Chunk-major lanes are in page order, so ranks in lane order write the pages ascending.
            picked, out_rank = _top_ranks(cand_key, need, KEY_BITS, TILE_WAYS)  # names of their own: another shape than the chunk's
            tl.store(out_row + 1 + out_rank, cand_page, mask=picked)
            tl.store(out_row, 0)
            tl.store(out_row + K - 1, num_pages - 1)  # the recent page
    elif chunk == 0:
        _dense_row(out_row, num_pages, K, K_PAD)
