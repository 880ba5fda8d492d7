"""Shared fixtures: a fresh random generator per test, its seed printed so a failure can be replayed."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# The checkout's top-level folders are the package's modules, not importable names. `python -m pytest` puts the
# checkout on sys.path, where kernels/ stands in for PyPI's `kernels` (which transformers >= 5.25 imports): take
# it off before anything imports, and keep the processes the tests start (vLLM's `python -c` workers) off it.
_CHECKOUT = str(Path(__file__).resolve().parents[1])
sys.path[:] = [p for p in sys.path if p not in ("", _CHECKOUT)]
os.environ["PYTHONSAFEPATH"] = "1"

import pytest  # noqa: E402
import torch
from locks_toolkit.kernels.testing import fresh_seed, generator


@pytest.fixture
def gen() -> torch.Generator:
    seed = fresh_seed()
    print(f"seed={seed} (replay with LOCKS_TEST_SEED={seed})")
    return generator(seed)


GOLDEN = Path(__file__).parent / "golden"


def check_golden(name: str, text: str) -> None:
    """`text` equals tests/golden/NAME; UPDATE_GOLDEN=1 rewrites the file instead (review the diff)."""
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.write_text(text, encoding="utf-8")
        return
    assert path.exists(), f"golden file {path} missing; run with UPDATE_GOLDEN=1 once and review it"
    assert text == path.read_text(encoding="utf-8"), f"{name} differs from its golden file (UPDATE_GOLDEN=1 to accept)"


# Tests that start a vLLM engine run one after another on one worker under `pytest -n N --dist loadgroup`
# (`make test`), and the tests of the real model (they share its converted copy under ~/.cache/locks-toolkit and
# load it in an engine) one after another on another: two engines at once share the cores, and an engine test
# is mostly one busy thread (boot, scheduling) between short multi-threaded steps, so the two groups overlap
# well, while the kernel tests spread over every worker.
ENGINE_GROUPS = (("model", "model"), ("vllm", "engine"))  # (mark, xdist group), the first mark that matches


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which turns the group marks into node ids
def pytest_collection_modifyitems(config, items):
    for item in items:
        for mark, group in ENGINE_GROUPS:
            if item.get_closest_marker(mark):
                item.add_marker(pytest.mark.xdist_group(group))
                break
