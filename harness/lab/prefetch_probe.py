"""Can the output projection's weights stream into L2 while the selection and the sparse decode run?

    python -m locks_toolkit.harness.lab.prefetch_probe --contexts 16k,128k,512k --batch 1 --out probe.jsonl

After the score kernel a Locks layer runs three latency-bound launches (selection, split-K decode, merge) that move a
few MB in ~20 µs, while HBM could move ~60-90 MB; the next kernel of the layer, the output projection, reads a
hidden x hidden bf16 matrix (32 MiB for GLM-4-9B) from HBM at bs1. This probe times, as `locks bench kernel` does
(a CUDA graph over layer copies, µs per layer), score + select + decode + merge + `F.linear(out, W)` with each copy's
own W, and the same with the backend's bulk L2 prefetch of W (`kernels/prefetch.py`, settings `prefetch`) issued
right after the score kernel, of all of W or of its first `--prefetch-mib`:
- `inline`: the prefetch kernel on the layer's stream between the score and the selection;
- `side`: the same kernel on a stream forked after the score and joined before the projection;
and the projection alone (W from HBM) and right after a prefetch of all of W (what a full L2 hit buys).
A measuring instrument: nothing here is a served path.
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch
import torch.nn.functional as F

from ...kernels import ops
from ...kernels.build.packing import SummaryLayout
from ...kernels.config import SummaryFormat
from ...kernels.prefetch import L2Prefetch
from ..bandwidth import copy_bandwidth_bytes_per_s
from ..provenance import collect
from ..workload import format_size, parse_size_list
from .graph_timing import time_graph
from .kernel_bench import (
    KernelBenchConfig,
    add_sweep_arguments,
    resolve_geometry,
    selection_inputs,
    sweep_contexts,
)

log = logging.getLogger(__name__)

SCHEMA_PREFETCH_PROBE = "locks.prefetch_probe/1"


def measure(geom, layout, state, batch: int, prefetch_mib: tuple[int, ...], replays: int, budget: int) -> dict:
    cfg = KernelBenchConfig(preset=geom.name, contexts=(state.seq_len - 1,), batch_sizes=(batch,), budget_tokens=budget)
    q, bt, seq_lens, selected, sws, tuning, k_pages = selection_inputs(cfg, geom, layout, state, batch)
    scale = geom.head_dim**-0.5
    hidden = geom.num_q_heads * geom.head_dim
    out = torch.empty_like(q)
    dws = ops.decode_workspace(batch, geom.num_q_heads, geom.head_dim, "cuda")
    weights = [torch.randn((hidden, hidden), device="cuda", dtype=torch.bfloat16) * 0.01 for _ in state.rows]
    proj = [torch.empty((batch, hidden), device="cuda", dtype=torch.bfloat16)]
    n = state.copies

    def layer(mode: str, nbytes: int = 0):
        # each copy's first nbytes of W (a view: the prefetch takes a contiguous tensor's first bytes)
        fetch = [L2Prefetch.for_mode(w.view(-1)[: (nbytes or w.numel() * 2) // 2], mode) for w in weights]

        def fn():
            for rows, k, v, w, p in zip(state.rows, state.k, state.v, weights, fetch):
                chunks = ops._launch_score(q, rows, bt, seq_lens, layout, scale, geom.num_kv_heads, sws, tuning)
                if mode != "off":
                    p.issue()
                ops._launch_select(sws, seq_lens, selected, geom.group, chunks, cfg.combine, k_pages, tuning)
                ops.sparse_paged_decode(q, k, v, bt, seq_lens, selected, scale, out, dws)
                if mode != "off":
                    p.join()
                proj[0] = F.linear(out.view(batch, hidden), w)
        return fn

    def projection(prefetched: bool):
        fetch = [L2Prefetch.for_mode(w, "inline") for w in weights]

        def fn():
            for w, p in zip(weights, fetch):
                if prefetched:
                    p.issue()
                proj[0] = F.linear(out.view(batch, hidden), w)
        return fn

    layer("off")()  # compiles and fills the buffers before any capture
    torch.cuda.synchronize()
    arms = {"layer": layer("off"), "projection": projection(False), "projection_after_prefetch": projection(True)}
    for mode in ("inline", "side"):
        arms[mode] = layer(mode)
        for mib in prefetch_mib:
            arms[f"{mode}_{mib}mib"] = layer(mode, mib << 20)
    timings = {}
    for rep in range(2):  # every arm twice, alternating: drift shows as a difference between the runs
        for name, fn in arms.items():
            t = time_graph(fn, replays, n)
            timings.setdefault(name, []).append(round(t["mean_us"], 2))
    return {"timings_us": timings, "weight_bytes": hidden * hidden * 2, "layer_copies": n}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_sweep_arguments(parser, contexts="16k,128k,512k", batch="1")
    parser.add_argument("--prefetch-mib", default="16", help="partial prefetches to time beside the whole weight")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("error: the prefetch probe needs an sm_90 GPU (H100 / H200): run it through docs/lease/prefetch-ab.sh",
              file=sys.stderr)
        return 2
    geom = resolve_geometry(args.preset)
    layout = SummaryLayout(SummaryFormat.parse("r8i4"), geom.head_dim)
    mibs = tuple(int(m) for m in args.prefetch_mib.split(","))

    def measure_cell(state, batch: int) -> list[dict]:
        result = measure(geom, layout, state, batch, mibs, args.replays, args.budget)
        line = " ".join(f"{name}={'/'.join(str(x) for x in v)}" for name, v in result["timings_us"].items())
        print(f"{format_size(state.seq_len - 1)} bs{batch}: {line}", flush=True)
        return [{"schema": SCHEMA_PREFETCH_PROBE, "copy_bandwidth_bytes_per_s": bandwidth,
                 "cell": {"context": state.seq_len - 1, "batch": batch, "preset": geom.name}, **result}]

    bandwidth = copy_bandwidth_bytes_per_s()
    sweep_contexts(geom, layout, parse_size_list(args.contexts), tuple(int(b) for b in args.batch.split(",")),
                   collect(" ".join(sys.argv), schema=SCHEMA_PREFETCH_PROBE), args.out, measure_cell)
    return 0


if __name__ == "__main__":
    sys.exit(main())
