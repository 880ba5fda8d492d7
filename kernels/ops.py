"""Public API of the Locks Triton kernels: small typed wrappers that check shapes and launch.

Every op is CUDA-graph safe: grids depend only on tensor shapes, nothing reads device data on the
host, nothing is allocated inside (outputs and scratch come from the caller; use the
`*_workspace` helpers once at start-up). Each kernel's torch reference is named in its module.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton.language as tl

from .build import kernel as _build
from .build.packing import SummaryLayout
from .config import PAGE_SIZE, check_combine_rule
from .decode import kernel as _decode
from .score import cuda as _cuda_score
from .score import pages as _ss
from .score import transposed as _score_t
from .select import chunked as _sel
from .select import merge as _merge
from .triton_common import (
    FP32_EPS,
    RowConstants,
    cdiv,
    check,
    device_index,
    dot_in_fp32,
    next_pow2,
    num_sms,
    row_views,
)

ScoreSelectWorkspace = _ss.ScoreSelectWorkspace
DecodeWorkspace = _decode.DecodeWorkspace
log = logging.getLogger(__name__)
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _check_rows(summary_rows: torch.Tensor, layout: SummaryLayout, num_kv_heads: int) -> None:
    check(
        summary_rows.dtype == torch.uint8 and summary_rows.dim() == 3 and summary_rows.is_contiguous(),
        f"summary_rows must be contiguous uint8 [num_blocks, Hkv, row_bytes]; got {summary_rows.dtype} "
        f"{tuple(summary_rows.shape)}",
    )
    check(
        summary_rows.shape[1:] == (num_kv_heads, layout.row_bytes),
        f"summary_rows {tuple(summary_rows.shape)} does not match Hkv={num_kv_heads} and row_bytes="
        f"{layout.row_bytes} of {layout.fmt} at d={layout.head_dim}; allocate [num_blocks, Hkv, row_bytes]",
    )


def _check_block_ids(block_ids: torch.Tensor) -> None:
    check(block_ids.dtype == torch.int32 and block_ids.dim() == 1, f"block_ids must be int32 [N]; got {block_ids.dtype} {tuple(block_ids.shape)}")


def _check_build(k_cache: torch.Tensor, summary_rows: torch.Tensor, layout: SummaryLayout) -> None:
    check(k_cache.dim() == 4 and k_cache.shape[1] == PAGE_SIZE, f"k_cache must be [NB, {PAGE_SIZE}, Hkv, d]; got {tuple(k_cache.shape)}")
    num_blocks, _, num_kv_heads, head_dim = k_cache.shape
    check(head_dim == layout.head_dim and head_dim % 2 == 0 and head_dim >= 32,
          f"head dim {head_dim} must equal the layout's {layout.head_dim}, be even and >= 32")
    _check_rows(summary_rows, layout, num_kv_heads)
    check(summary_rows.shape[0] >= num_blocks, f"summary_rows has {summary_rows.shape[0]} blocks < k_cache's {num_blocks}")


def _launch_build(k_arg, rows_args, k_like: torch.Tensor, block_ids: torch.Tensor, layout: SummaryLayout, layers: int | None) -> None:
    """One build launch; layers=None: k_arg/rows_args are the tensors, else int64 address tables of `layers` layers."""
    _, _, num_kv_heads, head_dim = k_like.shape
    rc = RowConstants.of(layout)
    items = block_ids.numel() * num_kv_heads
    pages = _build.build_tile(items)  # decode-time builds (few items): one page per program, lowest latency
    _build._build_kernel[(cdiv(items, pages), layers or 1)](
        k_arg, block_ids, *rows_args,
        *k_like.stride(), num_kv_heads, items, rc.row_bytes,
        D=head_dim, DH_PAD=next_pow2(head_dim // 2), DC=min(_build.DIM_CHUNK, next_pow2(head_dim // 2)), P=pages,
        B=PAGE_SIZE, R=rc.rank, BITS=rc.basis_bits,
        COEF_OFF=rc.coef_offset, BASIS_OFF=rc.basis_offset, SCALE_OFF=rc.scales_offset, USED=rc.used_bytes,
        MAX_SWEEPS_C=_build.MAX_SWEEPS, EPS=FP32_EPS, LAYERED=layers is not None,
        K_DTYPE=_TL_DTYPES[k_like.dtype] if layers is not None else None, num_warps=_build.NUM_WARPS,
    )


def build_summaries(
    k_cache: torch.Tensor,
    block_ids: torch.Tensor,
    summary_rows: torch.Tensor,
    layout: SummaryLayout,
) -> None:
    """k_cache [NB, 16, Hkv, d] bf16/fp16/fp32, block_ids int32 [N] (<0 skipped) -> writes summary_rows uint8 [NB, Hkv, row_bytes]."""
    _check_build(k_cache, summary_rows, layout)
    _check_block_ids(block_ids)
    if block_ids.numel():
        _launch_build(k_cache, row_views(summary_rows), k_cache, block_ids, layout, None)


@dataclass(frozen=True)
class LayerTables:
    """Device address tables of L layers' key caches and summary rows, for one build launch over all layers.

    Every layer must have the same shapes, strides and dtypes (one engine's layers do); the tensors are
    kept alive here because the tables hold only their addresses."""

    k_addrs: torch.Tensor  # int64 [L]
    row_addrs: torch.Tensor  # int64 [L]
    k_caches: tuple[torch.Tensor, ...]
    summary_rows: tuple[torch.Tensor, ...]


def layer_tables(k_caches: Sequence[torch.Tensor], summary_rows: Sequence[torch.Tensor], layout: SummaryLayout) -> LayerTables:
    """Checks L (k_cache [NB, 16, Hkv, d], rows uint8 [NB, Hkv, row_bytes]) pairs and builds their address tables."""
    check(len(k_caches) == len(summary_rows) and len(k_caches) > 0,
          f"need one summary tensor per key cache and at least one layer; got {len(k_caches)} / {len(summary_rows)}")
    first = k_caches[0]
    check(first.dtype in _TL_DTYPES, f"key cache dtype {first.dtype} is not one of {sorted(map(str, _TL_DTYPES))}")
    for k, rows in zip(k_caches, summary_rows, strict=True):
        check(k.shape == first.shape and k.stride() == first.stride() and k.dtype == first.dtype and k.device == first.device,
              f"every layer's key cache must match layer 0's {first.dtype} {tuple(first.shape)} strides {first.stride()} "
              f"on {first.device}; got {k.dtype} {tuple(k.shape)} strides {k.stride()} on {k.device}")
        _check_build(k, rows, layout)
        check(rows.device == first.device, f"summary rows on {rows.device}, key caches on {first.device}")
    addrs = [[k.data_ptr() for k in k_caches], [r.data_ptr() for r in summary_rows]]
    table = torch.tensor(addrs, dtype=torch.int64).to(first.device)
    return LayerTables(table[0], table[1], tuple(k_caches), tuple(summary_rows))


def build_summaries_layers(tables: LayerTables, block_ids: torch.Tensor, layout: SummaryLayout) -> None:
    """Like build_summaries for the same block_ids int32 [N] on every layer of `tables`, in one launch."""
    _check_block_ids(block_ids)
    if block_ids.numel():
        k_like = tables.k_caches[0]
        _launch_build(tables.k_addrs, (tables.row_addrs, None, None), k_like, block_ids, layout, len(tables.k_caches))


def score_select_workspace(
    max_num_seqs: int, num_kv_heads: int, max_pages: int, device: torch.device | str, *, group_size: int
) -> ScoreSelectWorkspace:
    """Scratch for score_select: fp32 scores [S*Hkv, max_pages, next_pow2(G)] plus small buffers (4*(G+1) B/page)."""
    pairs = max_num_seqs * num_kv_heads
    slots = next_pow2(group_size)
    return ScoreSelectWorkspace(
        scores=torch.empty((pairs, max_pages, slots), dtype=torch.float32, device=device),
        chunk_max=torch.empty((pairs, _ss.MAX_CHUNKS, slots), dtype=torch.float32, device=device),
        chunk_sum=torch.empty((pairs, _ss.MAX_CHUNKS, slots), dtype=torch.float32, device=device),
        keys=torch.empty((pairs, max_pages), dtype=torch.int32, device=device),
        hist=torch.zeros((pairs, _sel.HIST_ROW), dtype=torch.int32, device=device),  # kept zero between calls
        low_hist=torch.zeros((pairs, 1 << _sel.LOW_BITS), dtype=torch.int32, device=device),  # kept zero between calls
        cand_low=torch.empty((pairs, max_pages), dtype=torch.int32, device=device),
        cand_page=torch.empty((pairs, max_pages), dtype=torch.int32, device=device),
        counts=torch.zeros((pairs, _sel.counts_width(_ss.MAX_CHUNKS)), dtype=torch.int32, device=device),  # see _count_row
    )


def score_select(
    q: torch.Tensor,
    summary_rows: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    selected_pages: torch.Tensor,
    layout: SummaryLayout,
    page_budget: int,
    scale: float,
    combine: str = "share_average",
    num_kv_heads: int | None = None,
    *,
    workspace: ScoreSelectWorkspace,
    tuning: _ss.ScoreTuning = _ss.DEFAULT_TUNING,
) -> None:
    """q [S, Hq, d], rows uint8 [NB, Hkv, row_bytes], block_table int32 [S, maxP], seq_lens int32 [S] -> writes selected_pages int32 [S, Hkv, k] (logical ids ascending, -1 padded)."""
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads = summary_rows.shape[1] if num_kv_heads is None else num_kv_heads
    check_combine_rule(combine)
    check(num_q_heads % num_kv_heads == 0, f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    check(head_dim == layout.head_dim and head_dim >= 32, f"q head dim {head_dim} != layout head dim {layout.head_dim} (or < 32)")
    check(q.stride(-1) == 1, "q must be contiguous in its last dim")
    _check_rows(summary_rows, layout, num_kv_heads)
    group = num_q_heads // num_kv_heads
    check(page_budget >= 2, f"page budget {page_budget} leaves no room for the sink and recent pages; pass k >= 2")
    check(selected_pages.shape == (num_seqs, num_kv_heads, page_budget) and selected_pages.dtype == torch.int32
          and selected_pages.is_contiguous(),
          f"selected_pages must be contiguous int32 [{num_seqs}, {num_kv_heads}, {page_budget}]; got "
          f"{selected_pages.dtype} {tuple(selected_pages.shape)}")
    check(block_table.dtype == torch.int32 and block_table.stride(-1) == 1, "block_table must be int32, contiguous rows")
    check(seq_lens.dtype == torch.int32 and seq_lens.shape == (num_seqs,), f"seq_lens must be int32 [{num_seqs}]")
    ws = workspace
    check(ws.max_pairs >= num_seqs * num_kv_heads and ws.max_pages >= block_table.shape[1]
          and ws.group_slots >= next_pow2(group) and ws.group_slots == next_pow2(ws.group_slots),
          f"workspace (pairs {ws.max_pairs}, pages {ws.max_pages}, group slots {ws.group_slots}) does not fit "
          f"S*Hkv={num_seqs * num_kv_heads}, max_pages={block_table.shape[1]}, G={group} (slots: a power of two >= G); "
          "rebuild it with score_select_workspace(max_num_seqs, Hkv, max_pages, device, group_size=G)")
    chunks = _launch_score(q, summary_rows, block_table, seq_lens, layout, scale, num_kv_heads, ws, tuning)
    _launch_select(ws, seq_lens, selected_pages, group, chunks, combine, page_budget, tuning, table_pages=block_table.shape[1])


_CUDA_DECLINED: set[str] = set()


def _cuda_scorer_serves(q, summary_rows, rc: RowConstants, group: int) -> bool:
    """Whether the CUDA score kernel takes this call; a reason it does not is logged once (Triton runs)."""
    why = _cuda_score.fits(q, summary_rows, rc, group)
    if why is not None and why not in _CUDA_DECLINED:
        _CUDA_DECLINED.add(why)
        log.warning("CUDA score kernel not used: %s; the Triton kernel runs", why)
    return why is None


def prepare_score_kernel(summary_rows: torch.Tensor, layout: SummaryLayout, group: int, tuning: _ss.ScoreTuning) -> None:
    """Compile and load what `tuning`'s score kernel needs before a CUDA graph is captured (NVRTC, for the CUDA
    kernel; a no-op otherwise, Triton compiles on its first eager call)."""
    if tuning.cuda and summary_rows.is_cuda:
        _cuda_score.load_for(summary_rows, RowConstants.of(layout), group)


def transposed_fits(tuning: _ss.ScoreTuning, rc: RowConstants, head_dim: int) -> bool:
    """Whether `tuning` runs the transposed score kernel: asked for, int4 words, and the coefficient
    contraction's K = tile * next_pow2(r) a dot's 16 at least (else the pages kernel runs)."""
    return (tuning.transposed and _ss.word_decode_fits(rc.basis_bits, head_dim, rc.row_bytes, rc.basis_offset)
            and tuning.tile * next_pow2(rc.rank) >= 16)


def score_kernel_name(q, summary_rows, layout: SummaryLayout, group: int, tuning: _ss.ScoreTuning) -> str:
    """The score kernel `_launch_score` runs for this call under `tuning`: "cuda", "transposed" or "pages"."""
    rc = RowConstants.of(layout)
    if tuning.cuda and _cuda_score.fits(q, summary_rows, rc, group) is None:
        return "cuda"
    return "transposed" if transposed_fits(tuning, rc, q.shape[-1]) else "pages"


def score_grid_chunks(pairs: int, table_pages: int, sms: int, programs_per_sm: int, pages_per_step: int,
                      max_chunks: int) -> int:
    """Score programs per (sequence, KV head): every program slot of one wave, at most max_chunks, at least one
    step of pages each."""
    return max(1, min(max_chunks, programs_per_sm * sms // pairs, cdiv(table_pages, pages_per_step)))


def _launch_score(q, summary_rows, block_table, seq_lens, layout, scale, num_kv_heads, ws, tuning=_ss.DEFAULT_TUNING) -> int:
    """Kernel 1 of score_select (arguments already checked); returns the chunk count. The kernel bench times it alone."""
    num_seqs, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    rc = RowConstants.of(layout)
    pairs = num_seqs * num_kv_heads

    def grid_chunks(programs_per_sm: int, pages_per_step: int) -> int:
        return score_grid_chunks(pairs, block_table.shape[1], num_sms(device_index(q)), programs_per_sm,
                                 pages_per_step, tuning.max_chunks)

    if tuning.cuda and _cuda_scorer_serves(q, summary_rows, rc, group):
        chunks = grid_chunks(_cuda_score.PROGRAMS_PER_SM, _cuda_score.TILE_PAGES * _cuda_score.WARPS)
        _cuda_score.launch(q, summary_rows, block_table, seq_lens, ws, rc, scale, num_kv_heads, chunks, _ss.MAX_CHUNKS)
        return chunks
    chunks = grid_chunks(tuning.programs_per_sm, tuning.tile)
    rows_u8, rows_i8, rows_f16 = row_views(summary_rows)
    if transposed_fits(tuning, rc, head_dim):
        _score_t._score_t_kernel[(pairs, chunks)](
            q, rows_u8, rows_i8, rows_f16, block_table, seq_lens, ws.scores, ws.chunk_max, ws.chunk_sum,
            q.stride(0), q.stride(1), block_table.stride(0), num_kv_heads, rc.row_bytes, ws.max_pages, chunks, scale,
            G=group, G_DOT=next_pow2(group), GS=ws.group_slots, MAXC=_ss.MAX_CHUNKS, M=max(16, next_pow2(group)),
            D=head_dim, D_PAD=next_pow2(head_dim), B=PAGE_SIZE, R=rc.rank,
            COEF_OFF=rc.coef_offset, BASIS_OFF=rc.basis_offset, SCALE_OFF=rc.scales_offset,
            P=tuning.tile, RP=next_pow2(rc.rank), FP32=dot_in_fp32(q), SPLIT=q.dtype != torch.float32,
            ROWS32=tuning.narrow_offsets and summary_rows.numel() < 2**31,
            num_warps=tuning.warps, num_stages=tuning.stages, maxnreg=tuning.maxnreg,
        )
        return chunks
    _ss._score_kernel[(pairs, chunks)](
        q, rows_u8, rows_i8, rows_f16, block_table, seq_lens, ws.scores, ws.chunk_max, ws.chunk_sum,
        q.stride(0), q.stride(1), block_table.stride(0), num_kv_heads, rc.row_bytes, ws.max_pages, chunks, scale,
        G=group, G_DOT=next_pow2(group), GS=ws.group_slots, MAXC=_ss.MAX_CHUNKS,
        D=head_dim, D_PAD=next_pow2(head_dim), B=PAGE_SIZE, R=rc.rank, BITS=rc.basis_bits,
        COEF_OFF=rc.coef_offset, BASIS_OFF=rc.basis_offset, SCALE_OFF=rc.scales_offset,
        P=tuning.tile, RP=next_pow2(rc.rank), FP32=(fp32 := dot_in_fp32(q) or rc.basis_bits == 16), STAGES=tuning.stages,
        MANTISSA=tuning.mantissa_nibbles,
        WORDS=tuning.word_nibbles and _ss.word_decode_fits(rc.basis_bits, head_dim, rc.row_bytes, rc.basis_offset),
        COEF_VEC=tuning.coef_vector, COEF_MMA=tuning.coef_mma and rc.rank >= 4 and (fp32 or group >= 8),
        ROWS32=tuning.narrow_offsets and summary_rows.numel() < 2**31,
        num_warps=tuning.warps, maxnreg=tuning.maxnreg,
    )
    return chunks


_MERGE_DECLINED: set[tuple[int, int]] = set()


def _launch_merge_select(ws, seq_lens, selected_pages, group, score_chunks, combine, page_budget,
                         tuning: _ss.ScoreTuning, table_pages: int) -> bool:
    """select/merge.py's one launch; False where its plan declines this budget (said once per (pairs, k))."""
    num_seqs, num_kv_heads, _ = selected_pages.shape
    pairs = num_seqs * num_kv_heads
    plan = _merge.merge_plan(pairs, table_pages, page_budget, num_sms(device_index(seq_lens)), tuning.select_chunks)
    if plan is None:
        if (pairs, page_budget) not in _MERGE_DECLINED:
            _MERGE_DECLINED.add((pairs, page_budget))
            log.warning("merge selection declines k=%d on %d pairs (its candidate tile would pass %d); the chunked "
                        "path runs", page_budget, pairs, _merge.MAX_CANDIDATES)
        return False
    list_slots = next_pow2(max(page_budget - 2, 1))  # a chunk's list in the last program's tile
    _merge._merge_select_kernel[(pairs, plan.chunks)](
        ws.scores, ws.chunk_max, ws.chunk_sum, ws.keys, ws.counts, ws.cand_low, ws.cand_page, seq_lens, selected_pages,
        num_kv_heads, ws.max_pages, plan.chunks, page_budget, score_chunks,
        G=group, GS=ws.group_slots, MAXC=_ss.MAX_CHUNKS, B=PAGE_SIZE, RULE=_sel.COMBINE_CODES[combine],
        STEPS=_sel.KEY_STEPS_PER_UNIT, SCP=next_pow2(score_chunks), SUB=min(_merge.KEYS_SUB_BLOCK, plan.block),
        BLOCK=plan.block, CH_PAD=next_pow2(plan.chunks), KC=list_slots, K_PAD=next_pow2(page_budget),
        KEY_BITS=_merge.KEY_BITS, CHUNK_WAYS=_merge.log_ways(plan.block, _merge.MERGE_WARPS),
        TILE_WAYS=_merge.log_ways(next_pow2(plan.chunks) * list_slots, _merge.MERGE_WARPS),
        num_warps=_merge.MERGE_WARPS,
    )
    return True


def _launch_select(ws, seq_lens, selected_pages, group, score_chunks, combine, page_budget,
                   tuning: _ss.ScoreTuning = _ss.DEFAULT_TUNING, table_pages: int | None = None) -> None:
    """The selection launches of score_select after the score kernel (`tuning.select_path`: one launch,
    select/merge.py, or three, select/chunked.py, which also runs where merge declines; arguments already
    checked). The chunked path runs min(score_chunks, tuning.select_chunks) chunks per pair, the merge path
    `merge.merge_plan`'s. table_pages: the block table's width (default: the workspace's). The kernel bench
    times them alone."""
    if tuning.select_path == "merge" and _launch_merge_select(
            ws, seq_lens, selected_pages, group, score_chunks, combine, page_budget, tuning, table_pages or ws.max_pages):
        return
    num_seqs, num_kv_heads, _ = selected_pages.shape
    pairs = num_seqs * num_kv_heads
    chunks = max(1, min(score_chunks, tuning.select_chunks))
    common = dict(B=PAGE_SIZE, MAXC=_ss.MAX_CHUNKS, NBINS=_sel.HIST_BINS, LOW_BITS=_sel.LOW_BITS)
    sizes = (num_kv_heads, ws.max_pages, chunks, page_budget)
    keys = dict(G=group, GS=ws.group_slots, RULE=_sel.COMBINE_CODES[combine], BLOCK=_sel.KEYS_BLOCK,
                STEPS=_sel.KEY_STEPS_PER_UNIT, WINDOW=_sel.AGG_WINDOW, SCP=next_pow2(score_chunks), **common)
    _sel._keys_kernel[(pairs, chunks)](
        ws.scores, ws.chunk_max, ws.chunk_sum, ws.keys, ws.hist, ws.counts, seq_lens, *sizes, score_chunks,
        num_warps=_sel.KEYS_WARPS, COARSE_PICK=tuning.coarse_pick, **keys,
    )
    _sel._gather_kernel[(pairs, chunks)](
        ws.keys, ws.low_hist, ws.counts, ws.cand_low, ws.cand_page, seq_lens, selected_pages, *sizes,
        B=PAGE_SIZE, MAXC=_ss.MAX_CHUNKS, BLOCK=_sel.KEYS_BLOCK, LOW_BITS=_sel.LOW_BITS, WINDOW=_sel.AGG_WINDOW,
        num_warps=_sel.KEYS_WARPS,
    )
    _sel._resolve_kernel[(pairs, chunks)](
        ws.counts, ws.cand_low, ws.cand_page, seq_lens, selected_pages, *sizes,
        B=PAGE_SIZE, MAXC=_ss.MAX_CHUNKS, BLOCK=_sel.KEYS_BLOCK, K_PAD=next_pow2(page_budget),
        CHUNKS_PAD=next_pow2(chunks), num_warps=_sel.FINAL_WARPS,
    )


def decode_workspace(
    max_num_seqs: int, num_q_heads: int, head_dim: int, device: torch.device | str,
    num_splits: int = _decode.DEFAULT_DECODE.max_splits,
) -> DecodeWorkspace:
    """Split-K partials for sparse_paged_decode: fp32 out [S, Hq, splits, d] and lse [S, Hq, splits]."""
    return DecodeWorkspace(
        partial_out=torch.empty((max_num_seqs, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=device),
        partial_lse=torch.empty((max_num_seqs, num_q_heads, num_splits), dtype=torch.float32, device=device),
    )


def decode_splits(num_seqs: int, num_kv_heads: int, page_budget: int, workspace: DecodeWorkspace, device_idx: int | None,
                  tuning: _decode.DecodeTuning = _decode.DEFAULT_DECODE) -> int:
    """Split count for a batch shape: enough programs for `tuning.waves` per SM, each with >= one iteration's
    pages, at most `tuning.max_splits` (and what the workspace holds)."""
    wanted = cdiv(tuning.waves * num_sms(device_idx), num_seqs * num_kv_heads)
    return max(1, min(workspace.max_splits, tuning.max_splits, wanted, cdiv(page_budget, tuning.pages_per_iter)))


def sparse_paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    selected_pages: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    workspace: DecodeWorkspace,
    *,
    tuning: _decode.DecodeTuning = _decode.DEFAULT_DECODE,
) -> None:
    """q [S, Hq, d], caches [NB, 16, Hkv, d], selected_pages int32 [S, Hkv, k] (logical, -1 skipped) -> writes out [S, Hq, d] (q dtype).

    tuning: the launch shape (`decode.DecodeTuning`); the workspace must hold its splits."""
    num_seqs, num_q_heads, head_dim = q.shape
    check(k_cache.dim() == 4 and k_cache.shape[1] == PAGE_SIZE and k_cache.shape == v_cache.shape,
          f"k_cache/v_cache must both be [NB, {PAGE_SIZE}, Hkv, d]; got {tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    num_kv_heads = k_cache.shape[2]
    check(k_cache.shape[3] == head_dim and num_q_heads % num_kv_heads == 0,
          f"q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)} (head dim, GQA multiple)")
    check(q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "q and caches need a contiguous last dim")
    check(selected_pages.dim() == 3 and selected_pages.shape[:2] == (num_seqs, num_kv_heads)
          and selected_pages.dtype == torch.int32 and selected_pages.is_contiguous(),
          f"selected_pages must be contiguous int32 [{num_seqs}, {num_kv_heads}, k]; got {tuple(selected_pages.shape)}")
    check(out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1, f"out must be {q.dtype} {tuple(q.shape)}")
    check(block_table.dtype == torch.int32 and seq_lens.dtype == torch.int32, "block_table and seq_lens must be int32")
    ws = workspace
    check(ws.partial_out.shape[0] >= num_seqs and ws.partial_out.shape[1] == num_q_heads and ws.partial_out.shape[3] == head_dim,
          f"decode workspace {tuple(ws.partial_out.shape)} does not fit S={num_seqs}, Hq={num_q_heads}, d={head_dim}; "
          "rebuild it with decode_workspace(max_num_seqs, Hq, d, device)")
    splits = _launch_decode(q, k_cache, v_cache, block_table, seq_lens, selected_pages, scale, ws, tuning)
    _launch_merge(ws, out, num_q_heads, splits, tuning)


def _launch_decode(q, k_cache, v_cache, block_table, seq_lens, selected_pages, scale, ws,
                   tuning: _decode.DecodeTuning = _decode.DEFAULT_DECODE) -> int:
    """Kernel 1 of sparse_paged_decode (arguments already checked): each split's partial output and lse over its
    slice of the selected pages; returns the split count. The kernel bench times it alone."""
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    page_budget = selected_pages.shape[2]
    group = num_q_heads // num_kv_heads
    splits = decode_splits(num_seqs, num_kv_heads, page_budget, ws, device_index(q), tuning)
    _decode._sparse_decode_kernel[(num_seqs * num_kv_heads, splits)](
        q, k_cache, v_cache, block_table, seq_lens, selected_pages, ws.partial_out, ws.partial_lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0),
        num_kv_heads, num_q_heads, page_budget, splits, ws.max_splits, scale,
        G=group, G_DOT=next_pow2(group), D=head_dim, D_PAD=next_pow2(head_dim), B=PAGE_SIZE,
        PPI=tuning.pages_per_iter, FP32=dot_in_fp32(k_cache),
        num_warps=tuning.warps, num_stages=tuning.stages,
    )
    return splits


def _launch_merge(ws, out, num_q_heads: int, splits: int,
                  tuning: _decode.DecodeTuning = _decode.DEFAULT_DECODE) -> None:
    """Kernel 2 of sparse_paged_decode: the splits' log-sum-exp merge into out. The kernel bench times it alone."""
    num_seqs, _, head_dim = out.shape
    _decode._merge_kernel[(num_seqs * num_q_heads,)](
        ws.partial_out, ws.partial_lse, out, out.stride(0), out.stride(1), num_q_heads, splits, ws.max_splits,
        D=head_dim, D_PAD=next_pow2(head_dim), SPLIT_PAD=next_pow2(splits), EAGER=tuning.merge_eager,
        num_warps=4,
    )
