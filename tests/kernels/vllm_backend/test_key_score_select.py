"""The key-reading scorers' batched selection (oracle, quest, centroid; what CUDA runs) against the
row-by-row reference: the same pages for every row, on fresh random caches, odd lengths, padding rows
and short rows. On a GPU the dispatch itself is checked too."""

from __future__ import annotations

import pytest
import torch
from locks_toolkit.kernels.config import PAGE_SIZE
from locks_toolkit.kernels.score.selectors import make_scorer
from locks_toolkit.kernels.vllm_backend import kernel_ops
from locks_toolkit.kernels.vllm_backend.kernel_ops import _select_each_row, key_score_select, key_score_select_batched


def _row_by_row(scorer_name, q, k_cache, block_table, seq_lens, selected, k, scale, combine, num_kv_heads):
    scorer = make_scorer(scorer_name)

    def key_scores(row, blocks, grouped_q):
        return scorer.scores(scorer.prepare(k_cache[blocks].permute(2, 0, 1, 3)), grouped_q, scale)

    _select_each_row(q, block_table, seq_lens, selected, k, combine, num_kv_heads, key_scores)


def _case(seed: int, dtype: torch.dtype, num_kv_heads: int, group: int, head_dim: int = 32):
    gen = torch.Generator().manual_seed(seed)
    lengths = [0, 1, 17, 16 * 5, 16 * 9 + 3, 16 * 23 + 11, 7, 16 * 31 + 15]  # padding row, one page, <= k, > k
    width = -(-max(lengths) // PAGE_SIZE) + 3
    num_blocks = sum(-(-n // PAGE_SIZE) for n in lengths) + 4
    k_cache = torch.randn(num_blocks, PAGE_SIZE, num_kv_heads, head_dim, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.randint(-1, num_blocks, (len(lengths), width), generator=gen, dtype=torch.int32)  # junk past pages
    used = 0
    for row, n in enumerate(lengths):
        pages = -(-n // PAGE_SIZE)
        table[row, :pages] = perm[used : used + pages].to(torch.int32)
        used += pages
    q = torch.randn(len(lengths), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    return q, k_cache, table, torch.tensor(lengths, dtype=torch.int32)


@pytest.mark.parametrize("scorer", ["oracle", "quest", "centroid"])
@pytest.mark.parametrize("combine", ["share_average", "group_max", "group_mass"])
@pytest.mark.parametrize("num_kv_heads, group", [(1, 4), (2, 3)])
def test_batched_key_selection_equals_the_row_by_row_reference(scorer, combine, num_kv_heads, group, monkeypatch):
    q, k_cache, table, lengths = _case(seed=hash((scorer, combine, group)) % 1000, dtype=torch.float32,
                                       num_kv_heads=num_kv_heads, group=group)  # fmt: skip
    k, scale = 6, 32**-0.5
    want = torch.zeros(len(lengths), num_kv_heads, k, dtype=torch.int32)
    _row_by_row(scorer, q, k_cache, table, lengths, want, k, scale, combine, num_kv_heads)
    # a chunk budget of about two rows' keys: several chunks, each padded to its own longest row
    monkeypatch.setattr(kernel_ops, "_KEY_SCORE_CHUNK_BYTES", 2 * 32 * PAGE_SIZE * 32 * 4 * num_kv_heads)
    got = torch.full_like(want, 7)
    key_score_select_batched(scorer, q, k_cache, table, lengths, got, k, scale, combine, num_kv_heads)
    assert torch.equal(got, want)
    on_cpu = torch.full_like(want, 7)  # the CPU dispatch: row by row
    key_score_select(scorer, q, k_cache, table, lengths, on_cpu, k, scale, combine, num_kv_heads)
    assert torch.equal(on_cpu, want)
    assert (got[0] == -1).all() and (got[-1] >= 0).all()  # the padding row selects nothing; a long row k pages


def test_batched_key_selection_reads_bf16_caches_like_the_reference():
    q, k_cache, table, lengths = _case(seed=5, dtype=torch.bfloat16, num_kv_heads=1, group=4, head_dim=64)
    want = torch.zeros(len(lengths), 1, 4, dtype=torch.int32)
    got = torch.zeros_like(want)
    _row_by_row("quest", q, k_cache, table, lengths, want, 4, 0.125, "share_average", 1)
    key_score_select_batched("quest", q, k_cache, table, lengths, got, 4, 0.125, "share_average", 1)
    assert torch.equal(got, want)


@pytest.mark.parametrize("slack", [0, 16 * 40])
def test_host_lengths_cut_the_chunks_without_changing_the_pages(slack, monkeypatch):
    """Chunks cut by the host's lengths (exact, or an upper bound past the block table) select what the device's
    lengths select; a row the host counts but the device holds empty (a padding row) selects nothing."""
    q, k_cache, table, lengths = _case(seed=11 + slack, dtype=torch.float32, num_kv_heads=2, group=3)
    want = torch.zeros(len(lengths), 2, 5, dtype=torch.int32)
    _row_by_row("centroid", q, k_cache, table, lengths, want, 5, 0.2, "group_max", 2)
    monkeypatch.setattr(kernel_ops, "_KEY_SCORE_CHUNK_BYTES", 3 * 32 * PAGE_SIZE * 32 * 4 * 2)
    host = [n + slack for n in lengths.tolist()]
    got = torch.full_like(want, 7)
    key_score_select_batched("centroid", q, k_cache, table, lengths, got, 5, 0.2, "group_max", 2, host_lens=host)
    assert torch.equal(got, want)
    assert host[0] == slack and (got[0] == -1).all()  # the padding row, live by the host's count when slack > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA dispatch needs a GPU; the batched path is checked above")
def test_on_cuda_the_dispatch_runs_the_batched_path_with_the_reference_pages():
    q, k_cache, table, lengths = _case(seed=9, dtype=torch.float32, num_kv_heads=2, group=3)
    want = torch.zeros(len(lengths), 2, 5, dtype=torch.int32)
    _row_by_row("oracle", q, k_cache, table, lengths, want, 5, 0.2, "share_average", 2)
    got = torch.zeros_like(want).cuda()
    key_score_select("oracle", q.cuda(), k_cache.cuda(), table.cuda(), lengths.cuda(), got, 5, 0.2, "share_average", 2)
    assert torch.equal(got.cpu(), want)
