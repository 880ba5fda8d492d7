"""What one more kernel, or one device-side branch, in a decode CUDA graph costs when the GPU waits for the launch.

vLLM (async scheduling off, as in the matched pair) syncs on each step's sampled token, prepares the
next step on the host and then replays the decode graph into an idle GPU, so the graph's launch
latency sits on the step's critical path. The Locks decode path adds five kernels per layer to
FA3's two (200 graph nodes at 40 layers); torch.profiler cannot price that, since its per-node
tracing inflates cudaGraphLaunch itself (H200, 2026-11-29: 1.26 ms Locks vs 0.88 ms FA3 under the
profiler). This probe captures graphs of N tiny kernels and times, without a profiler, the host call
(replay) and idle-to-done (replay + synchronize), then fits time = a + b N.

    python3 -m locks_toolkit.harness.lab.graph_launch_probe --nodes 100,300,550,750,1000 --out probe.jsonl

`--branches L` prices the crossover's mechanism (`kernels.graph_branch`) on graphs of L "layers", each a dense
path of DENSE_KERNELS tiny kernels or a sparse one of SPARSE_KERNELS: dense only, sparse only, both recorded
(what a flag read inside the kernels costs), and IF/ELSE conditional nodes set by one kernel per replay, flagged
dense and flagged sparse. Each branch replay checks that only the flagged body ran.
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


DENSE_KERNELS = 2  # FA3's decode: the attention kernel and its split combine
SPARSE_KERNELS = 4  # Locks at 16K-32K: score, select (one launch), decode, merge
BRANCH_MODES = ("dense", "sparse", "both", "branch_dense", "branch_sparse")


def time_branch_graphs(layers: int, reps: int) -> list[dict]:
    """One cell per BRANCH_MODES entry for graphs of `layers` layers (see the module docstring); the branch
    cells say how many dense and sparse kernels one replay ran, which must match the flag."""
    import torch

    from ...kernels.graph_branch import GraphBranches

    dense_x, sparse_x = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")

    def dense() -> None:
        for _ in range(DENSE_KERNELS):
            dense_x.add_(1.0)

    def sparse() -> None:
        for _ in range(SPARSE_KERNELS):
            sparse_x.add_(1.0)

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        dense(), sparse()
    torch.cuda.synchronize()
    cells = []
    for mode in BRANCH_MODES:
        graph = torch.cuda.CUDAGraph()
        branches = GraphBranches(torch.device("cuda", torch.cuda.current_device())) if mode.startswith("branch") else None
        with torch.cuda.graph(graph, stream=stream):
            if branches is not None:
                branches.set_all(flag)
            for _ in range(layers):
                if branches is not None:
                    with branches.if_else() as (then, otherwise):
                        with then:
                            dense()
                        with otherwise:
                            sparse()
                else:
                    if mode != "sparse":
                        dense()
                    if mode != "dense":
                        sparse()
        if branches is not None:
            branches.publish()
        flag.fill_(1 if mode == "branch_dense" else 0)
        before = (dense_x.item(), sparse_x.item())
        graph.replay()
        torch.cuda.synchronize()
        ran = {"dense_kernels": int(dense_x.item() - before[0]), "sparse_kernels": int(sparse_x.item() - before[1])}
        cells.append({"layers": layers, "mode": mode, **ran, **replay_times(graph, reps)})
    return cells


def expected_kernels(mode: str, layers: int) -> dict:
    """Dense and sparse kernels one replay of `mode` must run."""
    dense = mode in ("dense", "both", "branch_dense")
    sparse = mode in ("sparse", "both", "branch_sparse")
    return {"dense_kernels": DENSE_KERNELS * layers * dense, "sparse_kernels": SPARSE_KERNELS * layers * sparse}


def summarize_branches(cells: Sequence[dict]) -> dict:
    """µs per layer that each way of choosing adds to the path it runs (idle to done), and whether every
    replay ran exactly the kernels its flag asks for."""
    by_mode = {c["mode"]: c for c in cells}
    missing = [m for m in BRANCH_MODES if m not in by_mode]
    if missing:
        raise ValueError(f"branch cells lack modes {missing}")
    layers = by_mode["dense"]["layers"]
    per_layer = {m: by_mode[m]["idle_to_done_us"] / layers for m in BRANCH_MODES}
    return {
        "layers": layers,
        "us_per_layer": per_layer,
        "both_over_dense_us": per_layer["both"] - per_layer["dense"],
        "branch_over_dense_us": per_layer["branch_dense"] - per_layer["dense"],
        "branch_over_sparse_us": per_layer["branch_sparse"] - per_layer["sparse"],
        "branches_ran_as_flagged": all(
            {k: c[k] for k in ("dense_kernels", "sparse_kernels")} == expected_kernels(c["mode"], c["layers"]) for c in cells),
    }


def branch_markdown(cells: Sequence[dict], fit: dict) -> str:
    lines = ["| graph | kernels run (dense / sparse) | replay + sync µs | µs per layer |", "|---|---:|---:|---:|"]
    lines += [f"| {c['mode']} | {c['dense_kernels']} / {c['sparse_kernels']} | {c['idle_to_done_us']:.1f} | "
              f"{fit['us_per_layer'][c['mode']]:.2f} |" for c in cells]
    lines.append(f"\nper layer over the path taken: both recorded +{fit['both_over_dense_us']:.2f} µs (dense), "
                 f"IF/ELSE +{fit['branch_over_dense_us']:.2f} µs (dense) / +{fit['branch_over_sparse_us']:.2f} µs "
                 f"(sparse); branches ran as flagged: {fit['branches_ran_as_flagged']}")
    return "\n".join(lines)


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
    parser.add_argument("--branches", type=int, default=0, metavar="LAYERS",
                        help="also price device-side branches on graphs of this many layers (e.g. 40)")
    parser.add_argument("--out", help="JSONL file the record is appended to")
    args = parser.parse_args(argv)
    try:
        nodes = parse_nodes(args.nodes)
        if args.branches < 0:
            raise ConfigError(f"--branches {args.branches} must be a number of layers (e.g. 40), or 0 to skip")
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
    failed = False
    if args.branches:
        try:
            record["branch_cells"] = time_branch_graphs(args.branches, args.reps)
            record["branch_fit"] = summarize_branches(record["branch_cells"])
            failed = not record["branch_fit"]["branches_ran_as_flagged"]
        except RuntimeError as exc:  # the driver refused a step of building the branches: keep its words
            record["branch_error"] = str(exc)
            failed = True
    if args.out:
        with open(args.out, "a") as handle:
            handle.write(json.dumps(record) + "\n")
    sys.stdout.write(markdown(cells, fit) + "\n")
    if "branch_fit" in record:
        sys.stdout.write(branch_markdown(record["branch_cells"], record["branch_fit"]) + "\n")
    if failed:
        log.error("device-side branches failed: %s", record.get("branch_error") or record["branch_cells"])
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
