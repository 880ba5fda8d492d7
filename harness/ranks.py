"""Facts read on every tensor-parallel rank of an engine through `LLM.collective_rpc`, and how they add up.

With TP > 1 vLLM runs each rank's worker (its model shard, its attention backend and the Locks counters,
which are process-global) in a process of its own, out of the harness's reach. The `rank_*` functions
below are sent to every worker by `collective_rpc`, which calls them with the worker as first argument
(vLLM 0.24: `run_method` binds it; the multiprocess executor cloudpickles the function, by reference,
so they stay module-level and importable). At TP = 1 the same call runs in-process on the one worker:
one code path for both. Each returns None instead of raising, so a layout change costs a fact, not a run.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence

log = logging.getLogger(__name__)


def rank_counters(worker, spec: str) -> dict | None:
    """This rank's deployed-path counters from `spec` = "module:function" (None when not importable)."""
    module_name, _, func_name = spec.partition(":")
    try:
        return dict(getattr(importlib.import_module(module_name), func_name)())
    except Exception as exc:  # noqa: BLE001 - a missing counter module means "no counters", not a crash
        log.debug("counters %s unavailable on this rank: %s", spec, exc)
        return None


def rank_backend(worker) -> str | None:
    """Name of the attention backend this rank's model runner built."""
    try:
        return worker.model_runner.attn_groups[0][0].backend.get_name()
    except Exception as exc:  # noqa: BLE001 - internal layout differs by version/platform
        log.debug("could not read the attention backend in use: %s", exc)
        return None


def rank_weights(worker, tied: bool) -> dict | None:
    """Parameter bytes of this rank's model shard (harness/weights.py dict)."""
    from .weights import weights_from_model

    try:
        return weights_from_model(worker.model_runner.get_model(), tied)
    except Exception as exc:  # noqa: BLE001 - internal layout differs by version/platform
        log.debug("could not count this rank's model parameters: %s", exc)
        return None


def rank_facts(worker) -> dict | None:
    """Rank, device and per-rank head counts (what the attention backend sizes its buffers for)."""
    try:
        config = worker.vllm_config
        model, parallel = config.model_config, config.parallel_config
        return {
            "rank": int(getattr(worker, "rank", 0)),
            "local_rank": int(getattr(worker, "local_rank", 0)),
            "device": str(getattr(worker, "device", "")),
            "num_q_heads": model.get_num_attention_heads(parallel),
            "num_kv_heads": model.get_num_kv_heads(parallel),
        }
    except Exception as exc:  # noqa: BLE001
        log.debug("could not read this rank's facts: %s", exc)
        return None


def rank_capture_clear(worker) -> int:
    """Drop this rank's decode captures (the engine's warm-up decodes among them) -> how many were dropped.

    Called right before the compared request: on the GPU, vLLM's warm-up runs a dummy decode batch
    (seq_len 3) through the Locks path after the KV cache exists, and its capture cannot be checked
    later because the request's writes reuse those pages (H200, 2026-11-29: excess error 6.5).
    """
    from ..kernels.vllm_backend import debug

    dropped = len(debug.captures)
    debug.clear()
    return dropped


def rank_capture_check(worker, detail_layer: int | None) -> dict:
    """This rank's Locks decode captures checked in its own process (kernels/vllm_backend/capture_check.py).

    Returns the check's dict plus the rank; a check that cannot run returns {"rank", "error", "pass": False}
    rather than None, so the failure and its cause reach the record.
    """
    rank = int(getattr(worker, "rank", 0))
    try:
        from ..kernels.vllm_backend.capture_check import check_rank_captures

        return {"rank": rank, **check_rank_captures(detail_layer=detail_layer)}
    except Exception as exc:  # noqa: BLE001 - the harness reports it; a raise here would kill the engine
        log.warning("capture check failed on rank %d: %s", rank, exc)
        return {"rank": rank, "error": f"{type(exc).__name__}: {exc}", "pass": False}


def sum_counters(per_rank: Sequence[dict | None]) -> dict | None:
    """Counters summed over ranks (every rank counts its own rows); None when any rank has none.

    A rank without counters would make a sum look complete when it is not, so it voids the whole read.
    """
    if not per_rank or any(counts is None for counts in per_rank):
        return None
    total: dict = {}
    for counts in per_rank:
        for key, value in counts.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                total[key] = total.get(key, 0) + value
    return total


def combine_weights(per_rank: Sequence[dict | None]) -> dict | None:
    """Weights over all ranks, plus what one GPU reads (the busiest rank: the GPUs stream in parallel).

    `total`, `parameters` and `read_per_step` are summed over ranks (replicated norms count once per
    rank); `per_gpu_read_per_step` is the largest rank's; `per_rank` keeps each rank's dict.
    """
    if not per_rank or any(weights is None for weights in per_rank):
        return None
    first = per_rank[0]
    return {
        "read_per_step": sum(w["read_per_step"] for w in per_rank),
        "total": sum(w["total"] for w in per_rank),
        "parameters": sum(w["parameters"] for w in per_rank),
        "tied_embeddings": first["tied_embeddings"],
        "source": first["source"] + (f", summed over {len(per_rank)} TP ranks" if len(per_rank) > 1 else ""),
        "per_gpu_read_per_step": max(w["read_per_step"] for w in per_rank),
        "tensor_parallel_size": len(per_rank),
        "per_rank": [dict(w) for w in per_rank],
    }


def per_gpu_weights(weights: dict | None, tensor_parallel_size: int) -> int | None:
    """Weight bytes one GPU reads per step: the engine's per-rank count, else the total split evenly.

    The even split is exact for the TP-sharded matrices (all but the replicated norms, < 0.01 % of a
    Llama-family model) and is what the config formula can offer.
    """
    if weights is None:
        return None
    if weights.get("per_gpu_read_per_step") is not None:
        return int(weights["per_gpu_read_per_step"])
    return -(-int(weights["read_per_step"]) // tensor_parallel_size)
