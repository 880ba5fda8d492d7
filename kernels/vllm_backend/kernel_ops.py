"""One indirection to the Locks kernels, chosen once per device (never per call).

CUDA -> `kernels.triton.ops` (graph safe, caller-preallocated outputs); anything else -> the pure
torch reference behind the same signatures, so the CPU engine runs the backend's exact call
sequence. Key-reading scorers (oracle, quest, centroid) always go through the reference scorers,
batched over rows (eager only; they exist for same-engine quality comparisons, not for speed).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from ..build.packing import SummaryLayout, pack_summaries, unpack_summaries
from ..build.reference import build_page_summaries
from ..config import PAGE_SIZE, SCORER_KERNELS, SELECT_CHOICES, scored_pages, select_path_for
from ..decode.reference import paged_decode_reference
from ..score.reference import summary_page_scores
from ..score.selectors import make_scorer
from ..select.reference import combine_group, select_pages


@dataclass(frozen=True)
class DecodeShape:
    """Static sizes that workspaces are allocated for (once, before any CUDA-graph capture)."""

    max_seqs: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    max_pages: int  # block-table width
    page_budget: int


class KernelOps(Protocol):
    name: str

    def workspace(self, shape: DecodeShape, layout: SummaryLayout, device: torch.device) -> Any:
        """Scratch for score_select + sparse_paged_decode, reused by every layer of a group."""

    def build_summaries(self, k_cache: torch.Tensor, block_ids: torch.Tensor, summary_rows: torch.Tensor, layout: SummaryLayout) -> None:
        """k_cache [NB, 16, Hkv, d], block_ids int32 [N] (<0 skipped) -> summary_rows uint8 [NB, Hkv, row_bytes] rows written."""

    def prepare(self, summary_rows: torch.Tensor, layout: SummaryLayout, group: int) -> None:
        """Once per rows allocation, before graph capture: load what the score kernel needs."""

    def layer_tables(self, k_caches, summary_rows, layout: SummaryLayout) -> Any:
        """What build_summaries_layers needs to reach L layers' caches and rows (built once, reused)."""

    def build_summaries_layers(self, tables, block_ids: torch.Tensor, layout: SummaryLayout) -> None:
        """build_summaries of the same block_ids on every layer of `tables`."""

    def score_select(self, q, summary_rows, block_table, seq_lens, selected_pages, layout, page_budget, scale, combine, num_kv_heads, workspace) -> None:
        """q [S, Hq, d] -> selected_pages int32 [S, Hkv, k] (logical page ids, -1 pad)."""

    def sparse_paged_decode(self, q, k_cache, v_cache, block_table, seq_lens, selected_pages, scale, out, workspace) -> None:
        """q [S, Hq, d] -> out [S, Hq, d]: attention over the selected pages only."""


def _page_candidates(seq_len: int) -> tuple[int, torch.Tensor]:
    """(pages holding tokens, mask of the scored pages: every page before the recent one) for one sequence."""
    num_pages = -(-seq_len // PAGE_SIZE)
    return num_pages, torch.arange(num_pages) < scored_pages(seq_len)


class ReferenceOps:
    """The reference behind the kernel signatures (host loops; CPU tests and eager checks)."""

    name = "reference"

    def workspace(self, shape: DecodeShape, layout: SummaryLayout, device: torch.device) -> None:
        return None

    def prepare(self, summary_rows, layout, group: int) -> None:
        return None

    def build_summaries(self, k_cache, block_ids, summary_rows, layout) -> None:
        ids = block_ids[block_ids >= 0].long()
        if ids.numel() == 0:
            return
        keys = k_cache[ids].permute(0, 2, 1, 3).unsqueeze(2)  # [N, Hkv, 1, 16, d]
        packed = pack_summaries(build_page_summaries(keys, layout.rank), layout.fmt)  # [N, Hkv, 1, row]
        summary_rows[ids] = packed[:, :, 0].to(summary_rows.device)

    def layer_tables(self, k_caches, summary_rows, layout) -> tuple:
        return tuple(zip(k_caches, summary_rows, strict=True))

    def build_summaries_layers(self, tables, block_ids, layout) -> None:
        for k_cache, rows in tables:
            self.build_summaries(k_cache, block_ids, rows, layout)

    def score_select(self, q, summary_rows, block_table, seq_lens, selected_pages, layout, page_budget, scale, combine, num_kv_heads, workspace=None) -> None:
        def summary_scores(row: int, blocks: torch.Tensor, grouped_q: torch.Tensor) -> torch.Tensor:
            summaries = unpack_summaries(summary_rows[blocks].transpose(0, 1), layout)  # [Hkv, P, ...]
            return summary_page_scores(grouped_q, summaries, scale)

        _select_each_row(q, block_table, seq_lens, selected_pages, page_budget, combine, num_kv_heads, summary_scores)

    def sparse_paged_decode(self, q, k_cache, v_cache, block_table, seq_lens, selected_pages, scale, out, workspace=None) -> None:
        result = paged_decode_reference(q, k_cache, v_cache, block_table, seq_lens, scale, selected_pages.long())
        out.copy_(result.to(out.dtype))


def _select_each_row(q, block_table, seq_lens, selected_pages, page_budget, combine, num_kv_heads, row_scores) -> None:
    """Per sequence: scores [Hkv, G, P] from row_scores -> combine over G -> select -> selected_pages."""
    num_seqs, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    selected_pages.fill_(-1)
    for row, seq_len in enumerate(seq_lens[:num_seqs].tolist()):
        if seq_len <= 0:  # CUDA-graph padding rows
            continue
        num_pages, scored = _page_candidates(seq_len)
        blocks = block_table[row, :num_pages].long()
        grouped_q = q[row].reshape(num_kv_heads, group, head_dim).float()
        scores = row_scores(row, blocks, grouped_q)  # [Hkv, G, P]
        mask = scored.to(scores.device).expand(num_kv_heads, num_pages)
        chosen = select_pages(combine_group(scores, combine, mask), num_pages, page_budget)
        selected_pages[row] = chosen.to(selected_pages.dtype)


# Scratch one chunk of rows may take while key-reading scorers score their pages (fp32 keys + products).
_KEY_SCORE_CHUNK_BYTES = 1 << 30


def key_score_select(scorer_name, q, k_cache, block_table, seq_lens, selected_pages, page_budget, scale, combine,
                     num_kv_heads, host_lens=None) -> None:  # fmt: skip
    """Same contract as score_select, scoring pages from the keys (oracle, quest, centroid).

    On CUDA the rows go in chunks (`key_score_select_batched`): row by row, a batch of hundreds of rows
    is bound by a dozen launches per row and layer. On the CPU row by row was the faster of the two in a
    side-by-side run (each row's keys stay in cache; the chunks' padded intermediates do not).
    `host_lens`: the rows' lengths as the host knows them (an upper bound of seq_lens), so that chunking
    them does not wait for the device.
    """
    if k_cache.is_cuda:
        key_score_select_batched(scorer_name, q, k_cache, block_table, seq_lens, selected_pages, page_budget, scale,
                                 combine, num_kv_heads, host_lens)  # fmt: skip
        return
    scorer = make_scorer(scorer_name)

    def key_scores(row: int, blocks: torch.Tensor, grouped_q: torch.Tensor) -> torch.Tensor:
        keys = k_cache[blocks].permute(2, 0, 1, 3)  # [Hkv, P, 16, d]
        return scorer.scores(scorer.prepare(keys), grouped_q, scale)

    _select_each_row(q, block_table, seq_lens, selected_pages, page_budget, combine, num_kv_heads, key_scores)


def key_score_select_batched(scorer_name, q, k_cache, block_table, seq_lens, selected_pages, page_budget, scale, combine,
                             num_kv_heads, host_lens=None) -> None:  # fmt: skip
    """key_score_select in chunks of rows: one gather, score, combine and select per chunk, padded to the
    chunk's longest table and masked, so each row gets the pages `_select_each_row` gives it.

    The chunks are cut by `host_lens` when given (an upper bound of each row's length: a longer chunk only pads
    more), else by seq_lens read back from the device; the masks always come from the device's seq_lens."""
    scorer = make_scorer(scorer_name)
    num_seqs, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    selected_pages.fill_(-1)
    lengths = [int(n) for n in host_lens[:num_seqs]] if host_lens is not None else seq_lens[:num_seqs].tolist()
    live = [row for row, n in enumerate(lengths) if n > 0]  # seq_len 0: CUDA-graph padding rows
    # fp32 keys of a page, and quest's [G, P, d] products, per KV head
    page_bytes = PAGE_SIZE * head_dim * 4 * num_kv_heads + group * head_dim * 4 * num_kv_heads
    start = 0
    while start < len(live):
        longest = -(-lengths[live[start]] // PAGE_SIZE)
        end = start + 1
        while end < len(live):
            pages = max(longest, -(-lengths[live[end]] // PAGE_SIZE))
            if (end - start + 1) * pages * page_bytes > _KEY_SCORE_CHUNK_BYTES:
                break
            longest, end = pages, end + 1
        rows = torch.tensor(live[start:end], device=q.device)
        lens = seq_lens[rows].long()
        num_pages = (lens + PAGE_SIZE - 1) // PAGE_SIZE  # [R]
        longest = min(longest, block_table.shape[1])  # a host bound past the table: the table's pages are all
        blocks = block_table[rows, :longest].long().clamp_min(0)  # past a row's pages: any block, masked below
        keys = k_cache[blocks].permute(0, 3, 1, 2, 4)  # [R, Hkv, P, 16, d]
        grouped_q = q[rows].reshape(len(rows), num_kv_heads, group, head_dim).float()
        scores = scorer.scores(scorer.prepare(keys), grouped_q, scale)  # [R, Hkv, G, P]
        scored = torch.clamp_min(lens - 1, 0) // PAGE_SIZE  # config.scored_pages, per row
        mask = (torch.arange(longest, device=q.device) < scored[:, None]).unsqueeze(1).expand(-1, num_kv_heads, -1)
        # a row the host bound counted but the device holds empty (no pages) selects nothing
        pages = num_pages.clamp(1, longest)[:, None].expand(-1, num_kv_heads)
        chosen = select_pages(combine_group(scores, combine, mask), pages, page_budget, checked=False)
        chosen = chosen.masked_fill((num_pages == 0)[:, None, None], -1)
        selected_pages[rows] = chosen.to(selected_pages.dtype)
        start = end


class TritonOps:
    """The Triton kernels (CUDA); imported lazily so CPU machines never import them."""

    name = "triton"

    def __init__(self, select: str = SELECT_CHOICES[0], scorer_kernel: str = SCORER_KERNELS[0]) -> None:
        from .. import ops  # noqa: PLC0415 - CUDA only
        from ..score.pages import DEFAULT_TUNING  # noqa: PLC0415
        from ..score.pages import SCORER_KERNELS as TUNING_OF  # noqa: PLC0415 - name -> ScoreTuning fields

        self._ops = ops
        # the launches' tuning: one selection path and scorer for every block-table width the engine has
        self.tuning = replace(DEFAULT_TUNING, select_path=select_path_for(select), **TUNING_OF[scorer_kernel])

    def workspace(self, shape: DecodeShape, layout: SummaryLayout, device: torch.device) -> Any:
        group = shape.num_q_heads // shape.num_kv_heads
        score_ws = self._ops.score_select_workspace(shape.max_seqs, shape.num_kv_heads, shape.max_pages, device, group_size=group)
        decode_ws = self._ops.decode_workspace(shape.max_seqs, shape.num_q_heads, shape.head_dim, device)
        return score_ws, decode_ws

    def build_summaries(self, k_cache, block_ids, summary_rows, layout) -> None:
        self._ops.build_summaries(k_cache, block_ids, summary_rows, layout)

    def prepare(self, summary_rows, layout, group: int) -> None:
        """Before graph capture: load what the score kernel needs (the CUDA kernel's NVRTC compile)."""
        self._ops.prepare_score_kernel(summary_rows, layout, group, self.tuning)

    def layer_tables(self, k_caches, summary_rows, layout) -> Any:
        return self._ops.layer_tables(k_caches, summary_rows, layout)

    def build_summaries_layers(self, tables, block_ids, layout) -> None:
        self._ops.build_summaries_layers(tables, block_ids, layout)

    def score_select(self, q, summary_rows, block_table, seq_lens, selected_pages, layout, page_budget, scale, combine, num_kv_heads, workspace) -> None:
        self._ops.score_select(
            q, summary_rows, block_table, seq_lens, selected_pages, layout, page_budget, scale, combine, num_kv_heads,
            workspace=workspace[0], tuning=self.tuning,
        )

    def sparse_paged_decode(self, q, k_cache, v_cache, block_table, seq_lens, selected_pages, scale, out, workspace) -> None:
        self._ops.sparse_paged_decode(q, k_cache, v_cache, block_table, seq_lens, selected_pages, scale, out, workspace[1])


def ops_for_device(device: torch.device | str, select: str = SELECT_CHOICES[0],
                   scorer_kernel: str = SCORER_KERNELS[0]) -> KernelOps:
    """Triton on CUDA (selection kernels `select`, the score kernel's code path `scorer_kernel`), the reference
    elsewhere."""
    return TritonOps(select, scorer_kernel) if torch.device(device).type == "cuda" else ReferenceOps()


def timed_host_ms(fn, *args) -> float:
    """Run fn(*args) and return host wall time in ms (used where the op is synchronous: CPU)."""
    start = time.perf_counter()
    fn(*args)
    return (time.perf_counter() - start) * 1e3
