"""Benchmark mode `prefill_attention: skip` (`locks bench decode --prefill-attention skip`): a batch that holds
prefill tokens writes their keys and values to the cache as usual and skips its attention (output zero).

Why: a decode step's time does not depend on the numbers in the KV cache (the dense arms read every page; Locks
scores every page and reads a fixed budget of them), but one causal prefill of 1M tokens costs ~11 minutes an
engine on an H200, which decides whether a long rung fits a lease at all. With the attention skipped the prefill
costs its GEMMs. The cache then holds the keys and values of another forward pass of the same dummy-weight model:
the same shapes, other numbers. Pure-decode batches (the timed steps) run untouched.

It works because vLLM 0.24 writes the cache in a call of its own (`do_kv_cache_update`, where a backend's
`forward_includes_kv_cache_update` is False); a backend that writes it inside `forward` is left alone, and the
harness then finds no skipped batch after the prefill and stops the cell. Runs in the engine process (tensor
parallel 1: the model runs in that process), configured by the harness before the engine is built.
"""

from __future__ import annotations

import functools
import importlib
import logging

log = logging.getLogger(__name__)

MODES = ("exact", "skip")

# (module, backend class, impl class) of the backends the arms run: FA3 (and Locks, whose prefill rows run FA3's
# forward), FlashInfer, and vLLM's CPU attention (tests).
_TARGETS = (
    ("vllm.v1.attention.backends.flash_attn", "FlashAttentionBackend", "FlashAttentionImpl"),
    ("vllm.v1.attention.backends.flashinfer", "FlashInferBackend", "FlashInferImpl"),
    ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackend", "CPUAttentionBackendImpl"),
)
_WRAPPED = "_locks_prefill_attention_wrapped"


class _State:
    skip = False
    skipped_batches = 0
    wrapped: list[str] = []


def has_prefill(attn_metadata) -> bool:
    """Whether a batch holds prefill tokens: FlashInfer counts its prefill rows; the others give the longest
    query (1 in a pure-decode batch)."""
    prefills = getattr(attn_metadata, "num_prefills", None)
    if prefills is not None:
        return prefills > 0
    return getattr(attn_metadata, "max_query_len", 1) > 1


def _skipping(forward):
    @functools.wraps(forward)
    def wrapped(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        if _State.skip and attn_metadata is not None and has_prefill(attn_metadata):
            _State.skipped_batches += 1
            return output.zero_()
        return forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)

    setattr(wrapped, _WRAPPED, True)
    return wrapped


def configure(mode: str) -> None:
    """Set this process's mode; on the first `skip`, wrap the forward of every importable target backend whose cache
    write is its own call (`wrapped()` names them)."""
    if mode not in MODES:
        raise ValueError(f"prefill_attention {mode!r} unknown; use one of {', '.join(MODES)}")
    _State.skip = mode == "skip"
    if not _State.skip:
        return
    for module_name, backend_name, impl_name in _TARGETS:
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # noqa: BLE001 - a backend this build lacks (FlashInfer on the CPU) is no target
            log.debug("prefill_attention: %s not importable (%s)", module_name, exc)
            continue
        backend, impl = getattr(module, backend_name), getattr(module, impl_name)
        if getattr(impl.forward, _WRAPPED, False):
            continue
        if getattr(backend, "forward_includes_kv_cache_update", True):
            log.warning("prefill_attention skip: %s writes the KV cache inside forward; its prefill stays exact", impl_name)
            continue
        impl.forward = _skipping(impl.forward)
        _State.wrapped.append(f"{module_name}.{impl_name}")
    log.info("prefill_attention skip: prefill batches skip attention in %s", ", ".join(_State.wrapped) or "no backend")


def wrapped() -> list[str]:
    """The impl classes whose forward this process wrapped."""
    return list(_State.wrapped)


def skipped_batches() -> int:
    """Attention calls skipped in this process so far (one per layer and prefill batch)."""
    return _State.skipped_batches
