"""Group combine + top-(k-2) page selection in ONE launch after the score kernel, parallel up to its last
step (`select_path="merge"`).

Reference: `reference.select.combine_group` (page_mask = `config.scored_pages`) and `select_pages`; keys
and tie rule are chunked.py's (23-bit fixed-point log shares, ties to the lower page id).

`_merge_select_kernel`, grid (S * Hkv, chunks): every program computes the keys of its chunk of contested
pages (at most BLOCK) and finds the chunk's own top-(k-2) by (key descending, page ascending): a search for
the threshold key over the bits in which the chunk's keys differ (8 trial values a pass on small tiles, binary
on large ones: `log_ways`), then the ties in page order.
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

from ..triton_common import cdiv, enter_dependent, next_pow2
from .chunked import (_arrivals, _chunk_keys, _chunk_range, _count_row, _dense_row, _group_normalizer, _last_to_arrive,
                      _page_keys, _pick_bin, _program_pages)

MERGE_WARPS = 8
KEYS_IN_REGISTERS = 1024  # chunks of at most this many pages compute their keys in registers (scores [1024, GS])
KEYS_SUB_BLOCK = 512  # pages per step of the key loop of larger chunks (scores [512, GS] a step, as chunked.py)
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
def _count_min_max(n0, lo0, hi0, n1, lo1, hi1):
    return n0 + n1, tl.minimum(lo0, lo1), tl.maximum(hi0, hi1)


@triton.jit
def _search_top(key, need, prefix, bits):
    """(v, #(key > v)) for the largest v in [prefix, prefix + 2^bits) with #(key >= v) >= need, given one exists
    and no key reaches prefix + 2^bits (lanes without a page hold -1). Each pass resolves 5 bits: one histogram
    of the keys' next digit (keys above the pass's range counted in its top bin) gives the count at or above
    every one of its 32 trial values. A block-wide count is a chain of barriers and shuffles (~300 cycles at
    8 warps) and the histogram a few ballots a key, so 5 passes where a binary search takes 23."""
    low = prefix
    above = 0  # #(key >= low + 2^bits): none at the start
    for _ in range(tl.cdiv(bits, 5)):
        step = tl.minimum(bits, 5)
        bits -= step
        top = (1 << step) - 1
        digit = tl.minimum((key - low) >> bits, top)  # < 0 below low
        counted = digit >= 0
        hist = tl.histogram(tl.where(counted, digit, 0), 32, mask=counted)
        pick, rest = _pick_bin(hist, need, 32)  # digit 0, low itself, always has `need`
        above = tl.where(pick == top, above, need - rest)  # keys past the range sit in the top bin
        low += pick << bits
    return low, above


@triton.jit
def _top_ranks(key, need, KEY_BITS: tl.constexpr):
    """Which lanes of key (>= 0; -1: no page) are among the `need` largest by (key descending, lane
    ascending), each taken lane's rank among them in lane order (0-based), and how many are taken. All valid
    lanes where there are at most `need`."""
    valid = key >= 0
    n_valid, lo, hi = tl.reduce((valid.to(tl.int32), tl.where(valid, key, (1 << KEY_BITS) - 1), key), 0, _count_min_max)
    threshold = 0  # at most `need` pages: every valid key is >= 0, so all are taken below
    ties_wanted = need
    if n_valid > need:
        prefix, bits = _span(lo, hi, KEY_BITS)
        threshold, n_above = _search_top(key, need, prefix, bits)
        ties_wanted = need - n_above
    gt = key > threshold
    tie = key == threshold
    # Both running counts in one scan, packed in 16-bit halves (lanes < 2^16).
    packed = tl.cumsum(gt.to(tl.int32) + (tie.to(tl.int32) << 16), axis=0)
    tie_upto = packed >> 16
    take = gt | (tie & (tie_upto <= ties_wanted))
    return take, (packed & 0xFFFF) + tl.minimum(tie_upto, ties_wanted) - 1, tl.minimum(n_valid, need)


@triton.jit
def _merge_select_kernel(
    scores_ptr, chunk_max_ptr, chunk_sum_ptr, keys_ptr, counts_ptr, cand_key_ptr, cand_page_ptr, seq_lens_ptr, out_ptr,
    num_kv_heads, max_pages, num_chunks, K, num_score_chunks,
    G: tl.constexpr, GS: tl.constexpr, MAXC: tl.constexpr, B: tl.constexpr, RULE: tl.constexpr,
    STEPS: tl.constexpr, SCP: tl.constexpr, SUB: tl.constexpr, BLOCK: tl.constexpr,
    CH_PAD: tl.constexpr, KC: tl.constexpr, K_PAD: tl.constexpr, KEY_BITS: tl.constexpr,
    KEYS_IN_REGS: tl.constexpr = True, PDL: tl.constexpr = False,
):
    """Each chunk's top-(k-2), then the pair's last program writes its k pages: sink, top-(k-2) ascending, recent.
    KEYS_IN_REGS: the chunk's keys are computed in registers from one load of its scores; else SUB pages a
    step, stored and read back. Both write every key to the keys workspace."""
    tl.static_assert(BLOCK < 65536 and CH_PAD * KC < 65536)  # _top_ranks packs counts in 16 bits
    enter_dependent(PDL)
    pair, chunk, num_pages = _program_pages(seq_lens_ptr, num_kv_heads, B)
    # Before the branch on the sequence's length, so that these loads go out with its own.
    has_mass, log_norm, offset = _group_normalizer(chunk_max_ptr, chunk_sum_ptr, pair, num_score_chunks, G, GS, MAXC, RULE, SCP)
    out_row = out_ptr + pair.to(tl.int64) * K
    if num_pages > K:
        need = K - 2
        first, last = _chunk_range(num_pages, chunk, num_chunks)
        page = first + tl.arange(0, BLOCK)
        in_chunk = page < last
        row = pair.to(tl.int64) * max_pages
        if KEYS_IN_REGS:
            g = tl.arange(0, GS)
            sc = tl.load(scores_ptr + (row + page)[:, None] * GS + g[None, :], mask=in_chunk[:, None] & (g < G)[None, :],
                         other=float("-inf"))
            key = tl.where(in_chunk, _page_keys(sc, in_chunk, has_mass, log_norm, offset, RULE, STEPS), -1)
            tl.store(keys_ptr + row + page, key, mask=in_chunk)  # for audits (score_sweep); nothing here reads it
        else:
            _chunk_keys(scores_ptr, keys_ptr, keys_ptr, has_mass, log_norm, offset, pair, chunk, num_pages,
                        max_pages, num_chunks, G, GS, RULE, SUB, 1, 0, STEPS, 1, HISTOGRAM=False)
            tl.debug_barrier()  # each thread reads back keys other threads of this program stored
            key = tl.load(keys_ptr + row + page, mask=in_chunk, other=-1)
        take, rank, listed = _top_ranks(key, need, KEY_BITS)
        tl.store(cand_key_ptr + row + first + rank, key, mask=take)  # rank <= lane: inside the chunk's range
        tl.store(cand_page_ptr + row + first + rank, page, mask=take)
        count_row = _count_row(counts_ptr, pair, MAXC)
        tl.store(count_row + chunk, listed)
        if _last_to_arrive(_arrivals(count_row, MAXC), num_chunks):
            i = tl.arange(0, CH_PAD * KC)
            c = i // KC
            slot = i % KC
            at = _chunk_range(num_pages, c, num_chunks)[0] + slot
            # The lists and their lengths in one round trip: slots past a list's length are masked after.
            inside = (c < num_chunks) & (at < max_pages)
            lengths = tl.load(count_row + c, mask=c < num_chunks, other=0, cache_modifier=".cg")
            cand_key = tl.load(cand_key_ptr + row + at, mask=inside, other=-1, cache_modifier=".cg")
            cand_page = tl.load(cand_page_ptr + row + at, mask=inside, other=0, cache_modifier=".cg")
            cand_key = tl.where(slot < lengths, cand_key, -1)
            # Chunk-major lanes are in page order, so ranks in lane order write the pages ascending.
            picked, out_rank, _ = _top_ranks(cand_key, need, KEY_BITS)  # names of their own: another shape than the chunk's
            tl.store(out_row + 1 + out_rank, cand_page, mask=picked)
            tl.store(out_row, 0)
            tl.store(out_row + K - 1, num_pages - 1)  # the recent page
    elif chunk == 0:
        _dense_row(out_row, num_pages, K, K_PAD)
