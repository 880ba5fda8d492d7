"""`prefill_attention: skip`: the wrapped forward skips the attention of batches that hold prefill tokens and
leaves pure-decode batches and backends that write the cache inside forward alone."""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
import torch
from locks_toolkit.kernels.vllm_backend import prefill_attention


class _Impl:
    def __init__(self):
        self.calls = 0

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None):
        self.calls += 1
        return output.fill_(7.0)


@pytest.fixture
def fake_backends(monkeypatch):
    """Two fake backend modules: one writes its cache in a call of its own, one inside forward."""
    separate = types.ModuleType("fake_separate")
    separate.Backend = type("Backend", (), {"forward_includes_kv_cache_update": False})
    separate.Impl = type("Impl", (_Impl,), {})
    inside = types.ModuleType("fake_inside")
    inside.Backend = type("Backend", (), {"forward_includes_kv_cache_update": True})
    inside.Impl = type("Impl", (_Impl,), {})
    monkeypatch.setitem(sys.modules, "fake_separate", separate)
    monkeypatch.setitem(sys.modules, "fake_inside", inside)
    monkeypatch.setattr(prefill_attention, "_TARGETS", (
        ("fake_separate", "Backend", "Impl"), ("fake_inside", "Backend", "Impl"), ("fake_missing", "Backend", "Impl")))
    monkeypatch.setattr(prefill_attention._State, "wrapped", [])
    monkeypatch.setattr(prefill_attention._State, "skip", False)
    yield separate, inside
    prefill_attention.configure("exact")


def _call(impl, metadata):
    out = torch.ones(5, 8)
    return impl.forward(None, None, None, None, None, metadata, out), impl.calls


def test_skip_zeroes_prefill_batches_and_runs_decode_batches(fake_backends):
    separate, inside = fake_backends
    prefill_attention.configure("skip")
    prefill_attention.configure("skip")
    assert prefill_attention.wrapped() == ["fake_separate.Impl"]  # wrapped once
    before = prefill_attention.skipped_batches()
    impl = separate.Impl()
    for metadata in (SimpleNamespace(max_query_len=37), SimpleNamespace(num_prefills=1, max_query_len=1)):
        out, calls = _call(impl, metadata)
        assert calls == 0 and torch.count_nonzero(out) == 0
    assert prefill_attention.skipped_batches() == before + 2
    for metadata in (SimpleNamespace(max_query_len=1), SimpleNamespace(num_prefills=0, max_query_len=9), None):
        out, calls = _call(impl, metadata)
        assert torch.all(out == 7.0)
    assert impl.calls == 3 and prefill_attention.skipped_batches() == before + 2
    # the backend that writes its cache inside forward keeps its prefill exact
    out, calls = _call(inside.Impl(), SimpleNamespace(max_query_len=37))
    assert calls == 1 and torch.all(out == 7.0)


def test_exact_mode_passes_every_batch_through_a_wrapped_forward(fake_backends):
    separate, _ = fake_backends
    prefill_attention.configure("skip")
    prefill_attention.configure("exact")
    out, calls = _call(separate.Impl(), SimpleNamespace(max_query_len=37))
    assert calls == 1 and torch.all(out == 7.0)
    with pytest.raises(ValueError, match="prefill_attention 'partial' unknown; use one of exact, skip"):
        prefill_attention.configure("partial")
