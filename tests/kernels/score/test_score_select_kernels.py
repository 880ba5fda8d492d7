"""score_select (Triton) vs summary_page_scores + combine_group + select_pages on the same packed rows."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from locks_toolkit.kernels.build.packing import SummaryLayout
from locks_toolkit.kernels.checks import (
    MANY_PAGES_CASE,
    SCORER_VARIANTS,
    SELECT_CASES,
    TRANSPOSED_VARIANTS,
    SelectCase,
    available_devices,
    check_score_select,
)
from locks_toolkit.kernels.config import SummaryFormat
from locks_toolkit.kernels.ops import transposed_fits
from locks_toolkit.kernels.score.pages import (
    SCORER_KERNELS,
    ScoreTuning,
    _nibble_value,
    _paired_codes,
    _word_codes,
    word_decode_fits,
)
from locks_toolkit.kernels.score.transposed import _q_shifts
from locks_toolkit.kernels.testing import fresh_seed
from locks_toolkit.kernels.triton_common import RowConstants

DEVICES = available_devices() or [pytest.param("none", marks=pytest.mark.skip(reason="needs TRITON_INTERPRET=1 or a GPU"))]
# Under the interpreter a check's second call on the same workspace (check_score_select's `second_call`) doubles
# its minutes: it runs for the cases under this many tokens, and on the GPU for every case (the GPU battery);
# test_both_select_paths_leave_the_workspace_for_each_other checks the reuse on both paths everywhere.
SECOND_CALL_MAX_TOKENS = 1000
# SELECT_CASES[4]'s geometry (G = 8, d = 128, 3 KV heads: the production layout) at a third of its pages, for the
# tests that vary the kernels rather than the case (the full case runs in both selection tests).
G8_D128_CASE = SelectCase((16 * 25 + 1, 16 * 12), group=8, head_dim=128, page_budget=9, num_kv_heads=3)


def _check(device, case: SelectCase, **kwargs):
    second = device != "cpu" or sum(case.seq_lens) < SECOND_CALL_MAX_TOKENS
    return check_score_select(device, case, fresh_seed(), second_call=second, **kwargs)
# Under the interpreter a NaN made anywhere in the kernels (e.g. -inf - -inf for a padded head slot) warns;
# the kernels must not make one, since a NaN key cast to int indexes the histogram out of bounds.
pytestmark = pytest.mark.filterwarnings("error:invalid value encountered:RuntimeWarning")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", SELECT_CASES, ids=lambda c: f"G{c.group}-d{c.head_dim}-{c.fmt}-{c.combine}-k{c.page_budget}"
                         + (f"-wsG{c.workspace_group}" if c.workspace_group else "") + ("-ties" if c.identical_pages else "")
                         + (f"-flat{c.page_noise}" if c.page_noise else ""))
def test_score_select_matches_reference(device, case):
    result = _check(device, case)
    print(result)
    assert result.ok, str(result)


@triton.jit
def _decode_nibbles(out_ptr, DT: tl.constexpr):
    n = tl.arange(0, 16)
    tl.store(out_ptr + n, _nibble_value(n, DT).to(tl.float32))


@pytest.mark.parametrize("device", DEVICES)
def test_nibble_value_is_exact(device):
    """_nibble_value (the scorer's int4 decode) gives n - 8 exactly for every code, in each dot dtype.

    The interpreter runs score_select's dots in fp32 only, so the fp16/bf16 branches are checked here
    (bf16 by its bit identity: the interpreter has no bf16 constants)."""
    want = torch.arange(-8, 8, dtype=torch.float32)
    for dtype in (tl.float16, tl.float32) if device == "cpu" else (tl.bfloat16, tl.float16, tl.float32):
        out = torch.full((16,), float("nan"), device=device)
        _decode_nibbles[(1,)](out, DT=dtype)
        assert torch.equal(out.cpu(), want), f"{dtype}: {out.tolist()}"
    codes = torch.arange(16, dtype=torch.int16)
    assert torch.equal(((codes | 0x4300).view(torch.bfloat16) - 136).float(), want)


@triton.jit
def _decode_words(words_ptr, out_ptr, N: tl.constexpr, DT: tl.constexpr):
    """out[n, 8] = the 8 codes of word n minus 8, in dim order, through _word_codes."""
    n = tl.arange(0, N)
    words = tl.load(words_ptr + n)
    for shift in tl.static_range(4):
        lo, hi = _word_codes(words, 4 * shift, DT)
        tl.store(out_ptr + n * 8 + shift, lo.to(tl.float32))
        tl.store(out_ptr + n * 8 + 4 + shift, hi.to(tl.float32))


@pytest.mark.parametrize("device", DEVICES)
def test_word_codes_decode_every_nibble_in_dim_order(device):
    """Two codes per operation from int32 words: fresh random words plus all-0x0 and all-0xF ones, each
    dot dtype the device runs (the interpreter has no bf16 constants: the GPU run covers bf16)."""
    gen = torch.Generator().manual_seed(fresh_seed())
    raw = torch.randint(0, 256, (64, 4), generator=gen, dtype=torch.uint8)
    raw[0], raw[1] = 0, 255
    words = raw.view(torch.int32).reshape(64)
    low, high = (raw & 15).to(torch.float32) - 8, (raw >> 4).to(torch.float32) - 8
    want = torch.stack([low, high], dim=2).reshape(64, 8)  # byte b: dims 2b (low), 2b+1 (high)
    for dtype in (tl.float16, tl.float32) if device == "cpu" else (tl.bfloat16, tl.float16, tl.float32):
        out = torch.full((64 * 8,), float("nan"), device=device)
        _decode_words[(1,)](words.to(device), out, N=64, DT=dtype)
        assert torch.equal(out.cpu().reshape(64, 8), want), f"{dtype}"


WORD_CASES = [
    G8_D128_CASE,
    SelectCase((16 * 41 + 11,), group=1, head_dim=128, page_budget=5),
    SelectCase((16 * 33 + 7, 16 * 8 + 3), group=7, head_dim=128, page_budget=7, combine="group_max"),
    SelectCase((16 * 19 + 2, 16 * 6 + 3), group=4, head_dim=256, fmt="r2i4", combine="group_mass", num_kv_heads=1),
    SelectCase((16 * 29 + 3,), group=4, head_dim=128, page_budget=7, identical_pages=True),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", WORD_CASES, ids=lambda c: f"G{c.group}-d{c.head_dim}-{c.fmt}-{c.combine}")
def test_word_decode_path_matches_reference_on_bf16_queries(device, case):
    """The default scorer's 32-bit-word int4 path on the queries the engine passes, bf16 (the select cases
    above run fp32 queries; bf16 queries take the two-codes-per-operation decode on the GPU, the interpreter
    runs fp32 dots)."""
    assert word_decode_fits(4, case.head_dim, 0, 0)
    result = _check(device, case, q_dtype=torch.bfloat16)
    assert result.ok, str(result)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tuning", SCORER_VARIANTS, ids=lambda t: f"w{t.warps}-p{t.tile}" + ("-mma" if t.coef_mma else "-fma"))
@pytest.mark.parametrize("case", [SELECT_CASES[0], SELECT_CASES[1], G8_D128_CASE], ids=lambda c: f"G{c.group}-{c.fmt}-n{sum(c.seq_lens)}")
def test_scorer_variants_select_what_the_reference_selects(device, tuning, case):
    """The pages scorer's FMA coefficient contraction (where the tensor-core one does not apply) on int4 / int8
    formats; the default (tensor-core contraction, one warp, 4-page tiles) runs in every other test."""
    result = _check(device, case, tuning=tuning)
    assert result.ok, str(result)


def test_word_decode_fits_only_whole_words_and_dot_sized_k():
    assert word_decode_fits(4, 128, 832, 160) and word_decode_fits(4, 256, 1600, 288)
    assert not word_decode_fits(8, 128, 832, 160)  # int8 basis: no nibbles
    assert not word_decode_fits(4, 64, 832, 160)  # K = 8 < 16
    assert not word_decode_fits(4, 128, 834, 160) and not word_decode_fits(4, 128, 832, 162)  # not whole words


def _case_id(c: SelectCase) -> str:
    return (f"G{c.group}-{c.combine}-k{c.page_budget}" + ("-ties" if c.identical_pages else "")
            + (f"-flat{c.page_noise}" if c.page_noise else "") + f"-n{sum(c.seq_lens)}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", SELECT_CASES, ids=lambda c: f"G{c.group}-d{c.head_dim}-{c.fmt}-{c.combine}-k{c.page_budget}"
                         + ("-ties" if c.identical_pages else "") + (f"-flat{c.page_noise}" if c.page_noise else "")
                         + f"-n{sum(c.seq_lens)}")
def test_chunked_select_matches_reference(device, case):
    """Selection in three launches (keys, gather, resolve: the path merge declines to) against the reference, on
    every select case: ties to the lower ids, near-flat pages, dense fallback; a crowded threshold bin below.
    (The merge path, the kernel-level default: the first test.)"""
    result = _check(device, case, tuning=ScoreTuning(select_path="chunked"))
    assert result.ok, str(result)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case, min_pages, max_block, ways", [
    (G8_D128_CASE, 4, 4096, 3),  # up to 32 chunks of a few pages: fewer than k - 2 each, every page a candidate
    (SELECT_CASES[20], 4, 16, 3),  # chunks of 16 pages over 200: more than k - 2 each, the chunk's own search
    (SELECT_CASES[20], 4, 16, 0),  # the same with binary searches
    (MANY_PAGES_CASE, 1, 64, 0),  # 24 chunks of up to 64 keys: several key steps, a crowded candidate tile
], ids=lambda v: f"G{v.group}-k{v.page_budget}-n{sum(v.seq_lens)}" if isinstance(v, SelectCase) else str(v))
def test_merge_select_over_many_chunks_matches_reference(device, case, min_pages, max_block, ways, monkeypatch):
    """The merge path with the chunk count of a 132-SM GPU: chunks whose lists hold all their pages and
    chunks that search their own threshold, the last program's tile of every chunk's list; both searches
    (8 trials a pass, and binary)."""
    from locks_toolkit.kernels import ops
    from locks_toolkit.kernels.select import merge

    monkeypatch.setattr(ops, "num_sms", lambda _: 132)
    monkeypatch.setattr(merge, "log_ways", lambda lanes, warps: ways)
    monkeypatch.setattr(merge, "MIN_CHUNK_PAGES", min_pages)
    monkeypatch.setattr(merge, "MAX_BLOCK", max_block)
    monkeypatch.setattr(merge, "KEYS_SUB_BLOCK", 16)
    q_dtype = torch.bfloat16 if case is MANY_PAGES_CASE else torch.float32
    result = _check(device, case, q_dtype=q_dtype, tuning=ScoreTuning(select_path="merge"))
    assert result.ok, str(result)


@pytest.mark.parametrize("device", DEVICES)
def test_merge_select_declines_a_budget_its_tile_cannot_hold(device, monkeypatch, caplog):
    """Where chunks x (k - 2) would pass the last program's tile, the chunked path selects (and says so once)."""
    from locks_toolkit.kernels import ops
    from locks_toolkit.kernels.select import merge

    monkeypatch.setattr(merge, "MAX_CANDIDATES", 2)  # k - 2 = 4 candidates a chunk
    monkeypatch.setattr(ops, "_MERGE_DECLINED", set())
    with caplog.at_level("WARNING", logger=ops.log.name):
        result = _check(device, SELECT_CASES[0], tuning=ScoreTuning(select_path="merge"))
    assert result.ok, str(result)
    assert sum("merge selection declines" in r.getMessage() for r in caplog.records) == 1, caplog.text


def test_merge_plan_covers_every_contested_page_within_its_limits():
    """Chunks x block covers the widest table's contested pages, each chunk fits a block, the last program's tile
    fits MAX_CANDIDATES; one wave of programs at most where the table allows; None where k cannot fit."""
    from locks_toolkit.kernels.select.merge import MAX_BLOCK, MAX_CANDIDATES, MIN_CHUNK_PAGES, MergePlan, merge_plan
    from locks_toolkit.kernels.triton_common import cdiv, next_pow2

    for pairs in (1, 4, 16, 128):
        for table_pages in (3, 64, 1030, 2056, 16448, 65600, 131072):
            for k in (4, 16, 128, 512):
                plan = merge_plan(pairs, table_pages, k, num_sms=132, max_chunks=32)
                contested = table_pages - 2
                if plan is None:
                    assert next_pow2(cdiv(contested, MAX_BLOCK)) * next_pow2(k - 2) > MAX_CANDIDATES or \
                        next_pow2(min(32, cdiv(132, pairs), cdiv(contested, MIN_CHUNK_PAGES))) * next_pow2(k - 2) > MAX_CANDIDATES
                    continue
                assert plan.chunks * plan.block >= contested and cdiv(contested, plan.chunks) <= plan.block <= MAX_BLOCK
                assert next_pow2(plan.chunks) * next_pow2(k - 2) <= MAX_CANDIDATES
                if cdiv(contested, MAX_BLOCK) <= 32:
                    assert plan.chunks <= max(1, cdiv(132, pairs), 32)
    assert merge_plan(4, 65600, 128, num_sms=132, max_chunks=32).chunks == 32  # 1M bs1: one program per SM
    assert merge_plan(4, 2056, 128, num_sms=132, max_chunks=32) == MergePlan(9, 256)  # 32K: 9 chunks of <= 256 pages
    assert merge_plan(1, 65600, 2048, num_sms=132, max_chunks=32) is None  # k = 2048 over 17 chunks: 32 x 2048


def test_long_select_cases_run_the_merge_paths_production_shapes():
    """The GPU's long checks (`kernel_checks --select merge --long`) reach what a 132-SM GPU runs at 512K bs1 and
    at 16 pairs: 32 chunks of 1024 pages, and chunks of MAX_BLOCK pages."""
    from locks_toolkit.kernels.checks import LONG_SELECT_CASES
    from locks_toolkit.kernels.config import PAGE_SIZE, cdiv
    from locks_toolkit.kernels.select.merge import MAX_BLOCK, MergePlan, merge_plan

    plans = [merge_plan(len(c.seq_lens) * c.num_kv_heads, cdiv(max(c.seq_lens), PAGE_SIZE), c.page_budget, num_sms=132,
                        max_chunks=32) for c in LONG_SELECT_CASES]
    assert plans == [MergePlan(32, 1024), MergePlan(9, MAX_BLOCK)], plans


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case, coarse_pick, path", [
    (MANY_PAGES_CASE, True, "merge"), (MANY_PAGES_CASE, False, "chunked"),  # each pick on the chunked path
    (G8_D128_CASE, True, "chunked"),
], ids=lambda v: f"G{v.group}-n{sum(v.seq_lens)}" if isinstance(v, SelectCase) else str(v))
def test_fewer_selection_chunks_than_score_chunks_match_reference(device, case, coarse_pick, path):
    """The score grid's chunk normalizers are merged in full when the selection runs over fewer chunks
    (the production default at bs1 on the H200: 128 score chunks, 64 selection chunks); both threshold
    picks (coarse + fine counts, or every count) select the same pages. MANY_PAGES_CASE crowds the threshold
    bin, on bf16 queries (the engine's)."""
    q_dtype = torch.bfloat16 if case is MANY_PAGES_CASE else torch.float32
    result = _check(device, case, q_dtype=q_dtype,
                    tuning=ScoreTuning(select_chunks=3, coarse_pick=coarse_pick, select_path=path))
    assert result.ok, str(result)


@pytest.mark.parametrize("device", DEVICES)
def test_both_select_paths_leave_the_workspace_for_each_other(device):
    """The paths share one workspace: each must leave its histograms and counters zeroed for the others'
    next call (a stale histogram shifts the next threshold bin and changes the selection)."""
    from locks_toolkit.kernels import ops
    from locks_toolkit.kernels.build.packing import SummaryLayout, pack_summaries
    from locks_toolkit.kernels.build.reference import build_page_summaries
    from locks_toolkit.kernels.config import PAGE_SIZE, SummaryFormat

    gen = torch.Generator().manual_seed(fresh_seed())
    seqs, hkv, group, d, k, seq_len = 2, 2, 4, 64, 7, 16 * 41 + 3
    pages = -(-seq_len // PAGE_SIZE)
    layout = SummaryLayout(SummaryFormat.parse("r8i4"), d)
    keys = torch.randn((seqs, hkv, pages, PAGE_SIZE, d), generator=gen)
    packed = pack_summaries(build_page_summaries(keys, layout.rank), layout.fmt)
    rows = packed.permute(0, 2, 1, 3).reshape(seqs * pages, hkv, layout.row_bytes).contiguous().to(device)
    table = torch.arange(seqs * pages, dtype=torch.int32).reshape(seqs, pages).to(device)
    lens = torch.full((seqs,), seq_len, dtype=torch.int32, device=device)
    q = torch.randn((seqs, hkv * group, d), generator=gen).to(device)
    ws = ops.score_select_workspace(seqs, hkv, pages, device, group_size=group)
    picks = []
    chunked = ScoreTuning(select_path="chunked")
    for tuning in (ScoreTuning(), chunked, ScoreTuning(select_path="chunked", coarse_pick=False), ScoreTuning(), chunked,
                   ScoreTuning()):
        selected = torch.full((seqs, hkv, k), -7, dtype=torch.int32, device=device)
        ops.score_select(q, rows, table, lens, selected, layout, k, d**-0.5, workspace=ws, tuning=tuning)
        picks.append(selected.cpu())
    assert all(torch.equal(p, picks[0]) for p in picks[1:]), picks
    assert int(ws.hist.abs().sum()) == 0 and int(ws.low_hist.abs().sum()) == 0
    from locks_toolkit.kernels.score.pages import MAX_CHUNKS
    from locks_toolkit.kernels.select.chunked import counts_width

    assert ws.counts.shape[1] == counts_width(MAX_CHUNKS)
    assert int(ws.counts[:, MAX_CHUNKS].abs().sum()) == 0  # the chunked path's slot counter
    assert int(ws.counts[:, 2 * MAX_CHUNKS + 1].abs().sum()) == 0  # the arrivals of both paths


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", ["merge", "chunked"])
def test_selection_equals_exact_top_k_of_the_kernels_keys_under_heavy_ties(device, path):
    """Every page identical except a few hot ones: the threshold key is shared by hundreds of pages, so
    the selection is decided by tie handling alone. Audited exactly against the top-(k-2) of the
    kernel's own integer keys, ties to the lower page ids (the reference check tolerates 1e-5)."""
    from locks_toolkit.harness.lab.score_sweep import selection_problems
    from locks_toolkit.kernels import ops
    from locks_toolkit.kernels.build.packing import SummaryLayout, pack_summaries
    from locks_toolkit.kernels.build.reference import build_page_summaries
    from locks_toolkit.kernels.config import PAGE_SIZE, SummaryFormat

    gen = torch.Generator().manual_seed(fresh_seed())
    seqs, hkv, group, d, k, seq_len = 2, 2, 4, 64, 9, 16 * 203 + 5
    pages = -(-seq_len // PAGE_SIZE)
    layout = SummaryLayout(SummaryFormat.parse("r8i4"), d)
    q = torch.randn((seqs, hkv * group, d), generator=gen)
    keys = torch.randn((1, 1, 1, PAGE_SIZE, d), generator=gen).expand(seqs, hkv, pages, PAGE_SIZE, d).clone()
    for s in range(seqs):
        for h in range(hkv):
            hot = torch.randperm(pages - 2, generator=gen)[:3] + 1
            keys[s, h, hot] += 0.5 * q[s, h * group : (h + 1) * group].mean(0)
    packed = pack_summaries(build_page_summaries(keys, layout.rank), layout.fmt)
    rows = packed.permute(0, 2, 1, 3).reshape(seqs * pages, hkv, layout.row_bytes).contiguous().to(device)
    table = torch.arange(seqs * pages, dtype=torch.int32).reshape(seqs, pages).to(device)
    lens = torch.full((seqs,), seq_len, dtype=torch.int32, device=device)
    ws = ops.score_select_workspace(seqs, hkv, pages, device, group_size=group)
    selected = torch.full((seqs, hkv, k), -7, dtype=torch.int32, device=device)
    ops.score_select(q.to(device), rows, table, lens, selected, layout, k, d**-0.5, workspace=ws,
                     tuning=ScoreTuning(select_path=path))
    contested = ws.keys[: seqs * hkv, 1 : pages - 1]
    assert bool(((contested == contested.min(dim=1, keepdim=True).values).sum(dim=1) > 100).all())  # the ties at stake
    assert selection_problems(selected, ws.keys, seq_len, k) is None, selected.tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_select_battery_checks_every_requested_path_on_bf16_queries(device):
    """The GPU pre-timing check (`checks --select`): one result per (path, case), bf16 queries, each
    against the reference; a path it was not asked for does not run."""
    from locks_toolkit.kernels.checks import select_battery

    repeat = device != "cpu"
    results = select_battery(device, fresh_seed(), ("chunked", "merge"), cases=[SELECT_CASES[5], SELECT_CASES[6]],
                             second_call=repeat)
    assert len(results) == 4
    assert all(r.ok for r in results), [str(r) for r in results if not r.ok]
    assert sum("select_path='merge'" in r.name for r in results) == 2
    transposed = select_battery(device, fresh_seed(), ("chunked",), cases=[G8_D128_CASE], scorer="transposed",
                                second_call=repeat)
    assert len(transposed) == 1 and transposed[0].ok and "transposed=True" in transposed[0].name, [str(r) for r in transposed]


def test_checks_cli_names_the_paths_when_one_is_unknown():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "locks_toolkit.harness.lab.kernel_checks", "--select", "chunked,fast"],
                         capture_output=True, text=True, env={**__import__("os").environ, "TRITON_INTERPRET": "1"})
    assert out.returncode != 0
    assert "unknown path(s) ['fast']" in out.stderr and "chunked" in out.stderr


G16_CASE = SelectCase((16 * 45 + 9,), group=16, head_dim=128, page_budget=8, num_kv_heads=2)  # M = G: no spare rows
G4_CASE = SelectCase((16 * 33 + 3, 16 * 8), group=4, head_dim=128, page_budget=6, num_kv_heads=2)  # rows 4..15 zero
G2_D256_CASE = SelectCase((16 * 27 + 12,), group=2, head_dim=256, page_budget=6, num_kv_heads=1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tuning", TRANSPOSED_VARIANTS, ids=lambda t: f"tile{t.tile}")
@pytest.mark.parametrize("case", [G8_D128_CASE, G4_CASE, G16_CASE, G2_D256_CASE, SELECT_CASES[3], SELECT_CASES[1]],
                         ids=lambda c: f"G{c.group}-d{c.head_dim}-{c.fmt}-n{sum(c.seq_lens)}")
def test_transposed_scorer_selects_what_the_reference_selects(device, tuning, case):
    """Query heads as the dots' M select what the fp64 reference selects: G = 8 (the spare mma rows carry the
    next term and fold back), G = 4 (zero rows), G = 16 (no spare rows); r2i4 at 2-page tiles (K = P * r < 16)
    and int8 bases fall back to the pages kernel."""
    result = _check(device, case, q_dtype=torch.bfloat16, tuning=tuning)
    assert result.ok, str(result)


def test_transposed_scorer_runs_where_its_dots_fit():
    """int4 words (d/8 >= 16, a power of two) and a contraction K = tile * next_pow2(r) >= 16."""
    (t2,) = TRANSPOSED_VARIANTS
    t4 = ScoreTuning(**{**SCORER_KERNELS["transposed"], "tile": 4})
    fits = lambda tuning, fmt, d: transposed_fits(tuning, RowConstants.of(SummaryLayout(SummaryFormat.parse(fmt), d)), d)
    assert fits(t2, "r8i4", 128) and fits(t2, "r8i4", 256) and fits(t4, "r4i4", 128)
    assert not fits(t2, "r4i4", 128) and not fits(t4, "r2i4", 256)  # K = 8
    assert not fits(t2, "r8i8", 128) and not fits(t2, "r8i4", 64) and not fits(t2, "r8fp", 128)
    assert not fits(ScoreTuning(), "r8i4", 128)  # the pages kernel unless asked


@triton.jit
def _pair_words(words_ptr, q_ptr, codes_ptr, qrows_ptr, M: tl.constexpr, D: tl.constexpr):
    """codes[s, m, k] = _paired_codes(words, 4s)[m, k]; qrows[s, k] = score_t._q_shifts(q)[s][0, k] (the
    transposed kernel's query operands; q repeated in M rows)."""
    m = tl.arange(0, M)
    words = tl.load(words_ptr + m[:, None] * (D // 8) + tl.arange(0, D // 8)[None, :])
    k = tl.arange(0, D // 4)
    for S in tl.static_range(4):
        codes = _paired_codes(words, 4 * S, M, D, tl.float32)
        tl.store(codes_ptr + S * M * (D // 4) + m[:, None] * (D // 4) + k[None, :], codes)
    q = tl.load(q_ptr + 0 * m[:, None] + tl.arange(0, D)[None, :])  # [M, D]
    q0, q1, q2, q3 = _q_shifts(q, M, D)
    first = m[:, None] == 0
    tl.store(qrows_ptr + 0 * (D // 4) + 0 * m[:, None] + k[None, :], q0, mask=first)
    tl.store(qrows_ptr + 1 * (D // 4) + 0 * m[:, None] + k[None, :], q1, mask=first)
    tl.store(qrows_ptr + 2 * (D // 4) + 0 * m[:, None] + k[None, :], q2, mask=first)
    tl.store(qrows_ptr + 3 * (D // 4) + 0 * m[:, None] + k[None, :], q3, mask=first)


@pytest.mark.parametrize("device", DEVICES)
def test_paired_codes_and_query_rows_pair_the_same_dims(device):
    """For every shift, column k of the paired codes and row k of the paired query hold the same head
    dim, so the four dots sum every code times its own query element (dot = reference, exactly)."""
    gen = torch.Generator().manual_seed(fresh_seed())
    M, D = 4, 128
    codes = torch.randint(0, 16, (M, D), generator=gen)  # code of dim d of row m
    words = torch.zeros((M, D // 8), dtype=torch.int64)
    for d in range(D):  # byte b of word j holds dims 8j + 2b (low nibble) and 8j + 2b + 1 (high)
        words[:, d // 8] |= codes[:, d] << (4 * (d % 8))
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    q = torch.randn(D, generator=gen)
    out = torch.full((4, M, D // 4), float("nan"))
    qrows = torch.full((4, D // 4), float("nan"))
    _pair_words[(1,)](words.to(device), q.to(device), out_dev := out.to(device), qr_dev := qrows.to(device), M=M, D=D)
    out, qrows = out_dev.cpu().double(), qr_dev.cpu().double()
    got = sum(out[s] @ qrows[s] for s in range(4))
    want = (codes.double() - 8) @ q.double()
    assert torch.allclose(got, want, rtol=0, atol=1e-9), (got - want).abs().max()
    # each query element appears once over the four shifts
    assert torch.equal(torch.sort(qrows.flatten()).values, torch.sort(q.double()).values)


@pytest.mark.parametrize("device", [d for d in DEVICES if d == "cpu"] or [pytest.param("cpu", marks=pytest.mark.skip(reason="interpreter only"))])
@pytest.mark.parametrize("path", ["merge", "chunked"])
def test_selection_does_not_depend_on_the_order_programs_run_in(device, path):
    """The paths whose last program to arrive finishes the pair (merge) or whose programs share
    counters (chunked), with every launch's programs run in reverse grid order (`reversed_program_order`)."""
    from locks_toolkit.kernels.checks import reversed_program_order

    with reversed_program_order():
        for case in (SELECT_CASES[0], G8_D128_CASE, SELECT_CASES[6]):
            result = _check(device, case, tuning=ScoreTuning(select_path=path))
            assert result.ok, str(result)
