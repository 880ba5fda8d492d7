"""Replay an engine's decode-step selection outside the engine: same data, every selection path, timed alone.

    python -m locks_toolkit.harness.lab.selection_replay --context 128k --layers 2 --steps 3 --out replay.jsonl

Why: the one-launch selection took 33-34 µs per layer inside the vLLM engine at 128K (dummy weights) and
15-19 µs in every kernel sweep (random, near-tied and flat keys). The sweep's keys are not the engine's.
This runs an in-process engine of the bench's model (GLM-4-9B geometry, vLLM dummy weights exactly as
`locks bench decode` loads them, eager so the backend's debug capture runs), captures one layer's decode
steps, and puts each capture through the score kernel and each selection path. Per capture and path it
reports:
  - whether the pages equal the engine's (the replay is the engine's data, not a lookalike),
  - the key distribution the selection met: contested pages, pages in the threshold bin, distinct low-bit
    values among them, exact ties at the threshold,
  - and, on a GPU, µs per call in a CUDA graph, per kernel.

`replay_capture` takes any capture of `kernels/vllm_backend/debug.py` (CPU captures run the Triton
interpreter, untimed: the tests).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

import torch

from ...kernels import ops
from ...kernels.config import PAGE_SIZE, SELECT_PATHS
from ...kernels.score.pages import SCORER_KERNELS, ScoreTuning
from ...kernels.select import chunked as _topk
from ..provenance import collect, reproduce_command
from ..workload import parse_size

SCHEMA_SELECTION_REPLAY = "locks.selection_replay/1"
PRODUCTION = ScoreTuning(**SCORER_KERNELS["transposed"])  # the backend's score kernel

log = logging.getLogger(__name__)


def key_stats(keys: torch.Tensor, seq_lens: torch.Tensor, num_kv_heads: int, page_budget: int) -> list[dict]:
    """Per (sequence, KV head) with more pages than the budget: what the threshold search works on.
    keys: the selection's int32 keys [pairs, pages] (contested pages 1 .. recent-1; the sink and the
    recent page are always kept). The threshold is the (k-2)-th largest contested key; its bin is
    key >> topk.LOW_BITS, as in the kernels' histogram."""
    stats = []
    for s, seq_len in enumerate(seq_lens.tolist()):
        recent = -(-seq_len // PAGE_SIZE) - 1
        if recent + 1 <= page_budget:
            continue
        for h in range(num_kv_heads):
            contested = keys[s * num_kv_heads + h, 1:recent].long().cpu()
            threshold = int(torch.topk(contested, page_budget - 2).values[-1])
            in_bin = contested[(contested >> _topk.LOW_BITS) == threshold >> _topk.LOW_BITS]
            low = in_bin & ((1 << _topk.LOW_BITS) - 1)
            stats.append({"seq": s, "head": h, "contested": int(contested.numel()),
                          "above_bin": int((contested >> _topk.LOW_BITS > threshold >> _topk.LOW_BITS).sum()),
                          "in_threshold_bin": int(in_bin.numel()), "distinct_low_in_bin": int(low.unique().numel()),
                          "tied_at_threshold": int((contested == threshold).sum()),
                          "distinct_bins": int((contested >> _topk.LOW_BITS).unique().numel())})
    return stats


def replay_capture(capture: dict, tunings: list[ScoreTuning], replays: int = 0) -> list[dict]:
    """One capture through score + selection under each tuning (on the capture's device). replays > 0:
    also time score and selection alone in CUDA graphs (GPU only) and profile them per kernel."""
    sel = capture["selection"]
    if not sel or capture.get("summary_rows") is None:
        raise ValueError("capture has no summary rows / selection settings: record it with this toolkit's debug.record")
    rows = capture["summary_rows"]
    device = rows.device
    q = capture["q"].to(device, capture.get("q_dtype", torch.float32))
    block_table = capture["block_table"].to(device)
    seq_lens = capture["seq_lens"].to(device)
    num_seqs, num_q_heads, _ = q.shape
    hkv, k_pages, combine = sel["num_kv_heads"], sel["page_budget"], sel["combine"]
    group = num_q_heads // hkv
    ws = ops.score_select_workspace(num_seqs, hkv, block_table.shape[1], device, group_size=group)
    engine_pages = capture["selected_pages"][:num_seqs]  # the engine's buffer may hold more rows than decodes
    out = []
    for tuning in tunings:
        selected = torch.empty((num_seqs, hkv, k_pages), dtype=torch.int32, device=device)

        def score(tuning=tuning) -> int:
            return ops._launch_score(q, rows, block_table, seq_lens, sel["layout"], capture["scale"], hkv, ws, tuning)

        chunks = score()

        def select(chunks=chunks, selected=selected, tuning=tuning) -> None:
            ops._launch_select(ws, seq_lens, selected, group, chunks, combine, k_pages, tuning)

        select()
        record = {"layer": capture["layer"], "seq_lens": seq_lens.tolist(), "tuning": asdict(tuning),
                  "engine_select": sel.get("select"), "same_pages_as_engine": bool(torch.equal(selected.cpu(), engine_pages)),
                  "key_stats": key_stats(ws.keys, seq_lens, hkv, k_pages)}
        if replays and device.type == "cuda":
            from .graph_timing import time_graph
            from .score_sweep import profile_graph

            record.update(score_us=time_graph(score, replays, 1)["mean_us"], select_us=time_graph(select, replays, 1)["mean_us"],
                          kernel_us={**profile_graph(score, replays, 1), **profile_graph(select, replays, 1)})
        out.append(record)
    return out


def path_tunings(paths=SELECT_PATHS, base: ScoreTuning = PRODUCTION) -> list[ScoreTuning]:
    return [replace(base, select_path=path) for path in paths]


def capture_engine_steps(context: int, layers: int, capture_layer: int, steps: int, budget: int,
                         utilization: float, replays: int, paths) -> list[dict]:
    """The bench's model in an in-process eager engine; replays every capture of `capture_layer` before
    the engine (whose cache the captures reference) goes away."""
    from ...kernels.vllm_backend import debug
    from ...kernels.vllm_backend.plugin import register
    from .backend_check import GLM4_9B_GEOMETRY, greedy, prompt_ids, with_engine

    register()
    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(GLM4_9B_GEOMETRY))

        def use(llm) -> list[dict]:
            debug.clear()
            try:
                greedy(llm, prompt_ids(context, seed=context), steps)
                return [r for cap in debug.captures for r in replay_capture(cap, path_tunings(paths), replays)]
            finally:
                debug.clear()

        # randomize=False: vLLM's dummy weights as they are, as the bench loads them (backend_check redraws them)
        return with_engine(model_dir, "CUSTOM", utilization, context + 512, use, eager=True, num_layers=layers,
                           randomize=False,
                           locks={"budget": budget, "scorer": "locks", "debug_capture_layers": [capture_layer]})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", default="128k")
    parser.add_argument("--layers", type=int, default=2, help="engine layers (the bench runs 40; dummy layers are alike)")
    parser.add_argument("--capture-layer", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3, help="decode steps captured")
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--paths", default=",".join(SELECT_PATHS), help=f"selection paths to replay ({', '.join(SELECT_PATHS)})")
    parser.add_argument("--replays", type=int, default=20, help="CUDA-graph replays per timing (0: untimed)")
    parser.add_argument("--utilization", type=float, default=0.5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    paths = tuple(p for p in args.paths.split(",") if p)
    unknown = sorted(set(paths) - set(SELECT_PATHS))
    if unknown or not 0 <= args.capture_layer < args.layers:
        parser.error(f"unknown path(s) {unknown}; use {', '.join(SELECT_PATHS)}" if unknown
                     else f"--capture-layer {args.capture_layer} must be below --layers {args.layers}")
    records = capture_engine_steps(parse_size(args.context), args.layers, args.capture_layer, args.steps, args.budget,
                                   args.utilization, args.replays, paths)
    provenance = collect(reproduce_command(), schema=SCHEMA_SELECTION_REPLAY)
    for record in records:
        worst = max(record["key_stats"], key=lambda st: st["in_threshold_bin"], default={})
        log.info("%s seq_lens %s: same pages %s, score %.1f µs, select %.1f µs, widest threshold bin %s",
                 record["tuning"]["select_path"], record["seq_lens"], record["same_pages_as_engine"],
                 record.get("score_us", float("nan")), record.get("select_us", float("nan")), worst)
    if args.out:
        with open(args.out, "a") as sink:
            for record in records:
                sink.write(json.dumps({**record, "provenance": provenance}, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
