"""Decode attention (locks.md §4): paged reference vs a naive loop, dense fallback, and the exact
identity o - o_S = eps (vbar_Sc - vbar_S) with ||o_S - o|| <= 2 R (1 - gamma_S) (locks.md §5)."""

from __future__ import annotations

import math

import pytest
import torch
from locks_toolkit.kernels.decode.reference import attend_pages, paged_decode_reference
from locks_toolkit.kernels.score.bounds import coverage, identity_terms
from locks_toolkit.kernels.score.reference import exact_page_scores
from locks_toolkit.kernels.select.reference import combine_group, select_pages
from locks_toolkit.kernels.testing import gaussian_keys, scrambled_paged_cache

B = 16



def naive_decode(q, keys, values, seq_lens, scale, selected=None):
    """Per-sequence softmax in fp64 with KV heads repeated G times: q [S, Hq, d], keys/values [S, Hkv, T, d]."""
    num_seqs, num_q_heads, _ = q.shape
    group = num_q_heads // keys.shape[1]
    out = torch.zeros(num_seqs, num_q_heads, values.shape[-1], dtype=torch.float64)
    for s in range(num_seqs):
        n = int(seq_lens[s])
        k = keys[s, :, :n].double().repeat_interleave(group, dim=0)  # [Hq, n, d]
        v = values[s, :, :n].double().repeat_interleave(group, dim=0)
        attend = torch.ones(num_q_heads, n, dtype=torch.bool)
        if selected is not None:
            page_of_token = torch.arange(n) // B
            per_kv = torch.stack([torch.isin(page_of_token, row[row >= 0]) for row in selected[s]])
            attend = per_kv.repeat_interleave(group, dim=0)
        logits = torch.einsum("hd,htd->ht", q[s].double(), k) * scale
        weights = torch.softmax(logits.masked_fill(~attend, float("-inf")), dim=-1)
        out[s] = torch.einsum("ht,htd->hd", weights, v.masked_fill(~attend.unsqueeze(-1), 0.0))
    return out


def _random_batch(gen, groups, dim, num_kv_heads=2, seq_lens=(37 * B, 13 * B + 5, 7 * B, 1)):
    seq_lens = torch.tensor(seq_lens)
    max_tokens = int(seq_lens.max())
    num_seqs = len(seq_lens)
    keys = torch.randn((num_seqs, num_kv_heads, max_tokens, dim), generator=gen)
    values = torch.randn((num_seqs, num_kv_heads, max_tokens, dim), generator=gen)
    # garbage past each sequence's end must never be read
    for s, n in enumerate(seq_lens.tolist()):
        keys[s, :, n:] = float("nan")
        values[s, :, n:] = float("nan")
    q = torch.randn((num_seqs, num_kv_heads * groups, dim), generator=gen) * 2
    return q, keys, values, seq_lens


@pytest.mark.parametrize("groups,dim", [(1, 64), (4, 128), (7, 64), (8, 256)])
def test_paged_reference_with_scrambled_block_table_equals_contiguous_attention(gen, groups, dim):
    q, keys, values, seq_lens = _random_batch(gen, groups, dim)
    k_cache, v_cache, block_table = scrambled_paged_cache(gen, keys, values, seq_lens)
    scale = 1 / math.sqrt(dim)
    out, lse = paged_decode_reference(q, k_cache, v_cache, block_table, seq_lens, scale, return_lse=True)
    assert out.shape == q.shape and lse.shape == q.shape[:2]
    assert torch.allclose(out.double(), naive_decode(q, keys, values, seq_lens, scale), atol=1e-5)

    # sparse: a random selection per (sequence, KV head), -1 padded, duplicates harmless
    num_pages = (seq_lens + B - 1) // B
    selected = torch.full((len(seq_lens), keys.shape[1], 6), -1, dtype=torch.int64)
    for s, n in enumerate(num_pages.tolist()):
        for h in range(keys.shape[1]):
            pick = torch.randperm(n, generator=gen)[:5]
            selected[s, h, : len(pick)] = pick
            selected[s, h, -1] = pick[0]
    sparse = paged_decode_reference(q, k_cache, v_cache, block_table, seq_lens, scale, selected_pages=selected)
    assert torch.allclose(sparse.double(), naive_decode(q, keys, values, seq_lens, scale, selected), atol=1e-5)


@pytest.mark.parametrize("groups", [1, 4, 7, 8])
def test_dense_fallback_equals_full_attention(gen, groups):
    dim, k = 128, 8
    q, keys, values, seq_lens = _random_batch(gen, groups, dim, seq_lens=(7 * B, 8 * B, 5 * B + 3))
    k_cache, v_cache, block_table = scrambled_paged_cache(gen, keys, values, seq_lens)
    scale = 1 / math.sqrt(dim)
    num_pages = (seq_lens + B - 1) // B  # all <= k
    scores = torch.randn((len(seq_lens), keys.shape[1], block_table.shape[1]), generator=gen)
    selected = select_pages(scores, num_pages.unsqueeze(-1).expand(-1, keys.shape[1]), k)
    sparse = paged_decode_reference(q, k_cache, v_cache, block_table, seq_lens, scale, selected_pages=selected)
    dense = paged_decode_reference(q, k_cache, v_cache, block_table, seq_lens, scale)
    assert torch.allclose(sparse, dense, atol=1e-6, rtol=0)
    assert torch.allclose(dense.double(), naive_decode(q, keys, values, seq_lens, scale), atol=1e-5)


@pytest.mark.parametrize("groups,dim", [(1, 64), (4, 128), (7, 256), (8, 64)])
def test_exact_identity_and_output_bound(gen, groups, dim):
    pages, k = 37, 6
    keys = gaussian_keys(gen, (3, pages, B, dim), dtype=torch.float64)
    values = torch.randn((3, pages, B, dim), generator=gen, dtype=torch.float64) * 3
    q = torch.randn((3, groups, dim), generator=gen, dtype=torch.float64) * 2
    scale = 1 / math.sqrt(dim)
    exact = exact_page_scores(q, keys, scale)
    # a random (bad) selection and the share-average one: the identity holds for any S
    for selected in (torch.randint(0, pages, (3, k), generator=gen),
                     select_pages(combine_group(exact, "share_average"), pages, k)):
        o, _ = attend_pages(q, keys, values, scale)
        o_sel, _ = attend_pages(q, keys, values, scale, selected_pages=selected)
        terms = identity_terms(q, keys, values, scale, selected)
        assert torch.allclose(o - o_sel, terms.difference, atol=1e-10)
        gamma = coverage(exact, selected)
        assert torch.allclose(1 - gamma, terms.eps, atol=1e-12)
        gap = (o_sel - o).norm(dim=-1)
        assert (gap <= terms.output_error_bound + 1e-10).all()
        assert (terms.output_error_bound > 0).all(), "a sparse selection must leave mass outside S"
