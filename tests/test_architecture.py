"""The package's imports run one way, and no module imports itself back through others.

The layers, top to bottom (a module may import its own package and any layer below, never one above or
beside it):

    cli, serve  →  pipeline  →  text  →  weights, sampling, parallel  →  models  →  kernels  →  registry

Every import counts: at the top of a module, inside a function (imported late to save start-up time) and
under `TYPE_CHECKING` alike, since each one is a dependency a reader must follow. The same holds for the
device scripts in `scripts/`: no circle among them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "flux_runtime"

LAYERS = {
    "cli": 6,
    "serve": 6,
    "pipeline": 5,
    "text": 4,
    "weights": 3,
    "sampling": 3,
    "parallel": 3,
    "models": 2,
    "kernels": 1,
    "registry": 0,
    "command_help": 0,
    "assets": 0,
}


def _module_name(path: Path, root: Path, prefix: str) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([prefix, *parts]) if prefix else ".".join(parts)


def _imports(path: Path, known: set[str]) -> set[str]:
    """The modules of `known` that `path` imports anywhere in its body (`from pkg import sub` names `pkg.sub`)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in known else node.module)
    return found & known


def _graph(root: Path, prefix: str) -> dict[str, set[str]]:
    files = {_module_name(p, root, prefix): p for p in root.rglob("*.py")}
    known = set(files)
    return {name: _imports(path, known) - {name} for name, path in files.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _package_graph() -> dict[str, set[str]]:
    # a package's __init__ re-exports its modules for users; the arrows that matter are between the modules
    graph = _graph(PACKAGE, "flux_runtime")
    inits = {_module_name(p, PACKAGE, "flux_runtime") for p in PACKAGE.rglob("__init__.py")}
    return {m: deps - inits for m, deps in graph.items() if m not in inits}


def _layer(module: str) -> tuple[str, int]:
    top = module.split(".")[1]
    assert top in LAYERS, f"{module}: its package {top!r} has no layer in LAYERS (add it)"
    return top, LAYERS[top]


def test_every_import_runs_down_the_layers():
    wrong = []
    for module, deps in _package_graph().items():
        top, level = _layer(module)
        for dep in deps:
            dep_top, dep_level = _layer(dep)
            if dep_top != top and dep_level >= level:
                wrong.append(f"{module} imports {dep} ({top} is layer {level}, {dep_top} {dep_level})")
    assert not wrong, "imports against the layers:\n" + "\n".join(sorted(wrong))


@pytest.mark.parametrize("where", ["flux_runtime", "scripts"])
def test_no_import_circles(where):
    graph = _package_graph() if where == "flux_runtime" else _graph(ROOT / "scripts", "")
    assert _circles(graph) == []


def test_the_circle_finder_finds_circles():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []
