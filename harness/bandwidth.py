"""The copy bandwidth of the device an engine or a kernel bench runs on: the rate every byte floor divides by.

A floor must use the card it describes: an H100's HBM copies at ~3.0 TB/s, an H200's at ~4.2, so a fixed
number would put one card's records against the other's memory. Measured as device-to-device copies
(bytes read + written per second), the best of several after untimed ones.
"""

from __future__ import annotations

import math
import time

import torch

CUDA_COPY_BYTES = 1 << 30  # far past any GPU's L2
CPU_COPY_BYTES = 1 << 26  # past a CPU's last-level cache, short enough for a CPU engine's tests
MEASURED = "measured: device copy at engine boot"
FROM_PLAN = "plan: hbm_bytes_per_s"


def copy_bandwidth_bytes_per_s(device: str | torch.device = "cuda", reps: int = 10) -> float:
    """Device-to-device copy bandwidth of `device` (bytes read + written per second), the best of `reps` timed
    copies after three untimed ones."""
    device = torch.device(device)
    nbytes = CUDA_COPY_BYTES if device.type == "cuda" else CPU_COPY_BYTES
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    best_s = math.inf
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            begin = time.perf_counter()
            dst.copy_(src)
            seconds = time.perf_counter() - begin
        best_s = min(best_s, seconds)
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return 2 * nbytes / best_s
