"""The folders install under one import root; a subpackage missing from pyproject would vanish on install."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
TOP_FOLDERS = ("locks_cli", "kernels", "harness", "suites", "reports")


def _declared() -> tuple[set[str], dict[str, str]]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    setuptools = data["tool"]["setuptools"]
    return set(setuptools["packages"]), setuptools["package-dir"]


def test_every_package_folder_is_declared_under_the_import_root():
    declared, package_dir = _declared()
    on_disk = set()
    for top in TOP_FOLDERS:
        assert package_dir[f"locks_toolkit.{top}"] == top
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT).as_posix().replace("/", ".")
            on_disk.add(f"locks_toolkit.{rel}")
    assert on_disk == declared, f"add to / remove from pyproject [tool.setuptools].packages: {on_disk ^ declared}"


def test_no_top_level_module_is_installed_outside_the_root():
    declared, package_dir = _declared()
    assert all(name.startswith("locks_toolkit.") for name in declared)
    assert all(key.startswith("locks_toolkit.") for key in package_dir)


def test_installed_package_resolves_to_this_checkout():
    import locks_toolkit.kernels as kernels

    assert Path(kernels.__file__).resolve().parent == ROOT / "kernels"
