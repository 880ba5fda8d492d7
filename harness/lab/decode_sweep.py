"""Launch-shape sweep of the sparse decode (+ merge) on one GPU: which `DecodeTuning` is fastest, per cell.

    python -m locks_toolkit.harness.lab.decode_sweep --contexts 32k --batch 1 --profile

For each (context, batch) and tuning in VARIANTS it times the decode over the layer copies alone (CUDA graph,
as `locks bench kernel` does), and again between the rest of a decoder layer (`score_sweep.decoder_layer_rest`),
as the engine runs it after products that evict L2: `in_layer_us` = (that chain - the rest alone) per layer.
That difference is noisy (the rest alone varied 137-148 µs between cells on the H200); --profile
adds each kernel's µs per call inside that chain, which is what to compare. Every variant's output on layer 0 is checked
against the fp64 reference first (bf16 tolerance); a variant that fails is reported, not timed.
The pages attended are sink + recent + random others, sorted, as a selection writes them.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import asdict

import torch

from ...kernels import ops
from ...kernels.build.packing import SummaryLayout
from ...kernels.checks import BF16_DECODE_TOLERANCE
from ...kernels.config import SelectionConfig, SummaryFormat
from ...kernels.decode.kernel import DEFAULT_DECODE, TWO_PAGE_DECODE, DecodeTuning
from ...kernels.decode.reference import paged_decode_reference
from ..provenance import collect, reproduce_command
from ..workload import format_size, parse_size_list
from .graph_timing import time_graph
from .kernel_bench import (
    _ContextState,
    add_sweep_arguments,
    pick_variants,
    resolve_geometry,
    sweep_contexts,
    variant_error,
)
from .score_sweep import decoder_layer_rest, profile_graph

SCHEMA_DECODE_SWEEP = "locks.decode_sweep/1"


VARIANTS = (
    # two 2-page iterations per program over 32 splits (128 programs at bs1, b=2048), Triton's 3 stages;
    # the merge reads a split's partial output only after its lse (the earlier default)
    TWO_PAGE_DECODE,
    DecodeTuning(pages_per_iter=2, warps=4),  # the merge's two loads issued together
    DecodeTuning(pages_per_iter=2, warps=4, stages=1),  # the same two iterations without software pipelining
    # one iteration per program: one slot -> block table -> K/V chain instead of two
    DecodeTuning(warps=4),
    DecodeTuning(warps=4, stages=1),
    DecodeTuning(stages=1),
    DecodeTuning(pages_per_iter=2, max_splits=64, warps=4, stages=1),  # 256 programs of one 2-page iteration
    DecodeTuning(pages_per_iter=8, max_splits=16, warps=4, stages=1),  # 64 programs of one 8-page iteration
    DecodeTuning(pages_per_iter=1, max_splits=128, waves=4, warps=4, stages=1),  # 512 programs of one page
    # around the best of the shapes above (4.9 + 2.5 µs against 5.8 + 2.6 in a layer at 32K)
    DecodeTuning(pages_per_iter=2, max_splits=64, warps=4),
    DecodeTuning(pages_per_iter=2, max_splits=64, warps=4, stages=2),
    DecodeTuning(pages_per_iter=2, max_splits=64, stages=1),
    DEFAULT_DECODE,  # 4 pages per iteration, 8 warps, 3 stages: the default
    DecodeTuning(pages_per_iter=2, max_splits=64, warps=2, stages=1),
)


def attended_pages(batch: int, num_kv_heads: int, pages: int, k_pages: int, gen: torch.Generator) -> torch.Tensor:
    """int32 [batch, Hkv, k]: sink, k-2 random pages between, the recent page; ascending, as a selection writes them."""
    rows = []
    for _ in range(batch * num_kv_heads):
        middle = (torch.randperm(pages - 2, generator=gen)[: k_pages - 2] + 1).sort().values
        rows.append(torch.cat((torch.tensor([0]), middle, torch.tensor([pages - 1]))))
    return torch.stack(rows).to(torch.int32).reshape(batch, num_kv_heads, k_pages)


def sweep_cell(geom, state: _ContextState, batch: int, budget_tokens: int, replays: int, variants=VARIANTS,
               profile: bool = False, gen: torch.Generator | None = None) -> list[dict]:
    """The rows of one (context, batch) cell: each tuning in `variants` checked against the fp64 reference on
    layer 0, then timed alone and inside the decoder-layer chain (module docstring)."""
    k_pages = min(SelectionConfig(budget_tokens=budget_tokens).page_budget, state.pages)
    scale = geom.head_dim**-0.5
    dev = "cuda"
    q = torch.randn((batch, geom.num_q_heads, geom.head_dim), device=dev, dtype=torch.bfloat16)
    bt = state.block_table[:batch]
    seq_lens = torch.full((batch,), state.seq_len, dtype=torch.int32, device=dev)
    selected = attended_pages(batch, geom.num_kv_heads, state.pages, k_pages, gen or torch.Generator().manual_seed(0)).to(dev)
    reference = paged_decode_reference(q.double(), state.k[0].double(), state.v[0].double(), bt, seq_lens, scale, selected.long())
    rest, _ = decoder_layer_rest(geom, batch, dev)
    out = torch.empty_like(q)

    def rest_alone():
        for _ in state.k:
            rest(out)

    rest_us = time_graph(rest_alone, replays, state.copies)["mean_us"]
    rows = []
    for tuning in variants:
        ws = ops.decode_workspace(batch, geom.num_q_heads, geom.head_dim, dev, num_splits=tuning.max_splits)
        row = {"tuning": asdict(tuning), "context_tokens": state.seq_len - 1, "batch_size": batch, "page_budget": k_pages,
               "splits": ops.decode_splits(batch, geom.num_kv_heads, k_pages, ws, torch.cuda.current_device(), tuning)}

        def decode(k, v, tuning=tuning, ws=ws):
            ops.sparse_paged_decode(q, k, v, bt, seq_lens, selected, scale, out, ws, tuning=tuning)

        try:
            out.fill_(float("nan"))
            decode(state.k[0], state.v[0])
            err = (out.double() - reference).abs()
            row["max_error"] = float(err.nan_to_num(float("inf")).max())
            if not bool((err <= BF16_DECODE_TOLERANCE + BF16_DECODE_TOLERANCE * reference.abs()).all()):
                row.update(status="wrong", reason=f"max |out - ref| = {row['max_error']:.3g}")
                rows.append(row)
                continue

            def alone(decode=decode):
                for k, v in zip(state.k, state.v):
                    decode(k, v)

            def in_layer(decode=decode):
                for k, v in zip(state.k, state.v):
                    decode(k, v)
                    rest(out)

            timing = time_graph(alone, replays, state.copies)
            row.update(status="ok", alone_us=timing["mean_us"], sd_us=timing["sd_us"], rest_us=rest_us,
                       in_layer_us=time_graph(in_layer, replays, state.copies)["mean_us"] - rest_us)
            if profile:
                row["kernel_us"] = profile_graph(in_layer, replays, state.copies)
        except Exception as exc:  # noqa: BLE001 - a variant that fails to compile or run is reported, not fatal
            row.update(variant_error(tuning, exc))
        rows.append(row)
    return rows


def _shape(t: dict) -> str:
    return (f"{t['pages_per_iter']} pages/iter, ≤ {t['max_splits']} splits, {t['warps']} warps, {t['stages']} stages"
            + (", eager merge" if t["merge_eager"] else ""))


def markdown(rows: list[dict]) -> str:
    lines = ["| context | bs | decode tuning | splits | alone µs | in a layer µs (the rest alone) | max error | µs per kernel in the layer |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = f"| {format_size(r['context_tokens'])} | {r['batch_size']} | {_shape(r['tuning'])} | {r['splits']} "
        if r["status"] != "ok":
            lines.append(head + f"| {r['status']}: {r.get('reason', '')[:60]} | — | — | — |")
            continue
        kernels = ", ".join(f"{name[:28]} {us:.1f}" for name, us in r.get("kernel_us", {}).items()
                            if "decode" in name or "merge" in name)
        lines.append(head + f"| {r['alone_us']:.2f} ± {r['sd_us']:.2f} | {r['in_layer_us']:.2f} ({r['rest_us']:.1f}) "
                     f"| {r['max_error']:.2g} | {kernels or '—'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Sweep the Locks sparse decode's launch shape.")
    add_sweep_arguments(parser, contexts="32k", batch="1")
    parser.add_argument("--pick", default=None, help="time only these VARIANTS indices (comma-separated)")
    parser.add_argument("--profile", action="store_true", help="also each kernel's µs per call inside the layer chain")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        chosen = pick_variants(args.pick, VARIANTS)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: the decode sweep needs a CUDA GPU; run it on the H200 machine", file=sys.stderr)
        return 2
    geom = resolve_geometry(args.preset)
    layout = SummaryLayout(SummaryFormat.parse("r8i4"), geom.head_dim)  # _ContextState builds summaries; the decode ignores them
    gen = torch.Generator().manual_seed(1)  # the attended pages
    rows = sweep_contexts(geom, layout, parse_size_list(args.contexts), parse_size_list(args.batch),
                          collect(reproduce_command(), schema=SCHEMA_DECODE_SWEEP), args.out,
                          lambda state, batch: sweep_cell(geom, state, batch, args.budget, args.replays, chosen, args.profile, gen))
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
