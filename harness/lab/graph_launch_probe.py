"""What one more kernel in a decode CUDA graph costs when the GPU waits for the launch.

vLLM (async scheduling off, as in the matched pair) syncs on each step's sampled token, prepares the
next step on the host and then replays the decode graph into an idle GPU, so the graph's launch
latency sits on the step's critical path. The Locks decode path adds five kernels per layer to
FA3's two (200 graph nodes at 40 layers); torch.profiler cannot price that, since its per-node
tracing inflates cudaGraphLaunch itself (H200, 2026-11-29: 1.26 ms Locks vs 0.88 ms FA3 under the
profiler). This probe captures graphs of N tiny kernels and times, without a profiler, the host call
(replay) and idle-to-done (replay + synchronize), then fits time = a + b N.

    python3 -m locks_toolkit.harness.lab.graph_launch_probe --nodes 100,300,550,750,1000 --out probe.jsonl
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections.abc import Sequence

import numpy as np

from ...kernels.config import ConfigError

log = logging.getLogger(__name__)
SCHEMA = "locks.bench.graph_launch/1"


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of ys against xs; needs two distinct xs."""
    if len(xs) != len(ys) or len(set(xs)) < 2:
        raise ValueError(f"a line needs >= 2 distinct x values paired with y values; got xs={list(xs)}, ys={list(ys)}")
    slope, intercept = np.polyfit(np.asarray(xs, dtype=float), np.asarray(ys, dtype=float), 1)
    return float(intercept), float(slope)


def parse_nodes(text: str) -> list[int]:
    """"100,300" -> [100, 300]: at least two distinct positive counts."""
    try:
        nodes = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise ConfigError(f"--nodes {text!r} must be comma-separated kernel counts like 100,500,1000") from None
    if len(nodes) < 2 or nodes[0] < 1:
        raise ConfigError(f"--nodes {text!r} needs at least two distinct positive counts (a line through them)")
    return nodes


def time_graph(num_nodes: int, reps: int) -> dict:
    """Median µs of the replay call and of replay + synchronize for a graph of `num_nodes` 1-element adds."""
    import torch

    x = torch.zeros(1, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            x.add_(1.0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(num_nodes):
            x.add_(1.0)
    return {"nodes": num_nodes, **replay_times(graph, reps)}


def replay_times(graph, reps: int) -> dict:
    """Median µs of the host's replay call and of replay + synchronize (idle GPU to done)."""
    import torch

    graph.replay()
    torch.cuda.synchronize()
    host, total = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        started = time.perf_counter()
        graph.replay()
        launched = time.perf_counter()
        torch.cuda.synchronize()
        done = time.perf_counter()
        host.append((launched - started) * 1e6)
        total.append((done - started) * 1e6)
    return {"reps": reps, "replay_call_us": statistics.median(host), "idle_to_done_us": statistics.median(total)}


def summarize(cells: Sequence[dict]) -> dict:
    """Per-node slopes (µs per kernel node) of the host call and of idle-to-done, from the cells."""
    xs = [c["nodes"] for c in cells]
    call_a, call_b = fit_line(xs, [c["replay_call_us"] for c in cells])
    done_a, done_b = fit_line(xs, [c["idle_to_done_us"] for c in cells])
    return {"replay_call_us_per_node": call_b, "replay_call_us_fixed": call_a,
            "idle_to_done_us_per_node": done_b, "idle_to_done_us_fixed": done_a}


def markdown(cells: Sequence[dict], fit: dict) -> str:
    lines = ["| kernel nodes | replay call µs | replay + sync µs |", "|---:|---:|---:|"]
    lines += [f"| {c['nodes']} | {c['replay_call_us']:.1f} | {c['idle_to_done_us']:.1f} |" for c in cells]
    lines.append(f"\nper node: replay call {fit['replay_call_us_per_node']:.3f} µs, "
                 f"replay + sync {fit['idle_to_done_us_per_node']:.3f} µs (fixed {fit['idle_to_done_us_fixed']:.1f} µs)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="100,300,550,750,1000", help="kernel counts of the probed graphs")
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--out", help="JSONL file the record is appended to")
    args = parser.parse_args(argv)
    try:
        nodes = parse_nodes(args.nodes)
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("the graph-launch probe needs a CUDA device (it times CUDA-graph replays); run it on the GPU")
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    from ..provenance import collect, reproduce_command

    cells = [time_graph(n, args.reps) for n in nodes]
    fit = summarize(cells)
    record = {"schema": SCHEMA, "cells": cells, "fit": fit, "provenance": collect(reproduce_command(), schema=SCHEMA)}
    if args.out:
        with open(args.out, "a") as handle:
            handle.write(json.dumps(record) + "\n")
    sys.stdout.write(markdown(cells, fit) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
