"""The house's import rules, read from the source: layers import only downwards and no module imports itself
back through a circle. Layers, bottom up: kernels, harness, suites, reports, locks_cli; reports read only
the harness's store layer; the bench path never imports the lab tools."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("kernels", "harness", "suites", "reports", "locks_cli")
STORE_LAYER = {"harness.store", "harness.record_schemas", "harness.record_migrations"}
# Modules the store layer itself may import (the migrations derive old records' fields from the model presets).
STORE_LAYER_NEEDS = {"harness.presets", "harness.weights"}


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the package modules it imports (relative or `locks_toolkit.` absolute, at any depth)."""
    modules = {_module_name(p, root): p for layer in LAYERS for p in (root / layer).rglob("*.py")}
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
                elif (node.module or "").startswith("locks_toolkit."):
                    base = node.module.removeprefix("locks_toolkit.")
                else:
                    continue
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name.removeprefix("locks_toolkit.") for a in node.names if a.name.startswith("locks_toolkit.")]
            edges[name].update(t for t in targets if t in modules and t != name)
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in list(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(edges.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def _arrows(graph, where=lambda source, target: True) -> list[str]:
    return sorted(f"{s} -> {t}" for s, targets in graph.items() for t in targets if where(s, t))


def test_no_layer_imports_a_layer_above_it(graph):
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    assert _arrows(graph, lambda s, t: rank[t.split(".")[0]] > rank[s.split(".")[0]]) == []


def test_reports_read_only_the_store_layer_of_the_harness(graph):
    assert _arrows(graph, lambda s, t: s.startswith("reports") and not t.startswith("reports") and t not in STORE_LAYER) == []
    allowed = STORE_LAYER | STORE_LAYER_NEEDS | {"kernels.config"}
    assert _arrows(graph, lambda s, t: s in STORE_LAYER | STORE_LAYER_NEEDS and t not in allowed) == []


def test_the_bench_path_never_imports_the_lab(graph):
    product = lambda name: name.startswith("harness.") and not name.startswith("harness.lab")
    assert _arrows(graph, lambda s, t: product(s) and t.startswith("harness.lab")) == []


def test_no_module_imports_itself_back_through_a_circle(graph):
    assert circles(graph) == []


def test_the_graph_sees_relative_absolute_and_circular_imports(tmp_path):
    """The reader itself: a planted upward import and a planted circle are found."""
    for layer in LAYERS:
        (tmp_path / layer).mkdir()
        (tmp_path / layer / "__init__.py").write_text("")
    (tmp_path / "kernels" / "a.py").write_text("from ..harness import b\n")
    (tmp_path / "harness" / "b.py").write_text("def f():\n    from locks_toolkit.kernels.a import x\n")
    edges = import_graph(tmp_path)
    assert edges["kernels.a"] == {"harness", "harness.b"} and edges["harness.b"] == {"kernels.a"}
    assert circles(edges) == [["harness.b", "kernels.a"]]
