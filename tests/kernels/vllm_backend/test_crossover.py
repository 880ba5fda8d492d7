"""The crossover rule: which decode steps run dense, from the KV bytes their dense attention would read."""

from __future__ import annotations

import numpy as np
import pytest
from locks_toolkit.kernels.config import ConfigError
from locks_toolkit.kernels.vllm_backend.crossover import H200_MAX_DENSE_MIB, MIB, CrossoverRule
from locks_toolkit.kernels.vllm_backend.settings import parse_settings


def test_a_step_runs_dense_exactly_up_to_the_rule_bytes(gen):
    import torch

    heads, dim, elt = 4, 128, 2
    lens = torch.randint(1, 40_000, (int(torch.randint(1, 9, (1,), generator=gen)),), generator=gen).numpy()
    pages = int(sum(-(-n // 16) for n in lens))
    page_bytes = heads * 2 * 16 * dim * elt
    assert CrossoverRule(1.0).dense_bytes(lens, heads, dim, elt) == pages * page_bytes
    at = pages * page_bytes / MIB
    assert CrossoverRule(at).runs_dense(lens, heads, dim, elt)  # at the threshold: dense
    assert not CrossoverRule(at - 1 / MIB).runs_dense(lens, heads, dim, elt)  # one byte below it: sparse
    # padding rows (seq_len 0) read nothing and change nothing; a step of padding only never runs dense
    padded = np.concatenate([lens, np.zeros(3, dtype=lens.dtype)])
    assert CrossoverRule(at).runs_dense(padded, heads, dim, elt)
    assert not CrossoverRule(1e9).runs_dense(np.zeros(4, dtype=np.int64), heads, dim, elt)
    assert not CrossoverRule().runs_dense(lens, heads, dim, elt)  # off


def test_the_setting_parses_and_bad_values_name_the_fix():
    assert not parse_settings({}).crossover.enabled and "crossover=off" in parse_settings({}).describe()
    assert parse_settings({"crossover": "h200"}).crossover.max_dense_mib == H200_MAX_DENSE_MIB
    assert "crossover=12.5MiB" in parse_settings({"crossover": 12.5}).describe()
    for bad in (0, -1, "on", True, [3]):
        with pytest.raises(ConfigError, match="crossover must be"):
            parse_settings({"crossover": bad})
