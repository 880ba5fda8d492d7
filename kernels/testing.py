"""Random inputs for tests of the reference and of the kernels checked against it.

Fresh seeds every run (set LOCKS_TEST_SEED to replay one); generators are explicit so a failing
case is reproducible from the printed seed.
"""

from __future__ import annotations

import os

import torch

from .config import PAGE_SIZE, SummaryFormat, cdiv

SEED_ENV = "LOCKS_TEST_SEED"


def fresh_seed() -> int:
    """A new seed from os.urandom, or LOCKS_TEST_SEED when set (to replay a failure)."""
    replay = os.environ.get(SEED_ENV)
    return int(replay) if replay else int.from_bytes(os.urandom(4), "little")


def generator(seed: int, device: str | torch.device = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def gaussian_keys(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """shape [..., P, B, d]: i.i.d. N(0, 1) keys plus a shared random offset per leading index
    (real keys are far from zero-mean)."""
    keys = torch.randn(shape, generator=gen, dtype=dtype)
    offset = 2 * torch.randn((*shape[:-3], 1, 1, shape[-1]), generator=gen, dtype=dtype)
    return keys + offset


def low_rank_keys(
    gen: torch.Generator, shape: tuple[int, ...], page_rank: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """shape [..., P, B, d]: every page is its centroid plus deviations of rank <= page_rank."""
    *lead, pages, page_size, dim = shape
    factors = torch.randn((*lead, pages, page_size, page_rank), generator=gen, dtype=dtype)
    directions = torch.randn((*lead, pages, page_rank, dim), generator=gen, dtype=dtype)
    centroids = torch.randn((*lead, pages, 1, dim), generator=gen, dtype=dtype)
    return centroids + factors @ directions


def outlier_keys(
    gen: torch.Generator, shape: tuple[int, ...], num_outliers: int = 4, magnitude: float = 20.0, dtype=torch.float32
) -> torch.Tensor:
    """Gaussian keys whose first num_outlier channels (per leading index, random) are scaled up, as
    in real post-RoPE keys with a few massive channels."""
    keys = gaussian_keys(gen, shape, dtype)
    dim = shape[-1]
    gains = torch.ones(dim, dtype=dtype)
    channels = torch.randperm(dim, generator=gen)[:num_outliers]
    gains[channels] = magnitude
    return keys * gains


def scrambled_paged_cache(
    gen: torch.Generator, keys: torch.Tensor, values: torch.Tensor, seq_lens: torch.Tensor, extra_blocks: int = 3
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Contiguous keys/values [S, Hkv, T, d] -> (k_cache, v_cache [NB, B, Hkv, d], block_table [S, maxP])
    with pages placed in random physical blocks (garbage in unused blocks, -1 past each sequence)."""
    num_seqs, num_kv_heads, max_tokens, _ = keys.shape
    max_pages = cdiv(max_tokens, PAGE_SIZE)
    num_blocks = num_seqs * max_pages + extra_blocks
    order = torch.randperm(num_blocks, generator=gen)
    k_cache = torch.randn((num_blocks, PAGE_SIZE, num_kv_heads, keys.shape[-1]), generator=gen, dtype=keys.dtype) * 100
    v_cache = torch.randn((num_blocks, PAGE_SIZE, num_kv_heads, values.shape[-1]), generator=gen, dtype=values.dtype) * 100
    block_table = torch.full((num_seqs, max_pages), -1, dtype=torch.int32)
    padded_tokens = max_pages * PAGE_SIZE
    pad = padded_tokens - max_tokens
    k_pages = torch.nn.functional.pad(keys, (0, 0, 0, pad)).reshape(num_seqs, num_kv_heads, max_pages, PAGE_SIZE, -1)
    v_pages = torch.nn.functional.pad(values, (0, 0, 0, pad)).reshape(num_seqs, num_kv_heads, max_pages, PAGE_SIZE, -1)
    next_block = 0
    for s in range(num_seqs):
        for p in range(cdiv(int(seq_lens[s]), PAGE_SIZE)):
            block = int(order[next_block])
            next_block += 1
            block_table[s, p] = block
            k_cache[block] = k_pages[s, :, p].transpose(0, 1)
            v_cache[block] = v_pages[s, :, p].transpose(0, 1)
    return k_cache, v_cache, block_table


def quantization_error(
    keys: torch.Tensor, queries: torch.Tensor, fmt: SummaryFormat, scale: float
) -> tuple[float, float, float, float]:
    """How far rNiM summaries are from the unrounded fp32 ones, on keys [..., P, B, d] and queries
    [..., G, d]: (rel_key, rel_dev, score, mean_logit_error) where rel_key = max over pages of
    ||K_q - K_fp||_F / ||K_fp||_F (reconstructed keys), rel_dev the same for deviations K - mu,
    score = max |s_q - s_fp| / (scale ||q|| max_i ||k_i||), mean_logit_error = mean |s_q - s_fp|."""
    from .build.packing import quantize_summaries
    from .build.reference import build_page_summaries, reconstruct_keys
    from .score.reference import summary_page_scores

    fp = build_page_summaries(keys, fmt.rank)
    quant = quantize_summaries(fp, fmt)
    key_fp, key_q = reconstruct_keys(fp), reconstruct_keys(quant)
    dev_fp, dev_q = key_fp - fp.centroid.unsqueeze(-2), key_q - quant.centroid.unsqueeze(-2)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(((a - b).flatten(-2).norm(dim=-1) / b.flatten(-2).norm(dim=-1)).max())

    error = (summary_page_scores(queries, quant, scale) - summary_page_scores(queries, fp, scale)).abs()
    norm = scale * queries.norm(dim=-1).unsqueeze(-1) * keys.norm(dim=-1).amax(-1).unsqueeze(-2)
    return rel(key_q, key_fp), rel(dev_q, dev_fp), float((error / norm).max()), float(error.mean())
