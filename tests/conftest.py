"""Shared fixtures: a fresh random generator per test, its seed printed so a failure can be replayed."""

from __future__ import annotations

import pytest
import torch

from locks_toolkit.kernels.reference.testing import fresh_seed, generator


@pytest.fixture
def gen() -> torch.Generator:
    seed = fresh_seed()
    print(f"seed={seed} (replay with LOCKS_TEST_SEED={seed})")
    return generator(seed)
