"""The suite keeps the checkout off sys.path (tests/conftest.py): its top-level folders (kernels/, suites/, ...)
are the package's modules, not importable names, and kernels/ would stand in for PyPI's `kernels`, which
transformers >= 5.25 imports (every vLLM engine of the suite then failed to start)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_process_started_from_the_checkout_does_not_import_its_folders_as_top_level_modules():
    # as vLLM starts its engine workers: `python -c`, from the test's working directory, with its environment
    probe = "import importlib.util as u; s = u.find_spec('kernels'); print(s.origin if s else '')"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=os.environ, capture_output=True, text=True, check=True)
    origin = out.stdout.strip()
    assert not origin.startswith(str(ROOT / "kernels")), (
        f"`import kernels` finds {origin}: tests/conftest.py must set PYTHONSAFEPATH=1 for the processes "
        "the tests start, so that the checkout's folders do not shadow installed modules")
    assert str(ROOT) not in sys.path and "" not in sys.path
