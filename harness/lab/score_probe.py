"""Where the CUDA score kernel's time goes: the deployed kernel against variants that take one thing away.

    python -m locks_toolkit.harness.lab.score_probe --contexts 256k,512k,1m --batch 1 --cells 32k:16 --out probe.jsonl

Per (context, batch) cell it times, as `locks bench kernel` does (a CUDA graph over layer copies, µs per call):
the deployed launch; the rows streamed without the arithmetic (`SCORE_PROBE=1`) and the arithmetic without the
copies (`SCORE_PROBE=2`); other stage counts; twice and half the deployed program count; 20 warps an SM (five
programs) instead of 16; the rows of each sequence in block order (a fresh engine allocates a long prompt's blocks
mostly in order, the bench at random);
and a torch reduction over the same rows buffer (a read-only stream of about the kernel's bytes: what a plain
streaming kernel attains at this size, its launch included). Every time comes with its byte floor at the
measured copy bandwidth. Variants that change only the launch shape are checked against the deployed scores.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict, dataclass

import torch

from ...kernels import ops
from ...kernels.build.packing import SummaryLayout
from ...kernels.config import SummaryFormat
from ...kernels.score import cuda as cuda_score
from ...kernels.score.pages import DEFAULT_TUNING, MAX_CHUNKS
from ...kernels.triton_common import RowConstants
from ..bandwidth import copy_bandwidth_bytes_per_s
from ..provenance import collect, reproduce_command
from ..store import append_record
from ..workload import format_size, parse_size_list
from .graph_timing import time_graph
from .kernel_bench import KernelBenchConfig, _ContextState, resolve_geometry, selection_inputs, stage_bytes

log = logging.getLogger(__name__)

SCHEMA_SCORE_PROBE = "locks.score_probe/1"


@dataclass(frozen=True)
class ProbeVariant:
    """One way of launching the score kernel: extra macros, a program-count factor, the block order."""

    name: str
    defines: tuple[tuple[str, int], ...] = ()
    chunk_factor: float = 1.0
    blocks_in_order: bool = False
    exact: bool = True  # its scores must equal the deployed kernel's (launch shape only)

    def programs(self, deployed: int) -> int:
        """Programs per pair: the deployed count times the factor, within the workspace's capacity."""
        return max(1, min(MAX_CHUNKS, round(deployed * self.chunk_factor)))

    def table(self, block_table: torch.Tensor) -> torch.Tensor:
        """The block table this variant reads: the bench's, or each row's blocks in ascending order."""
        return torch.sort(block_table, dim=1).values.contiguous() if self.blocks_in_order else block_table


VARIANTS = (
    ProbeVariant("deployed"),
    ProbeVariant("loads_only", (("SCORE_PROBE", 1),), exact=False),
    ProbeVariant("math_only", (("SCORE_PROBE", 2),), exact=False),
    ProbeVariant("stages_3", (("STAGES", 3),)),
    ProbeVariant("stages_4", (("STAGES", 4),)),
    ProbeVariant("programs_x2", chunk_factor=2.0),
    ProbeVariant("programs_half", chunk_factor=0.5),
    ProbeVariant("blocks_in_order", blocks_in_order=True, exact=False),  # other rows per page: other scores
    ProbeVariant("loads_only_in_order", (("SCORE_PROBE", 1),), blocks_in_order=True, exact=False),
    # 20 warps an SM (registers capped at 102; G <= 8 needs 100) and a fifth program an SM: more warps to overlap
    # one warp's arithmetic with another's loads
    ProbeVariant("warps_20", (("MIN_WARPS_PER_SM", 20),), chunk_factor=1.25),
    # Why a third stage slows the kernel (49.2 against 47.1 µs at 512K bs1 on the H100): whether the loads alone
    # gain from a second tile in flight, or the arithmetic alone loses to the larger shared-memory footprint (neither:
    # only the two together lose, docs/results/score-probe-h100.md)
    ProbeVariant("loads_only_stages_3", (("SCORE_PROBE", 1), ("STAGES", 3)), exact=False),
    ProbeVariant("math_only_stages_3", (("SCORE_PROBE", 2), ("STAGES", 3)), exact=False),
    # Whether the arithmetic alone is latency-bound (faster with more warps an SM) or throughput-bound
    ProbeVariant("math_only_warps_20", (("SCORE_PROBE", 2), ("MIN_WARPS_PER_SM", 20)), chunk_factor=1.25, exact=False),
    # What a change would be worth before it is built: the scales as three aligned 32-bit pairs a page (12 fewer
    # shared loads a tile, as a [token, column, centroid] scale order would allow: docs/lease/candidates/), no digit
    # conversion of q, and no ex2 / lg2 in the log-sum-exp
    ProbeVariant("scale_pairs", (("SCORE_PROBE", 3),), exact=False),
    ProbeVariant("q_raw", (("SCORE_PROBE", 4),), exact=False),
    ProbeVariant("no_mufu", (("SCORE_PROBE", 5),), exact=False),
)


def deployed_chunks(pairs: int, table_pages: int) -> int:
    """The program count per pair that `ops._launch_score` gives the CUDA kernel."""
    return ops.score_grid_chunks(pairs, table_pages, torch.cuda.get_device_properties(0).multi_processor_count,
                                 cuda_score.PROGRAMS_PER_SM, cuda_score.TILE_PAGES * cuda_score.WARPS,
                                 DEFAULT_TUNING.max_chunks)


def probe_cell(geom, layout: SummaryLayout, state: _ContextState, batch: int, replays: int, bandwidth: float) -> list[dict]:
    """One row per variant (and the reduction reference) of one cell."""
    cfg = KernelBenchConfig(preset=geom.name, contexts=(state.seq_len - 1,), batch_sizes=(batch,))
    q, bt, seq_lens, _selected, ws, _tuning, k_pages = selection_inputs(cfg, geom, layout, state, batch)
    rc = RowConstants.of(layout)
    scale = geom.head_dim**-0.5
    pairs = batch * geom.num_kv_heads
    base_chunks = deployed_chunks(pairs, bt.shape[1])
    nbytes = stage_bytes(geom, layout, state.seq_len, batch, k_pages, 1)["score"]
    floor_us = 1e6 * nbytes / bandwidth
    n = state.copies
    reference = None
    rows = []
    for variant in VARIANTS:
        chunks = variant.programs(base_chunks)
        table = variant.table(bt)

        def launch(variant=variant, chunks=chunks, table=table):
            for summary_rows in state.rows:
                cuda_score.launch(q, summary_rows, table, seq_lens, ws, rc, scale, geom.num_kv_heads, chunks,
                                  MAX_CHUNKS, variant.defines)
        row = {"variant": asdict(variant), "chunks": chunks, "bytes": nbytes, "floor_us": floor_us}
        try:
            launch()
            torch.cuda.synchronize()
            if variant.name == "deployed":
                reference = ws.scores[:pairs].clone()
            elif variant.exact and reference is not None:
                row["max_abs_diff"] = float((ws.scores[:pairs] - reference).abs().nan_to_num(0.0).max())
            timing = time_graph(launch, replays, n)
            row.update(status="ok", timing_us=timing, floor_fraction=floor_us / timing["mean_us"])
        except Exception as exc:  # noqa: BLE001 - a variant that fails is reported in its row, never fatal
            log.warning("variant %s failed: %s", variant.name, exc)
            row.update(status="error", reason=f"{type(exc).__name__}: {str(exc)[:200]}")
        rows.append(row)
    # float32 words (their values do not matter): torch's float sum streams at the bandwidth, where an int64 sum of
    # int32 words reached 18% of it on the H100 (score-probe-h100.md)
    words = [r.view(torch.float32) for r in state.rows]

    def reduce_rows():
        for w in words:
            w.sum()
    reduce_rows()
    timing = time_graph(reduce_rows, replays, n)
    buffer_bytes = state.rows[0].numel()
    buffer_floor_us = 1e6 * buffer_bytes / bandwidth
    rows.append({"variant": {"name": "torch_sum_rows"}, "bytes": buffer_bytes, "floor_us": buffer_floor_us,
                 "status": "ok", "timing_us": timing, "floor_fraction": buffer_floor_us / timing["mean_us"]})
    return rows


def markdown(records: list[dict]) -> str:
    lines = ["| context | bs | variant | programs / pair | µs (sd) | floor µs | floor share | note |",
             "|---|---|---|---|---|---|---|---|"]
    for r in records:
        c = r["cell"]
        head = f"| {format_size(c['context_tokens'])} | {c['batch_size']} | {r['variant']['name']} | {r.get('chunks', '—')} "
        if r["status"] != "ok":
            lines.append(head + f"| {r['status']} | | | {r.get('reason', '')} |")
            continue
        t = r["timing_us"]
        note = f"largest score difference {r['max_abs_diff']:.2g}" if "max_abs_diff" in r else ""
        lines.append(head + f"| {t['mean_us']:.1f} ({t['sd_us']:.1f}) | {r['floor_us']:.1f} | {100 * r['floor_fraction']:.0f}% | {note} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="glm4-9b-1m")
    parser.add_argument("--contexts", default="256k,512k,1m")
    parser.add_argument("--batch", default="1")
    parser.add_argument("--cells", default="", help="extra context:batch cells, e.g. 32k:16,512k:4")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if not torch.cuda.is_available():
        print("error: the score probe needs a CUDA GPU (an sm_90 device)", file=sys.stderr)
        return 2
    cells = [(c, b) for c in parse_size_list(args.contexts) for b in parse_size_list(args.batch)]
    for cell in filter(None, args.cells.split(",")):
        context, _, batch = cell.partition(":")
        cells.append((parse_size_list(context)[0], int(batch)))
    geom = resolve_geometry(args.preset)
    layout = SummaryLayout(SummaryFormat.parse("r8i4"), geom.head_dim)
    provenance = collect(reproduce_command(), schema=SCHEMA_SCORE_PROBE)
    bandwidth = copy_bandwidth_bytes_per_s()
    gen = torch.Generator().manual_seed(0)
    records = []
    for context, batch in cells:
        state = _ContextState(geom, layout, context, batch, gen)
        for row in probe_cell(geom, layout, state, batch, args.replays, bandwidth):
            record = {"schema": SCHEMA_SCORE_PROBE, "cell": {"preset": geom.name, "context_tokens": context,
                      "batch_size": batch}, "copy_bandwidth_bytes_per_s": bandwidth, "layer_copies": state.copies,
                      "provenance": provenance, **row}
            records.append(record)
            if args.out:
                append_record(args.out, record)
        del state
        torch.cuda.empty_cache()
    print(markdown(records))
    print(json.dumps({"cells": len(cells), "records": len(records)}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
