"""Launch-shape sweep of the Locks score kernel on one GPU: which ScoreTuning is fastest, per cell.

    python -m locks_toolkit.harness.lab.score_sweep --contexts 32k,128k --batch 1,8

For each (context, batch) it times the score kernel alone (CUDA graph over layer copies, as `locks
bench kernel` does) under every tuning in VARIANTS, the selection alone, and both chained layer by
layer (as the engine runs them), runs the selection on each variant's scores,
and refuses a variant whose selected pages differ from the default's (launch shape may change
fp32 summation order, never the result). Prints a markdown table; --out appends JSON records.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import asdict

import torch

from ...kernels import ops
from ...kernels.build.packing import SummaryLayout
from ...kernels.config import PAGE_SIZE, SelectionConfig, SummaryFormat
from ...kernels.score.pages import DEFAULT_TUNING, SCORER_KERNELS, ScoreTuning
from ..provenance import collect, reproduce_command
from ..workload import format_size, parse_size_list
from .graph_timing import capture_graph, time_graph
from .kernel_bench import (
    _ContextState,
    add_sweep_arguments,
    pick_variants,
    resolve_geometry,
    sweep_contexts,
    variant_error,
)

SCHEMA_SCORE_SWEEP = "locks.score_sweep/1"


VARIANTS = (
    # The kernel-level default: one warp per program over 4-page tiles, every program slot at bs1 (512
    # chunks), coefficients contracted on the tensor cores, 32-bit-word int4 decode, one vector load per token's
    # coefficients; selection in one launch (select/merge.py)
    DEFAULT_TUNING,
    ScoreTuning(select_path="chunked"),  # selection in three launches (what merge declines runs this)
    # A wide launch shape: 4 warps x 16 pages, 128 chunks, FMA coefficient contraction
    ScoreTuning(warps=4, tile=16, max_chunks=128, coef_mma=False),
    ScoreTuning(coef_mma=False),  # one warp, FMA contraction (37.8 us at 128K on the H200)
    ScoreTuning(maxnreg=112),  # 18 programs per SM (the kernel uses 108 registers)
    ScoreTuning(tile=8, maxnreg=168),  # no spills at 160 registers; 12 programs per SM
    ScoreTuning(warps=2, tile=8, max_chunks=256),
    ScoreTuning(stages=2, coef_mma=False),  # 40.4 us at 128K
    ScoreTuning(select_path="chunked", coarse_pick=False),  # every threshold pick scans all 8192 histogram counts
    ScoreTuning(select_path="chunked", select_chunks=16),
    ScoreTuning(word_nibbles=False),  # int4 codes decoded per byte
    ScoreTuning(coef_vector=False),  # one load per coefficient
    ScoreTuning(mantissa_nibbles=False, word_nibbles=False),  # int-to-float conversion of the codes
    # Query heads as the dots' M (`score_t.py`): V^T q stays in registers; 1456 SASS per 4-page tile
    ScoreTuning(**{**SCORER_KERNELS["transposed"], "tile": 4}),  # 27.9 / 12.2 µs at 128K / 32K
    ScoreTuning(**{**SCORER_KERNELS["transposed"], "tile": 4, "stages": 2}),  # the next tile's loads through cp.async: 29.0 / 13.1
    ScoreTuning(**SCORER_KERNELS["transposed"]),  # 2-page tiles: half the block-diagonal zeros; 25.8 / 8.9
    # 21 programs per SM (no spills), grid still 512 per pair. A grid that fills them (693 chunks, with a
    # workspace of 1024) took 31.6 µs at 128K against 26.0, so the workspace stayed at 512 chunks.
    ScoreTuning(maxnreg=96, **SCORER_KERNELS["transposed"]),
    ScoreTuning(stages=2, **SCORER_KERNELS["transposed"]),
    # The CUDA kernel (kernels/score/score_t.cu): operands built in the mma register layouts, 4-page tiles,
    # (int8 mma for V^T q, rows by bulk copies into shared memory): ~575 SASS per tile against the transposed
    # kernel's ~800 per 2 pages
    ScoreTuning(**SCORER_KERNELS["cuda"]),
    # The chunked selection over 2x / 4x the programs. With four launches 64 chunks was 2.2 µs ahead at 1M bs1
    # and 1.6 behind at 256K; each launch's pick is now made once, by its last program, not by every program
    ScoreTuning(select_path="chunked", select_chunks=64, **SCORER_KERNELS["cuda"]),
    ScoreTuning(select_path="chunked", select_chunks=128, **SCORER_KERNELS["cuda"]),
)


def mean_kernel_us(kernels: list[tuple[str, float]], calls: int) -> dict[str, float]:
    """{kernel name: µs per call} from (name, device µs) of every kernel a profile saw over `calls` calls, in
    first-seen order: which launch of a chain takes the time (the graph timing gives only the chain's sum)."""
    totals: dict[str, float] = {}
    for name, us in kernels:
        totals[name] = totals.get(name, 0.0) + us
    return {name: round(total / calls, 2) for name, total in totals.items()}


def profile_graph(fn, replays: int, calls_per_replay: int) -> dict[str, float]:
    """`mean_kernel_us` of fn's kernels under torch.profiler over graph replays (CUPTI times each node)."""
    from torch.autograd import DeviceType

    graph = capture_graph(fn)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    kernels = [(e.name, e.time_range.end - e.time_range.start) for e in prof.events() if e.device_type == DeviceType.CUDA]
    return mean_kernel_us(kernels, replays * calls_per_replay)


# --between-layers mlp: the weight a bs-1 MLP-sized product streams between two layers' score + select (hidden
# x MLP_WIDTH_FACTOR hidden, bf16: ~200 MB at hidden 4096). Like the engine's GEMMs, it fills every SM and
# evicts L2 between layers, which a chain of score + select alone does not.
MLP_WIDTH_FACTOR = 6
BETWEEN_KINDS = ("mlp", "layer")


def decoder_layer_rest(geom, batch: int, device):
    """(rest(attn_out [batch, Hq, d] bf16) -> its last output, ffn width): what a GLM-4-9B-like decoder layer runs
    after attention at bs `batch`: the output product, RMS norms, gate-up and down products (GLM-4-9B's widths,
    scaled with the hidden size) and their elementwise ops, then the next layer's QKV product."""
    hidden = geom.num_q_heads * geom.head_dim
    bf16 = torch.bfloat16
    x = torch.randn((batch, hidden), device=device, dtype=bf16)
    ffn = 13696 * hidden // 4096  # GLM-4-9B's intermediate size, scaled with the hidden size
    kv = 2 * geom.num_kv_heads * geom.head_dim
    w_qkv = torch.randn((hidden, hidden + kv), device=device, dtype=bf16) * 0.02
    w_o = torch.randn((hidden, hidden), device=device, dtype=bf16) * 0.02
    w_up = torch.randn((hidden, 2 * ffn), device=device, dtype=bf16) * 0.02
    w_down = torch.randn((ffn, hidden), device=device, dtype=bf16) * 0.02
    norm = torch.ones(hidden, device=device, dtype=bf16)

    def rest(attn_out):
        h = torch.matmul(attn_out.reshape(batch, hidden), w_o) + x
        h = torch.nn.functional.rms_norm(h, (hidden,), norm)
        gate, up = torch.matmul(h, w_up).chunk(2, dim=-1)
        h = h + torch.matmul(torch.nn.functional.silu(gate) * up, w_down)
        qkv = torch.matmul(torch.nn.functional.rms_norm(h, (hidden,), norm), w_qkv)
        return qkv.mul_(1.0001).add_(0.5)  # stands in for the rotary embedding's elementwise kernel

    return rest, ffn


def between_layers_work(kind: str, geom, batch: int, q: torch.Tensor, state: _ContextState, bt, seq_lens):
    """(work(rows index, selected) -> its last output, description): what runs after each layer's score + select in the chain.
    "mlp": one MLP-sized product (MLP_WIDTH_FACTOR). "layer": the rest of a decoder layer as the engine runs
    it, so as many distinct kernels pass through the SMs as there: the sparse decode + merge over the
    selected pages, then `decoder_layer_rest`. On the H200 the loop tail took 18.0 µs between "mlp" products
    and 24.4 in the engine, where the four-launch kernels matched the sweep to 0.1 µs."""
    hidden = geom.num_q_heads * geom.head_dim
    dev, bf16 = q.device, torch.bfloat16
    if kind == "mlp":
        x = torch.randn((batch, hidden), device=dev, dtype=bf16)
        weight = torch.randn((hidden, MLP_WIDTH_FACTOR * hidden), device=dev, dtype=bf16)
        out = torch.empty((batch, MLP_WIDTH_FACTOR * hidden), device=dev, dtype=bf16)
        return (lambda i, selected: torch.matmul(x, weight, out=out)), f"hidden x {MLP_WIDTH_FACTOR} hidden product"
    rest, ffn = decoder_layer_rest(geom, batch, dev)
    attn_out = torch.empty((batch, geom.num_q_heads, geom.head_dim), device=dev, dtype=bf16)
    dws = ops.decode_workspace(batch, geom.num_q_heads, geom.head_dim, dev)
    scale = geom.head_dim**-0.5

    def layer(i, selected):
        ops.sparse_paged_decode(q, state.k[i], state.v[i], bt, seq_lens, selected, scale, attn_out, dws)
        return rest(attn_out)

    return layer, f"sparse decode + a GLM-4-9B-like decoder layer (ffn {ffn})"


def sweep_cell(geom, layout, state: _ContextState, batch: int, budget_tokens: int, replays: int,
               variants=VARIANTS, flat: bool = False, table_pages: int = 0, profile: bool = False,
               query_scale: float = 1.0, between_layers: str | None = None, select_repeats: int = 1) -> list[dict]:
    """flat: zero queries, so every page scores the same and every key ties (the select path's worst case).
    query_scale: queries times this; a small one (1e-5 .. 3e-2) gives near-tied keys, which crowd the
    threshold bin without tying it (what dummy-weight attention may look like; 1e-5, 1e-3 and 3e-2 have been timed).
    table_pages: block-table width (and workspace pages) when wider than the context's, as in an engine
    whose max_model_len exceeds the context: launch shapes follow the width, not the live pages.
    profile: also each kernel's µs per call (`profile_graph`), after the timings.
    between_layers: also the chain with other work after each layer (`between_layers_work`: "mlp" or
    "layer"), as the engine interleaves them: `in_chain_us` = (that chain - the work alone) per layer, and
    with profile `chain_kernel_us`, each kernel's µs inside it (on the H200 the one-launch selection took
    ~13 µs per layer more in the engine at 128K than alone, on the same keys).
    select_repeats: in that chain, launch the selection this many times per layer; `chain_kernel_us` then sums
    them. The later launches find the selection's code and data warm, so the sum against repeats x the first
    launch's time shows how much of that time is cold caches."""
    k_pages = SelectionConfig(budget_tokens=budget_tokens).page_budget
    scale = geom.head_dim**-0.5
    q = torch.randn((batch, geom.num_q_heads, geom.head_dim), device="cuda", dtype=torch.bfloat16)
    if flat:
        q.zero_()
    q.mul_(query_scale)
    bt = state.block_table[:batch]
    if table_pages > bt.shape[1]:
        bt = torch.nn.functional.pad(bt, (0, table_pages - bt.shape[1])).contiguous()
    seq_lens = torch.full((batch,), state.seq_len, dtype=torch.int32, device="cuda")
    ws = ops.score_select_workspace(batch, geom.num_kv_heads, bt.shape[1], "cuda", group_size=geom.group)
    if between_layers:
        work, work_what = between_layers_work(between_layers, geom, batch, q, state, bt, seq_lens)
        # alone, the work attends pages 0..k-1 of every pair: as many pages as any selection
        first_pages = torch.arange(k_pages, dtype=torch.int32, device="cuda").expand(batch, geom.num_kv_heads, k_pages).contiguous()

        def work_alone():
            for i in range(len(state.rows)):
                work(i, first_pages)

        work_us = time_graph(work_alone, replays, state.copies)["mean_us"]
    rows_out = []
    reference = None
    for tuning in variants:
        row = {"tuning": asdict(tuning), "context_tokens": state.seq_len - 1, "batch_size": batch, "table_pages": bt.shape[1]}
        try:
            chunks = ops._launch_score(q, state.rows[0], bt, seq_lens, layout, scale, geom.num_kv_heads, ws, tuning)
            selected = torch.empty((batch, geom.num_kv_heads, k_pages), dtype=torch.int32, device="cuda")
            ops._launch_select(ws, seq_lens, selected, geom.group, chunks, "share_average", k_pages, tuning)
            if reference is None:
                reference = selected.clone()
            row["same_selection"] = bool(torch.equal(selected, reference))
            row["selection_problems"] = selection_problems(selected, ws.keys, state.seq_len, k_pages)

            def score(tuning=tuning):
                for rows in state.rows:
                    ops._launch_score(q, rows, bt, seq_lens, layout, scale, geom.num_kv_heads, ws, tuning)

            def select(chunks=chunks, selected=selected, tuning=tuning):
                for _ in state.rows:
                    ops._launch_select(ws, seq_lens, selected, geom.group, chunks, "share_average", k_pages, tuning)

            def chained(chunks=chunks, selected=selected, tuning=tuning):  # layer by layer, as the engine runs them
                for rows in state.rows:
                    ops._launch_score(q, rows, bt, seq_lens, layout, scale, geom.num_kv_heads, ws, tuning)
                    ops._launch_select(ws, seq_lens, selected, geom.group, chunks, "share_average", k_pages, tuning)

            timing = time_graph(score, replays, state.copies)
            row.update(chunks=chunks, mean_us=timing["mean_us"], sd_us=timing["sd_us"], status="ok", flat=flat, query_scale=query_scale,
                       select_us=time_graph(select, replays, state.copies)["mean_us"],
                       chained_us=time_graph(chained, replays, state.copies)["mean_us"])
            if profile:
                row["kernel_us"] = {**profile_graph(score, replays, state.copies), **profile_graph(select, replays, state.copies)}
            if between_layers:
                def chain_with_work(chunks=chunks, selected=selected, tuning=tuning):
                    for i, rows in enumerate(state.rows):
                        ops._launch_score(q, rows, bt, seq_lens, layout, scale, geom.num_kv_heads, ws, tuning)
                        for _ in range(select_repeats):
                            ops._launch_select(ws, seq_lens, selected, geom.group, chunks, "share_average", k_pages, tuning)
                        work(i, selected)

                with_work = time_graph(chain_with_work, replays, state.copies)["mean_us"]
                # `mlp_us` (the work alone) keeps its first name: records and the table read it
                repeats = "" if select_repeats == 1 else f"; the selection launched {select_repeats} times per layer"
                row.update(mlp_us=work_us, in_chain_us=with_work - work_us, between=between_layers, between_what=work_what + repeats,
                           select_repeats=select_repeats)
                if profile:
                    row["chain_kernel_us"] = profile_graph(chain_with_work, replays, state.copies)
        except Exception as exc:  # noqa: BLE001 - a variant that fails to compile or run is reported, not fatal
            row.update(variant_error(tuning, exc))
        rows_out.append(row)
    return rows_out


def selection_problems(selected: torch.Tensor, keys: torch.Tensor, seq_len: int, k_pages: int) -> str | None:
    """Selection vs the kernel's own fixed-point keys: sink + recent + the top-(k-2) contested pages
    (ties to the lower page id), ascending. Independent of fp32 score differences between variants."""
    pairs = selected.shape[0] * selected.shape[1]
    recent = -(-seq_len // PAGE_SIZE) - 1
    got = selected.reshape(pairs, k_pages).long()
    contested = keys[:pairs, 1:recent].long()
    order = torch.sort(-contested, dim=1, stable=True).indices[:, : k_pages - 2] + 1
    want = torch.cat([torch.zeros((pairs, 1), dtype=torch.long, device=got.device), torch.sort(order, dim=1).values,
                      torch.full((pairs, 1), recent, dtype=torch.long, device=got.device)], dim=1)
    bad = (got != want).any(dim=1)
    if not bool(bad.any()):
        return None
    first = int(torch.nonzero(bad)[0])
    return f"{int(bad.sum())}/{pairs} pairs differ from top-k of the kernel's keys (first: pair {first})"


def _nibble_path(tuning: dict) -> str:
    """How the tile is decoded and contracted: int4 codes (words, '+pairs' side by side in K (records of the
    removed lean kernel) / mantissa bytes / int-to-float), '+vec' for vector coefficient loads, '+mma'
    for the tensor-core contraction ('/2t': two bf16 terms), '+exp2' the log2 epilogue, '+o32' 32-bit offsets."""
    codes = "words" if tuning.get("word_nibbles") else "mantissa" if tuning["mantissa_nibbles"] else "i2f"
    return (codes + ("+pairs" if tuning.get("word_pairs") and tuning.get("word_nibbles") else "")
            + ("+vec" if tuning.get("coef_vector") else "") + ("+mma" if tuning.get("coef_mma") else "")
            + ("/2t" if tuning.get("coef_terms") == 2 else "") + ("+exp2" if tuning.get("exp2_epilogue") else "")
            + ("+T" if tuning.get("transposed") else "")
            + ("+o32" if tuning.get("narrow_offsets") else "")
            + ("+prefetch" if tuning.get("prefetch") else ""))  # tile t+1's loads issued early (removed: slower)


def _one_launch_tail(tuning: dict) -> str:
    """The one-launch path's tail a record ran: records of the removed register and memory tails carry
    `select_tail` (or, older, `register_select`, absent meaning registers); since those went, a record
    carries neither but has `tail_block`, and its tail is the loops."""
    if tuning.get("select_tail"):
        return tuning["select_tail"]
    if "register_select" in tuning:
        return "registers" if tuning["register_select"] else "memory"
    return "loops" if "tail_block" in tuning else "registers"


def _select_path(tuning: dict) -> str:
    chunks = f"≤ {tuning.get('select_chunks', 64)} chunks"
    # The oldest records carry row_select (True: the row path) instead of select_path.
    name = tuning.get("select_path") or ("row" if tuning.get("row_select") else "four")
    path = {"row": "row (2 launches)", "four": f"4 launches, {chunks}", "three": f"3 launches, {chunks}",
            "chunked": f"3 launches, {chunks}", "merge": "1 launch, chunk lists merged",
            "one": f"1 launch, {chunks}"}[name]
    if name == "one":
        tail = _one_launch_tail(tuning)
        path += f", {tail} tail" + (f" of {tuning['tail_block']}" if tuning.get("tail_block") else "")
    if name == "merge":
        return path
    return path + ("" if tuning.get("coarse_pick", False) else ", full-scan pick")


def markdown(rows: list[dict]) -> str:
    lines = ["| context | bs | warps | maxnreg | tile | stages | decode | select path | chunks | score µs | select µs | score + select chained µs | same selection |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t = r["tuning"]
        head = (f"| {format_size(r['context_tokens'])} | {r['batch_size']} | {t['warps']} | {t['maxnreg']} | {t['tile']} "
                f"| {t['stages']} | {_nibble_path(t)} | {_select_path(t)} ")
        if r["status"] != "ok":
            lines.append(head + f"| — | {r['status']}: {r['reason'][:60]} | — | — | — |")
        else:
            check = "ok" if r["selection_problems"] is None else r["selection_problems"]
            chained = f"{r['chained_us']:.1f}" if "chained_us" in r else "—"  # the oldest records lack it
            lines.append(head + f"| {r['chunks']} | {r['mean_us']:.1f} ± {r['sd_us']:.1f} | {r['select_us']:.1f} | {chained} "
                         f"| {r['same_selection']} ({check}) |")
    chained_mlp = [r for r in rows if "in_chain_us" in r]
    if chained_mlp:  # score + select between other work (`between_layers_work`), as the engine runs them
        lines += ["", "| context | variant (score, select path) | work between layers | score + select in that chain µs "
                  "(the work alone) | µs per kernel in that chain |", "|---|---|---|---|---|"]
        for r in chained_mlp:
            t = r["tuning"]
            kernels = ", ".join(f"{name[:40]} {us:.1f}" for name, us in r.get("chain_kernel_us", {}).items())
            work = r.get("between_what", "MLP-sized product")  # older records ran only that
            lines.append(f"| {format_size(r['context_tokens'])} | {_nibble_path(t)}, {_select_path(t)} | {work} "
                         f"| {r['in_chain_us']:.1f} ({r['mlp_us']:.1f}) | {kernels or '—'} |")
    profiled = [r for r in rows if r.get("kernel_us")]
    if profiled:  # where each chain's time goes, per launch
        lines += ["", "| context | variant (score, select path) | µs per kernel (profiler, graph replays) |", "|---|---|---|"]
        for r in profiled:
            t = r["tuning"]
            kernels = ", ".join(f"{name} {us:.1f}" for name, us in r["kernel_us"].items())
            lines.append(f"| {format_size(r['context_tokens'])} | {_nibble_path(t)}, {_select_path(t)} | {kernels} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Sweep the Locks score kernel's launch shape.")
    add_sweep_arguments(parser, contexts="32k,128k", batch="1,8")
    parser.add_argument("--format", dest="summary_format", default="r8i4")
    parser.add_argument("--variants", type=int, default=len(VARIANTS), help="time only the first N of VARIANTS")
    parser.add_argument("--pick", default=None, help="time only these VARIANTS indices (comma-separated; overrides --variants)")
    parser.add_argument("--profile", action="store_true", help="also each kernel's µs per call (torch.profiler over graph replays)")
    parser.add_argument("--flat", action="store_true", help="zero queries: every key ties (dummy-weight engines)")
    parser.add_argument("--query-scale", type=float, default=1.0,
                        help="scale the random queries (1e-3: near-tied keys, as a dummy-weight engine gives them)")
    parser.add_argument("--between-layers", nargs="?", const="mlp", default=None, choices=BETWEEN_KINDS,
                        help="also time score + select with other work after each layer, as the engine runs them: "
                             "mlp (an MLP-sized product; the default) or layer (sparse decode + a decoder layer's ops)")
    parser.add_argument("--table-pages", type=int, default=0, help="block-table width (an engine's max_model_len / 16)")
    parser.add_argument("--select-repeats", type=int, default=1,
                        help="with --between-layers: launch the selection this many times per layer (cold vs warm caches)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        chosen = pick_variants(args.pick, VARIANTS) if args.pick else list(VARIANTS[: args.variants])
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.select_repeats < 1:
        print(f"error: --select-repeats must be >= 1, got {args.select_repeats}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: the score sweep needs a CUDA GPU; run it on the H200 machine", file=sys.stderr)
        return 2
    geom = resolve_geometry(args.preset)
    layout = SummaryLayout(SummaryFormat.parse(args.summary_format), geom.head_dim)

    def measure(state, batch):
        return sweep_cell(geom, layout, state, batch, args.budget, args.replays, chosen, args.flat, args.table_pages, args.profile,
                          args.query_scale, args.between_layers, args.select_repeats)

    rows = sweep_contexts(geom, layout, parse_size_list(args.contexts), parse_size_list(args.batch),
                          collect(reproduce_command(), schema=SCHEMA_SCORE_SWEEP), args.out, measure)
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
