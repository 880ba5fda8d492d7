"""Timing one piece of GPU work: captured in a CUDA graph and replayed, or called eagerly, with CUDA events;
per-call microsecond samples. The kernel bench and the lab's sweeps share these."""

from __future__ import annotations

import statistics

import torch


def capture_graph(fn) -> torch.cuda.CUDAGraph:
    """fn captured in a CUDA graph after one eager warm-up call (compiles, lazily allocates), replayed 3 times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    return graph


def time_graph(fn, replays: int, calls_per_replay: int) -> dict:
    """Capture fn in a CUDA graph, replay it, return per-call µs samples (events around each replay)."""
    graph = capture_graph(fn)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    for start, end in zip(starts, ends):
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    samples = [1000.0 * s.elapsed_time(e) / calls_per_replay for s, e in zip(starts, ends)]
    return {"mean_us": statistics.fmean(samples), "sd_us": statistics.stdev(samples), "min_us": min(samples),
            "n": len(samples), "samples_us": samples, "graph": True}


def time_eager(fn, reps: int) -> dict:
    """fn called eagerly `reps` times after one warm-up call, per-call µs samples (events around each call)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(1000.0 * start.elapsed_time(end))
    return {"mean_us": statistics.fmean(samples), "sd_us": statistics.stdev(samples) if reps > 1 else 0.0,
            "min_us": min(samples), "n": reps, "samples_us": samples, "graph": False}
