"""Decode attention over selected pages (locks.md §4): paged (vLLM cache + block table) and non-paged.

Softmax is renormalized over the attended tokens; accumulation is fp32 (fp64 when q is fp64).
"""

from __future__ import annotations

import torch

from ..score.reference import accumulate_dtype, token_mask


def _softmax_attend(logits: torch.Tensor, valid: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits/valid [..., T], values [..., T, dv] -> (out [..., dv], lse [...]); no valid token -> 0, -inf."""
    logits = logits.masked_fill(~valid, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    weights = torch.exp(logits - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).unsqueeze(-1))
    return (weights.unsqueeze(-2) @ values).squeeze(-2), lse


def selected_page_mask(selected_pages: torch.Tensor, num_pages: int) -> torch.Tensor:
    """int [..., k] logical ids (-1 ignored, duplicates harmless) -> bool [..., num_pages]."""
    valid = (selected_pages >= 0) & (selected_pages < num_pages)
    index = torch.where(valid, selected_pages, torch.zeros_like(selected_pages)).long()
    counts = torch.zeros(*selected_pages.shape[:-1], num_pages, dtype=torch.int64, device=selected_pages.device)
    counts.scatter_add_(-1, index, valid.long())
    return counts > 0


def attend_pages(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    selected_pages: torch.Tensor | None = None,
    token_counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-paged helper. q [..., G, d], keys [..., P, B, d], values [..., P, B, dv] ->
    (out [..., G, dv], lse [..., G]); selected_pages [..., k] (-1 ignored) is shared by the G heads,
    None attends every page; token_counts [..., P] marks partially filled pages.
    """
    dtype = accumulate_dtype(q)
    num_pages, page_size = keys.shape[-3], keys.shape[-2]
    logits = torch.einsum("...gd,...pbd->...gpb", q.to(dtype), keys.to(dtype)) * scale
    valid = torch.ones(keys.shape[:-1], dtype=torch.bool, device=keys.device)  # [..., P, B]
    if token_counts is not None:
        valid = valid & token_mask(torch.as_tensor(token_counts, device=keys.device), page_size)
    if selected_pages is not None:
        valid = valid & selected_page_mask(selected_pages, num_pages).unsqueeze(-1)
    # Slots that are not attended may hold anything (stale blocks): never let them reach the output.
    values = values.to(dtype).masked_fill(~valid.unsqueeze(-1), 0.0)
    flat_values = values.flatten(-3, -2).unsqueeze(-3)  # [..., 1, P*B, dv]
    valid = valid.unsqueeze(-3).expand(logits.shape).flatten(-2)
    return _softmax_attend(logits.flatten(-2), valid, flat_values)


def paged_decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    selected_pages: torch.Tensor | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """q [S, Hq, d], k_cache/v_cache [NB, B, Hkv, d(v)], block_table int [S, maxP], seq_lens int [S]
    -> out [S, Hq, dv] (and lse [S, Hq] with return_lse); fp32 (fp64 for fp64 q).

    selected_pages int [S, Hkv, k] holds logical page ids (-1 ignored) shared by the G = Hq / Hkv
    query heads of a KV head (query head h reads KV head h // G); None attends every page (dense).
    Block-table entries past a sequence's last page are never read.
    """
    num_seqs, num_q_heads, _ = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    group = num_q_heads // num_kv_heads
    max_pages = block_table.shape[1]
    seq_lens = seq_lens.to(torch.int64)
    if (seq_lens > max_pages * page_size).any():
        raise ValueError(f"a seq_len exceeds the block table ({max_pages} pages of {page_size}); widen block_table")
    pages_used = (seq_lens + page_size - 1) // page_size  # [S]
    page_ids = torch.arange(max_pages, device=q.device)
    live_page = page_ids < pages_used.unsqueeze(-1)  # [S, maxP]
    blocks = torch.where(live_page, block_table.long(), torch.zeros_like(block_table, dtype=torch.int64))

    # Gather [S, maxP, B, Hkv, d] -> [S, Hkv, maxP, B, d] so the non-paged helper does the math.
    keys = k_cache[blocks].permute(0, 3, 1, 2, 4)
    values = v_cache[blocks].permute(0, 3, 1, 2, 4)
    token_counts = (seq_lens.unsqueeze(-1) - page_ids * page_size).clamp(0, page_size)  # [S, maxP]
    grouped_q = q.reshape(num_seqs, num_kv_heads, group, -1)
    out, lse = attend_pages(
        grouped_q, keys, values, scale, selected_pages=selected_pages, token_counts=token_counts.unsqueeze(1)
    )
    out = out.reshape(num_seqs, num_q_heads, -1)
    lse = lse.reshape(num_seqs, num_q_heads)
    return (out, lse) if return_lse else out
