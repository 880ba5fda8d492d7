"""Kernel-vs-reference comparisons on fresh random inputs, shared by the tests and the kernel bench.

Each check builds one small random case on a device, runs a kernel on poisoned outputs and
compares every output with the float64/fp32 torch reference; it returns a `CheckResult` whose
`problems` list is empty when the kernel is right. The tests assert on it (printing the seed),
and `locks bench kernel` runs a few on the GPU before timing anything.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

import torch

from . import ops
from .build.packing import SummaryLayout, pack_summaries, unpack_summaries
from .build.reference import build_page_summaries, reconstruct_keys
from .config import PAGE_SIZE, SELECT_PATHS, SummaryFormat, cdiv, scored_pages
from .decode.kernel import DEFAULT_DECODE, TWO_PAGE_DECODE, DecodeTuning
from .decode.reference import paged_decode_reference
from .score.pages import DEFAULT_TUNING, SCORER_KERNELS, ScoreTuning
from .score.reference import summary_page_scores
from .select.reference import combine_group, select_pages
from .testing import gaussian_keys, generator, low_rank_keys
from .triton_common import FP32_EPS, RowConstants

_SCORER_DEFAULT = next(iter(SCORER_KERNELS))  # the backend's score kernel (config.SCORER_KERNELS[0])

logger = logging.getLogger(__name__)

POISON_BYTE = 0xAB


@dataclass
class CheckResult:
    """Outcome of one comparison: `problems` names each mismatch (empty = pass)."""

    name: str
    seed: int
    problems: list[str] = field(default_factory=list)
    max_error: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems

    def expect(self, condition: bool, message: str) -> None:
        if not condition:
            self.problems.append(message)

    def __str__(self) -> str:
        status = "ok" if self.ok else "FAIL: " + "; ".join(self.problems[:4])
        return f"{self.name} (seed {self.seed}, max error {self.max_error:.3g}): {status}"


def _scatter_pages(gen: torch.Generator, num_pages: list[int], extra_blocks: int = 3) -> tuple[torch.Tensor, int]:
    """Random physical blocks for each sequence's pages -> (block_table int32 [S, maxP] (-1 past the end), NB)."""
    max_pages = max(num_pages)
    num_blocks = sum(num_pages) + extra_blocks
    order = torch.randperm(num_blocks, generator=gen)
    table = torch.full((len(num_pages), max_pages), -1, dtype=torch.int32)
    used = 0
    for s, n in enumerate(num_pages):
        table[s, :n] = order[used : used + n].to(torch.int32)
        used += n
    return table, num_blocks


def _cut_mixing(keys: torch.Tensor, rank: int) -> torch.Tensor:
    """[..., P] how far fp32 rounding may move a page's rank-r reconstruction [B, d] when modes r and r+1
    of its centered Gram nearly tie (seed 1692822770: lambda 60.31 vs 59.93). By Davis-Kahan the kept
    subspace turns by sin(theta) <= |E| / gap, |E| ~ 8 B eps |G|_F (the Gram's rounding and the Jacobi's
    stopping rule, build.py), which moves the reconstruction by up to sin(theta) sqrt(lambda_r + lambda_r+1).
    Negligible unless the gap is: a wrong or missing mode still moves it by ~sqrt(lambda_r)."""
    if rank >= PAGE_SIZE:
        return torch.zeros(keys.shape[:-2])
    x = keys.double() - keys.double().mean(-2, keepdim=True)
    gram = x @ x.transpose(-1, -2)
    ev = torch.linalg.eigvalsh(gram).flip(-1)  # descending
    gap = (ev[..., rank - 1] - ev[..., rank]).clamp_min(1e-300)
    sin = (8 * PAGE_SIZE * FP32_EPS * gram.flatten(-2).norm(dim=-1) / gap).clamp(max=1.0)
    return (sin * (ev[..., rank - 1] + ev[..., rank]).clamp_min(0).sqrt()).float()


def centroid_step(centroid: torch.Tensor, quantized: bool) -> torch.Tensor:
    """One rounding step of a stored centroid [..., d], per page ([..., 1]): the int8 scale (absmax / 127), or for
    a float16 centroid one ulp at its absmax's binade (<= absmax / 1024). The kernel's fp32 sum and the reference's
    may round one element to neighbouring values."""
    amax = centroid.abs().amax(-1, keepdim=True)
    return amax / 127 if quantized else amax / 1024


def check_build(device: str, fmt: str, head_dim: int, dtype: torch.dtype, seed: int, low_rank: int | None = None,
                num_kv_heads: int = 2, num_pages: int = 3) -> CheckResult:
    """build_summaries on scattered blocks (one id -1) vs build_page_summaries + pack_summaries."""
    res = CheckResult(f"build {fmt} d={head_dim} {str(dtype)[6:]}" + (f" rank{low_rank}" if low_rank else ""), seed)
    gen = generator(seed)
    layout = SummaryLayout(SummaryFormat.parse(fmt), head_dim)
    shape = (num_kv_heads, num_pages, PAGE_SIZE, head_dim)
    keys = low_rank_keys(gen, shape, low_rank) if low_rank else gaussian_keys(gen, shape)
    keys = keys.to(dtype)
    num_blocks = num_pages + 2
    blocks = torch.randperm(num_blocks, generator=gen)[:num_pages]
    k_cache = (torch.randn((num_blocks, PAGE_SIZE, num_kv_heads, head_dim), generator=gen) * 100).to(dtype)
    k_cache[blocks] = keys.permute(1, 2, 0, 3)
    ids = torch.cat((blocks[:1], torch.tensor([-1]), blocks[1:])).to(torch.int32)
    rows = torch.full((num_blocks, num_kv_heads, layout.row_bytes), POISON_BYTE, dtype=torch.uint8)
    ops.build_summaries(k_cache.to(device), ids.to(device), (rows_dev := rows.to(device)), layout)
    rows = rows_dev.cpu()
    mine_rows = rows[blocks].transpose(0, 1)  # [Hkv, P, row_bytes]
    untouched = torch.ones(num_blocks, dtype=torch.bool)
    untouched[blocks] = False
    res.expect(bool((rows[untouched] == POISON_BYTE).all()), "rows of blocks not in block_ids were written")

    ref = build_page_summaries(keys.to(torch.float32), layout.rank)
    ref_rows = pack_summaries(ref, layout.fmt)
    mine = unpack_summaries(mine_rows, layout)
    ref_q = unpack_summaries(ref_rows, layout)
    # Bit layout: the packed row is a fixed point of the reference quantizer (scales, nibbles, padding).
    res.expect(torch.equal(pack_summaries(mine, layout.fmt), mine_rows), "packed rows are not what the reference packer writes")
    res.expect(bool(torch.isfinite(mine.basis).all() and torch.isfinite(mine.coefficients).all()), "non-finite summary values")
    # The centroid is computed the same way: its bytes agree up to one rounding step.
    mu_mine, mu_ref = mine.centroid, ref_q.centroid
    mu_step = centroid_step(ref_q.centroid, layout.fmt.quantized)
    res.expect(bool(((mu_mine - mu_ref).abs() <= 1.01 * mu_step + 1e-6).all()), "centroid differs from the reference")
    # Reconstructions (eigenvectors may differ by rotation in degenerate eigenspaces).
    true_keys = keys.to(torch.float32)
    recon_mine, recon_ref = reconstruct_keys(mine), reconstruct_keys(ref_q)
    ref_err = (recon_ref - true_keys).flatten(-2).norm(dim=-1)  # [Hkv, P]
    quant_err = (recon_ref - reconstruct_keys(ref)).flatten(-2).norm(dim=-1)
    diff = (recon_mine - recon_ref).flatten(-2).norm(dim=-1)
    scale = true_keys.flatten(-2).norm(dim=-1)
    tol = 3 * quant_err + 2e-3 * scale + _cut_mixing(true_keys, layout.rank)
    res.max_error = float((diff / scale).max())
    res.expect(bool((diff <= tol).all()), f"reconstruction differs from the reference by {float((diff - tol).max()):.3g} over tol")
    res.expect(bool(((recon_mine - true_keys).flatten(-2).norm(dim=-1) <= ref_err + tol).all()), "reconstruction error exceeds the reference's")
    if low_rank is not None and low_rank <= layout.rank:
        # r >= rank(D): exact up to the storage precision, and only rank(D) modes are kept.
        rel = (recon_mine - true_keys).flatten(-2).norm(dim=-1) / scale
        res.expect(bool((rel <= (2e-3 if not layout.fmt.quantized else 0.1)).all()), f"r >= rank but reconstruction error {float(rel.max()):.3g}")
        res.expect(bool((mine.kept_modes().sum(-1) <= low_rank).all()), "zero modes were kept")
    # Scores read from the rows agree with the reference's scores within its quantization error.
    q = torch.randn((num_kv_heads, 3, head_dim), generator=gen)
    s_mine = summary_page_scores(q, mine, head_dim**-0.5)
    s_ref = summary_page_scores(q, ref_q, head_dim**-0.5)
    s_exact = summary_page_scores(q, ref, head_dim**-0.5)
    s_tol = 3 * (s_ref - s_exact).abs().amax() + 1e-3
    res.expect(bool(((s_mine - s_ref).abs() <= s_tol).all()), f"scores from the rows differ by {float((s_mine - s_ref).abs().max()):.3g}")
    return res


@dataclass(frozen=True)
class SelectCase:
    """A score_select case: token counts per sequence, GQA group, head dim, format, budget and rule."""

    seq_lens: tuple[int, ...]
    group: int
    head_dim: int
    fmt: str = "r8i4"
    page_budget: int = 6
    combine: str = "share_average"
    num_kv_heads: int = 2
    identical_pages: bool = False  # every page holds the same keys: all scores tie, lower ids must win
    workspace_group: int | None = None  # allocate the workspace for this larger G (more padded head slots)
    page_noise: float | None = None  # pages = page 0 + noise x fresh keys: near-flat shares, keys in a few bins
    query_spread: float | None = None  # q x exp(spread x N(0, 1)) per element: outlier dims, |q| over decades


# Page scores vs the fp64 reference, |got - ref| / (1 + |ref|): <= 2e-6 on every case, fp32 and bf16 queries,
# pages / lean / transposed kernels (interpreter, 2026-11-30); one bf16 term of V^T q instead of three ~1e-3.
SCORE_RTOL = 2e-5


def check_score_select(device: str, case: SelectCase, seed: int, q_dtype: torch.dtype = torch.float32,
                       tuning: ScoreTuning = DEFAULT_TUNING, second_call: bool = True) -> CheckResult:
    """score_select on reference-packed rows in scrambled blocks vs summary scores + combine + select.

    second_call: call it again on the same workspace and expect the same pages (each path must leave its
    histograms and counters zeroed). It doubles the time, which only the CPU interpreter notices."""
    res = CheckResult(f"score_select {case}" + ("" if tuning == DEFAULT_TUNING else f" {tuning}"), seed)
    gen = generator(seed)
    layout = SummaryLayout(SummaryFormat.parse(case.fmt), case.head_dim)
    num_pages = [cdiv(n, PAGE_SIZE) for n in case.seq_lens]
    table, num_blocks = _scatter_pages(gen, num_pages)
    S, Hkv, G, d, k = len(num_pages), case.num_kv_heads, case.group, case.head_dim, case.page_budget
    max_pages = table.shape[1]
    keys = gaussian_keys(gen, (S, Hkv, max_pages, PAGE_SIZE, d))
    if case.identical_pages:
        keys = keys[:, :, :1].expand_as(keys).contiguous()
    elif case.page_noise is not None:
        keys = keys[:, :, :1] + case.page_noise * keys
    packed = pack_summaries(build_page_summaries(keys, layout.rank), layout.fmt)  # [S, Hkv, maxP, row]
    rows = torch.randint(0, 256, (num_blocks, Hkv, layout.row_bytes), generator=gen, dtype=torch.uint8)
    for s, n in enumerate(num_pages):
        full = scored_pages(case.seq_lens[s])  # the recent page (full or not) is never read: leave garbage
        rows[table[s, :full].long()] = packed[s, :, :full].transpose(0, 1)
    q = torch.randn((S, Hkv * G, d), generator=gen)
    if case.query_spread is not None:
        q = q * torch.exp(case.query_spread * torch.randn(q.shape, generator=gen))
    q = q.to(q_dtype)
    scale = d**-0.5
    seq_lens = torch.tensor(case.seq_lens, dtype=torch.int32)
    selected = torch.full((S, Hkv, k), -7, dtype=torch.int32, device=device)
    ws = ops.score_select_workspace(S, Hkv, max_pages, device, group_size=case.workspace_group or G)
    for buf in (ws.scores, ws.chunk_max, ws.chunk_sum):
        buf.fill_(float("nan"))
    for buf in (ws.keys, ws.cand_low, ws.cand_page):
        buf.fill_(-123)
    args = (q.to(device), rows.to(device), table.to(device), seq_lens.to(device), selected, layout, k, scale, case.combine)
    ops.score_select(*args, workspace=ws, tuning=tuning)
    mine = selected.cpu().long()
    if second_call:
        selected.fill_(-7)
        ops.score_select(*args, workspace=ws, tuning=tuning)  # the workspace is reused as-is (its histogram left zeroed)
        res.expect(torch.equal(selected.cpu().long(), mine), "a second call on the same workspace selected differently")

    scores = summary_page_scores(q.double().reshape(S, Hkv, G, d), unpack_summaries(packed, layout), scale)
    # The score kernel's per-head page scores themselves (a term of V^T q lost shows here long before it
    # moves a selection past the tie tolerance below).
    got_scores = ws.scores.cpu().double()[: S * Hkv, :, :G].reshape(S, Hkv, max_pages, G).transpose(2, 3)
    for s in range(S):
        full = scored_pages(case.seq_lens[s])
        err = (got_scores[s, :, :, :full] - scores[s, :, :, :full]).abs() / (1.0 + scores[s, :, :, :full].abs())
        res.max_error = max(res.max_error, float(err.max()) if full else 0.0)
    res.expect(res.max_error <= SCORE_RTOL, f"page scores off the fp64 reference by {res.max_error:.3g} (relative) > {SCORE_RTOL}")
    for s, n in enumerate(num_pages):
        full = scored_pages(case.seq_lens[s])
        page_mask = torch.arange(max_pages) < full
        group_scores = combine_group(scores[s], case.combine, page_mask)  # [Hkv, maxP] fp64
        expected = select_pages(group_scores, n, k)
        for h in range(Hkv):
            got, want = mine[s, h], expected[h]
            where = f"seq {s} (len {case.seq_lens[s]}) head {h}"
            if n <= k:
                res.expect(torch.equal(got, want), f"{where}: dense fallback {got.tolist()} != {want.tolist()}")
                continue
            res.expect(bool((got[1:] > got[:-1]).all()), f"{where}: ids not strictly ascending {got.tolist()}")
            res.expect(int(got[0]) == 0 and int(got[-1]) == n - 1, f"{where}: sink/recent missing {got.tolist()}")
            if case.identical_pages:
                # Every contested page ties, so the tie rule alone decides: sink, pages 1..k-2, recent. (Not the
                # fp64 reference's pick: torch's batched fp64 products can differ in the last ulp between
                # identical pages, and then it "prefers" some; seed 3767676607 gave pages 24-28 of 29.)
                lowest = torch.cat([torch.arange(k - 1), torch.tensor([n - 1])]).to(got.dtype)
                res.expect(torch.equal(got, lowest), f"{where}: exact ties must go to the lower page ids: {got.tolist()}")
            elif not torch.equal(got, want):
                contested = group_scores[h, 1 : n - 1]
                threshold = contested.sort(descending=True).values[k - 3]
                tol = 1e-5 if case.combine == "group_mass" else 1e-5 * float(threshold.abs()) + 1e-12
                ids = got.clamp(0, max_pages - 1)
                extra = [int(p) for p in got if p not in want]
                missing = [int(p) for p in want if p not in got]
                bad = [p for p in extra if not (0 < p < n - 1) or group_scores[h, p] < threshold - tol]
                bad += [p for p in missing if group_scores[h, p] > threshold + tol]
                res.expect(not bad and ids.unique().numel() == k, f"{where}: selected {got.tolist()} != reference "
                           f"{want.tolist()} beyond ties (pages {bad})")
    return res


@dataclass(frozen=True)
class DecodeCase:
    """A sparse decode case: token counts, GQA group, head dim, page budget (None = dense: all pages)."""

    seq_lens: tuple[int, ...]
    group: int
    head_dim: int
    page_budget: int | None = 5
    num_kv_heads: int = 2


BF16_DECODE_TOLERANCE = 2e-2  # atol and rtol of a bf16 decode against the fp64 reference


def check_decode(device: str, case: DecodeCase, seed: int, dtype: torch.dtype = torch.bfloat16,
                 tuning: DecodeTuning = DEFAULT_DECODE) -> CheckResult:
    """sparse_paged_decode over random page subsets (sink, recent, -1 padding) vs paged_decode_reference,
    under the launch shape `tuning`; the workspace's unused splits hold NaN, so a merge that reads them fails."""
    shape = "" if tuning == DEFAULT_DECODE else f" {tuning}"
    res = CheckResult(f"decode {case} {str(dtype)[6:]}" + shape, seed)
    gen = generator(seed)
    S, Hkv, G, d = len(case.seq_lens), case.num_kv_heads, case.group, case.head_dim
    num_pages = [cdiv(n, PAGE_SIZE) for n in case.seq_lens]
    table, num_blocks = _scatter_pages(gen, num_pages)
    k_cache = torch.randn((num_blocks, PAGE_SIZE, Hkv, d), generator=gen).to(dtype)
    v_cache = torch.randn((num_blocks, PAGE_SIZE, Hkv, d), generator=gen).to(dtype)
    q = torch.randn((S, Hkv * G, d), generator=gen).to(dtype)
    k = case.page_budget or max(num_pages)
    selected = torch.full((S, Hkv, k), -1, dtype=torch.int32)
    for s, n in enumerate(num_pages):
        for h in range(Hkv):
            if case.page_budget is None or n <= k:
                selected[s, h, :n] = torch.arange(n)
            else:
                middle = (torch.randperm(n - 2, generator=gen)[: k - 2] + 1).sort().values
                selected[s, h] = torch.cat((torch.tensor([0]), middle, torch.tensor([n - 1])))
    seq_lens = torch.tensor(case.seq_lens, dtype=torch.int32)
    scale = d**-0.5
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=device)
    ws = ops.decode_workspace(S, Hkv * G, d, device, num_splits=tuning.max_splits + 3)  # wider than used
    ws.partial_out.fill_(float("nan"))
    ws.partial_lse.fill_(float("nan"))
    try:
        ops.sparse_paged_decode(q.to(device), k_cache.to(device), v_cache.to(device), table.to(device), seq_lens.to(device),
                                selected.to(device), scale, out, ws, tuning=tuning)
    except Exception as exc:  # noqa: BLE001 - e.g. a launch shape that needs more shared memory than the GPU has
        res.expect(False, f"launch failed: {type(exc).__name__}: {str(exc)[:160]}")
        return res
    ref = paged_decode_reference(q.double(), k_cache.double(), v_cache.double(), table, seq_lens, scale,
                                 None if case.page_budget is None else selected.long())
    err = (out.cpu().double() - ref).abs()
    atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (BF16_DECODE_TOLERANCE, BF16_DECODE_TOLERANCE)
    res.max_error = float(err.nan_to_num(float("inf")).max())
    res.expect(bool(torch.isfinite(out).all()), "output has unwritten (NaN) elements")
    res.expect(bool((err <= atol + rtol * ref.abs()).all()), f"max |out - ref| = {res.max_error:.3g} (atol {atol})")
    return res


BUILD_CASES = [  # (format, head_dim, key dtype)
    ("r8i4", 128, torch.bfloat16), ("r8i8", 64, torch.float32), ("r8fp", 64, torch.float32),
    ("r3i4", 256, torch.bfloat16), ("r15i4", 64, torch.float16),
]
LOW_RANK_CASES = [("r8fp", 3), ("r4i8", 4)]  # (format, rank of the page deviations) with r >= rank
SELECT_CASES = [
    # odd token counts (partial last page), a sequence ending on a page boundary, dense fallback
    SelectCase((16 * 37 + 5, 16 * 9, 16 * 4 + 1), group=4, head_dim=64),
    SelectCase((16 * 41 + 11,), group=1, head_dim=128, fmt="r8i8"),
    SelectCase((16 * 23, 16 * 30 + 15), group=7, head_dim=64, fmt="r4fp", combine="group_max"),
    SelectCase((16 * 19 + 2, 16 * 6 + 3), group=8, head_dim=256, fmt="r2i4", combine="group_mass", num_kv_heads=1),
    SelectCase((16 * 70 + 1, 16 * 12), group=8, head_dim=128, page_budget=9, num_kv_heads=3),
    SelectCase((16 * 2, 7, 16 * 3 + 1), group=4, head_dim=64, page_budget=4),  # every sequence dense
    SelectCase((16 * 29 + 3,), group=4, head_dim=64, page_budget=7, identical_pages=True),
    # G not a power of two (head slots padded to next_pow2(G)) under every combine rule, and more d
    SelectCase((77, 162, 49), group=3, head_dim=32, page_budget=4),  # the reported failing geometry
    SelectCase((16 * 27 + 9, 16 * 13 + 1), group=3, head_dim=128, fmt="r8i8", combine="group_max"),
    SelectCase((16 * 31 + 5,), group=3, head_dim=256, fmt="r4i4", combine="group_mass"),
    SelectCase((16 * 33 + 7, 16 * 8 + 3), group=7, head_dim=128, page_budget=7),
    SelectCase((16 * 25 + 1,), group=7, head_dim=256, fmt="r8fp", combine="group_mass", num_kv_heads=1),
    SelectCase((16 * 21 + 13, 16 * 17), group=5, head_dim=64, combine="group_max", workspace_group=9),
    SelectCase((16 * 15 + 3,), group=3, head_dim=64, page_budget=5, identical_pages=True),
    SelectCase((16 * 19 + 3,), group=1, head_dim=256, combine="group_max"),
    SelectCase((16 * 17 + 5,), group=1, head_dim=64, fmt="r4i8", combine="group_mass", num_kv_heads=3),
    SelectCase((16 * 23 + 1, 16 * 11 + 9), group=4, head_dim=128, combine="group_mass"),
    SelectCase((16 * 26 + 15,), group=8, head_dim=64, fmt="r8i8", combine="group_max"),
    # all scores tie: more candidates than one select block, spread over many chunks; lowest ids win
    SelectCase((16 * 700 + 5,), group=2, head_dim=32, page_budget=600, num_kv_heads=1, identical_pages=True),
    # Near-flat attention (what dummy weights give): every key in a few histogram bins, many candidates.
    SelectCase((16 * 300 + 7,), group=8, head_dim=64, page_budget=20, page_noise=1e-3),
    SelectCase((16 * 200 + 16, 16 * 90 + 2), group=4, head_dim=64, page_budget=9, combine="group_max", page_noise=1e-2),
]
# Enough pages that the threshold bin is crowded; bf16 queries.
MANY_PAGES_CASE = SelectCase((16 * 1500 + 7,), group=4, head_dim=64, fmt="r2i4", page_budget=64, num_kv_heads=1)
# The merge selection's production shapes on a 132-SM GPU, too large for the interpreter (GPU only, `--long`):
LONG_SELECT_CASES = [
    # 512K bs1 of GLM-4-9B: 32 chunks of 1024 pages, a 32 x 128 candidate tile
    SelectCase((16 * 32768 - 3,), group=8, head_dim=128, page_budget=128, num_kv_heads=4),
    # 16 pairs: 9 chunks of up to 4096 pages (MAX_BLOCK), a 16 x 128 tile
    SelectCase((16 * 20000 + 5,), group=2, head_dim=32, page_budget=128, num_kv_heads=16),
]
DECODE_CASES = [
    DecodeCase((16 * 13 + 5, 16 * 9), group=1, head_dim=64),
    DecodeCase((16 * 11 + 1, 16 * 3 + 15, 16 * 2), group=4, head_dim=128, page_budget=7),
    DecodeCase((16 * 8 + 9,), group=7, head_dim=64, num_kv_heads=3),
    DecodeCase((16 * 21 + 3, 16 * 5 + 2), group=8, head_dim=256, page_budget=9, num_kv_heads=1),
    DecodeCase((16 * 6 + 7, 5, 16 * 3), group=4, head_dim=64, page_budget=None),  # dense: every page
    DecodeCase((16 * 5 + 1, 16), group=8, head_dim=128, page_budget=None, num_kv_heads=1),
    DecodeCase((16 * 7 + 3, 16 * 4 + 13), group=3, head_dim=256, page_budget=4),  # padded head slots
    DecodeCase((16 * 10 + 7,), group=7, head_dim=128, page_budget=None),
]

# Launch shapes other than the default's that the decode must also get right: the earlier default (two iterations,
# the merge waiting on each lse), 64 splits, one page per iteration, a single split
DECODE_TUNINGS = (
    TWO_PAGE_DECODE,
    DecodeTuning(pages_per_iter=2, max_splits=64, warps=4, stages=1),
    DecodeTuning(pages_per_iter=1, max_splits=128, waves=4, warps=4, stages=1),
    DecodeTuning(pages_per_iter=8, max_splits=1, stages=1, merge_eager=False),
)


def decode_battery(device: str, seed: int, tunings=DECODE_TUNINGS) -> list[CheckResult]:
    """Every DECODE_CASES case on bf16 (the engine's cache dtype) under each tuning: the GPU check before timing
    a decode launch shape (`python -m ...lab.kernel_checks --decode`). fp32 caches at d = 256 need more shared
    memory than the H200 has under the wider shapes; the interpreter tests cover fp32."""
    return [check_decode(device, c, seed + i, torch.bfloat16, tuning=t) for t in tunings for i, c in enumerate(DECODE_CASES)]


def gpu_smoke_checks(device: str, seed: int) -> list[CheckResult]:
    """The small set the kernel bench runs before timing: each kernel, a few shapes, bf16 on the GPU."""
    results = [
        check_build(device, "r8i4", 128, torch.bfloat16, seed),
        check_build(device, "r4fp", 64, torch.float32, seed + 1, low_rank=3),
        check_score_select(device, SelectCase((16 * 40 + 3, 16 * 7, 16 * 23), 8, 128), seed + 2, torch.bfloat16),
        check_score_select(device, SelectCase((16 * 300 + 9, 16 * 129), 4, 128, page_budget=128), seed + 3, torch.bfloat16),
        check_score_select(device, SelectCase((16 * 50 + 5, 16 * 9 + 3), 7, 128, page_budget=12), seed + 6, torch.bfloat16),
        check_decode(device, DecodeCase((16 * 40 + 3, 16 * 7 + 1), 8, 128), seed + 4),
        check_decode(device, DecodeCase((16 * 9 + 5,), 7, 64, page_budget=None), seed + 5),
    ]
    for r in results:
        logger.info("%s", r)
    return results


# The pages scorer's other path the default can take (the default runs in every other check): the FMA
# coefficient contraction, what runs where the tensor-core one does not apply (r < 4, or G < 8 on 16-bit dots).
SCORER_VARIANTS = (ScoreTuning(coef_mma=False),)
# The transposed kernel as the backend runs it (its Triton scorer where the CUDA one declines: 2-page tiles).
TRANSPOSED_VARIANTS = (ScoreTuning(**SCORER_KERNELS["transposed"]),)


def full_battery(device: str, seed: int) -> list[CheckResult]:
    """Every case of the test files, for machines without pytest (`python -m ...lab.kernel_checks`)."""
    results = [check_build(device, f, d, t, seed + i, num_kv_heads=1, num_pages=2) for i, (f, d, t) in enumerate(BUILD_CASES)]
    results += [check_build(device, f, 64, torch.float32, seed + i, low_rank=r, num_kv_heads=1, num_pages=2)
                for i, (f, r) in enumerate(LOW_RANK_CASES)]
    results += [check_score_select(device, c, seed + i) for i, c in enumerate(SELECT_CASES)]
    results.append(check_score_select(device, MANY_PAGES_CASE, seed, torch.bfloat16))
    results += [check_decode(device, c, seed + i, t) for i, c in enumerate(DECODE_CASES)
                for t in (torch.bfloat16, torch.float32)]
    results += [check_score_select(device, c, seed + i, tuning=ScoreTuning(select_path="chunked"))
                for i, c in enumerate(SELECT_CASES + [MANY_PAGES_CASE])]
    # the scorer's other paths on bf16 queries
    results += [check_score_select(device, c, seed + i, torch.bfloat16, tuning=t)
                for i, c in enumerate(SELECT_CASES + [MANY_PAGES_CASE]) for t in SCORER_VARIANTS + TRANSPOSED_VARIANTS]
    return results


# The CUDA score kernel's geometry (r8i4, d = 128, bf16 q, G <= 16): GLM-4's G = 16 with 2 KV heads, odd
# token counts (partial last tiles and pages), programs with one tile and with many, padded head rows.
CUDA_CASES = [
    SelectCase((16 * 517 + 3, 16 * 64 + 16), group=16, head_dim=128, page_budget=40, num_kv_heads=2),
    SelectCase((16 * 2049 + 1,), group=16, head_dim=128, page_budget=128, num_kv_heads=2),
    SelectCase((16 * 5 + 1, 16 * 9 + 15, 16 * 300 + 7), group=16, head_dim=128, page_budget=6, num_kv_heads=1),
    SelectCase((16 * 97 + 9, 16 * 33), group=12, head_dim=128, page_budget=11, num_kv_heads=3, combine="group_max"),
    SelectCase((16 * 150 + 2,), group=1, head_dim=128, page_budget=17, num_kv_heads=4, combine="group_mass"),
    SelectCase((16 * 400 + 5,), group=16, head_dim=128, page_budget=30, num_kv_heads=2, page_noise=1e-2),
    # G <= 8 (one head per lane, four byte pieces of q): the GLM-4-9B geometry and an odd group with outliers;
    # then G = 16 (three byte pieces) with outliers
    SelectCase((16 * 1031 + 5, 16 * 77 + 1), group=8, head_dim=128, page_budget=64, num_kv_heads=4),
    SelectCase((16 * 211 + 13, 16 * 40), group=5, head_dim=128, page_budget=9, num_kv_heads=2, query_spread=1.5),
    SelectCase((16 * 90 + 3,), group=16, head_dim=128, page_budget=12, num_kv_heads=1, query_spread=1.5),
    # A table as wide as the engine's at 640K with k = 128: the merge path in 32 chunks of several key steps
    # each and a full 32 x 128 candidate tile, the chunked path in 32 chunks of several blocks
    SelectCase((16 * 40960 + 3, 16 * 20000 + 9), group=8, head_dim=128, page_budget=128, num_kv_heads=2),
]


def cuda_battery(device: str, seed: int, paths=SELECT_PATHS) -> list[CheckResult]:
    """CUDA_CASES through the CUDA score kernel, each also failing if the kernel did not serve it (fell back to
    Triton): the GPU check before timing `scorer_kernel="cuda"` (`python -m ...lab.kernel_checks --cuda`)."""
    from .score import cuda as cuda_score  # noqa: PLC0415 - needs a GPU to mean anything

    results = []
    for path in paths:
        for i, case in enumerate(CUDA_CASES):
            res = check_score_select(device, case, seed + i, torch.bfloat16,
                                     tuning=ScoreTuning(select_path=path, **SCORER_KERNELS["cuda"]))
            rc = RowConstants.of(SummaryLayout(SummaryFormat.parse(case.fmt), case.head_dim))
            q = torch.empty((1, case.num_kv_heads * case.group, case.head_dim), dtype=torch.bfloat16, device=device)
            rows = torch.empty((1, case.num_kv_heads, rc.row_bytes), dtype=torch.uint8, device=device)
            why = cuda_score.fits(q, rows, rc, case.group)
            res.expect(why is None, f"the CUDA kernel did not serve this case: {why}")
            results.append(res)
    return results


def select_battery(device: str, seed: int, paths=SELECT_PATHS, cases=None, scorer: str = _SCORER_DEFAULT,
                   second_call: bool = True) -> list[CheckResult]:
    """Every select case (default: SELECT_CASES + MANY_PAGES_CASE) on bf16 queries, once per selection
    path, with the score kernel's code path `scorer` (score_select.SCORER_KERNELS): the GPU check to run
    before timing a selection or scorer change (`python -m ...lab.kernel_checks --select chunked,one
    [--scorer transposed]`). The interpreter runs a launch's programs one after another, so a race between
    programs of one kernel shows only on a GPU."""
    cases = SELECT_CASES + [MANY_PAGES_CASE] if cases is None else cases
    return [check_score_select(device, c, seed + i, torch.bfloat16,
                               tuning=ScoreTuning(select_path=path, **SCORER_KERNELS[scorer]), second_call=second_call)
            for path in paths for i, c in enumerate(cases)]


@contextlib.contextmanager
def reversed_program_order():
    """Under TRITON_INTERPRET=1 a launch runs its programs one after another in grid order, so a kernel
    that assumes which program of a launch runs last (instead of asking an arrival counter) passes by
    luck of that order. Inside this block every launch runs them in reverse: program (x, y, z) runs as
    (nx-1-x, ny-1-y, nz-1-z). Races between programs running at once, or between the warps of one
    program, stay invisible to the interpreter (the GPU checks: `select_battery`)."""
    from triton.runtime import interpreter  # noqa: PLC0415 - the interpreter only

    builder = interpreter.interpreter_builder
    forward = builder.set_grid_idx

    def reverse(x, y, z):
        nx, ny, nz = builder.grid_dim
        forward(nx - 1 - x, ny - 1 - y, nz - 1 - z)

    builder.set_grid_idx = reverse
    try:
        yield
    finally:
        builder.set_grid_idx = forward


def available_devices() -> list[str]:
    """Where the kernels can run here: the CPU interpreter (TRITON_INTERPRET=1) or the GPU."""
    import os

    if os.environ.get("TRITON_INTERPRET") == "1":
        return ["cpu"]
    return ["cuda"] if torch.cuda.is_available() else []
