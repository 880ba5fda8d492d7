"""Summary memory that vLLM's KV budget accounts for, without patching vLLM.

vLLM sizes the KV cache from the torch peak of its profiling run (`determine_available_memory`):
KV = requested - weights - peak - non_torch - cudagraph_estimate. The backend cannot change the
layer's KV spec, so summaries are allocated lazily (per layer, sized from the real KV tensor) and
their bytes are made part of that peak instead: during the profiling forward (attn_metadata None,
no KV tensor yet) we hold a reservation R = f/(1+f) * (requested - allocated_now), f = summary
bytes / KV bytes per page. The KV budget shrinks by R, and the summaries of the resulting cache
need f * KV <= R. The decode workspaces (score/select and split-K scratch, allocated by the metadata
builder after profiling; sized exactly by allocating them on the meta device) are added to R. R is
released when the engine's first Locks builder is created (after the profiling peak is read,
before the KV cache is allocated). Headroom rule: with gpu_memory_utilization everything fits
inside it (one Locks KV-cache group assumed; hybrid models with several groups need more); with
kv_cache_memory_bytes (no profiling) leave f * kv_cache_memory_bytes + workspace free yourself.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("vllm.locks.memory")  # in vLLM's log stream, like the ACTIVE line

# Per engine (keyed by id of its VllmConfig): several engines may live in one process.
_reservations: dict[int, torch.Tensor] = {}
_done: set[int] = set()


def summary_fraction(row_bytes: int, head_dim: int, kv_element_bytes: int, page_size: int = 16) -> float:
    """Summary bytes per (page, KV head) over K+V bytes per (page, KV head)."""
    return row_bytes / (2 * page_size * head_dim * kv_element_bytes)


def reserve_during_profiling(vllm_config, fraction: float, workspace_bytes: int, device: torch.device) -> None:
    """Hold R bytes through this engine's profiling run (CUDA only, once per engine)."""
    key = id(vllm_config)
    if key in _done or device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return
    _done.add(key)
    cache_config = vllm_config.cache_config
    if cache_config.kv_cache_memory_bytes:
        logger.warning(
            "Locks: kv_cache_memory_bytes=%d bypasses profiling; summaries need %.1f%% of it on top "
            "(%.2f GiB) -- leave that much GPU memory free",
            cache_config.kv_cache_memory_bytes, 100 * fraction,
            fraction * cache_config.kv_cache_memory_bytes / 2**30,
        )
        if workspace_bytes:
            logger.warning("Locks: plus %.2f GiB of decode workspace", workspace_bytes / 2**30)
        return
    total = torch.cuda.get_device_properties(device).total_memory
    requested = total * cache_config.gpu_memory_utilization
    kv_upper_bound = max(requested - torch.cuda.memory_allocated(device) - workspace_bytes, 0)
    nbytes = int(kv_upper_bound * fraction / (1 + fraction)) + workspace_bytes
    _reservations[key] = torch.empty(nbytes, dtype=torch.uint8, device=device)
    logger.info(
        "Locks: reserving %.2f GiB inside the KV budget for page summaries (f=%.3f) and %.2f GiB of decode workspace",
        (nbytes - workspace_bytes) / 2**30, fraction, workspace_bytes / 2**30,
    )


def release(vllm_config) -> None:
    """The budget is fixed (builder created, or a KV tensor seen): the reservation goes."""
    key = id(vllm_config)
    _done.add(key)
    _reservations.pop(key, None)


def tensor_bytes(obj) -> int:
    """Bytes of every tensor inside obj (a tensor, dataclass, tuple/list or None)."""
    if obj is None:
        return 0
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(tensor_bytes(item) for item in obj)
    return sum(tensor_bytes(value) for value in vars(obj).values())


def reserved_bytes() -> int:
    return sum(t.numel() for t in _reservations.values())
