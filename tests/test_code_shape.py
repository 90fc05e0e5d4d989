"""The codebase keeps its shape: small functions and modules, models free of torch.distributed,
and a layered import graph (no module imports, directly or not, a module that imports it)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import ROOT

FRAMEWORK = ROOT / "framework"


def _modules() -> dict[str, Path]:
    out = {}
    for path in FRAMEWORK.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _module_level_imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """Framework modules imported at module level (imports inside functions are deferred on
    purpose and do not make a layer depend on another at import time)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        found |= {n for n in names if n in modules}
    return found


def test_framework_import_graph_has_no_cycles():
    modules = _modules()
    graph = {name: _module_level_imports(path, modules) for name, path in modules.items()}
    for name in graph:  # a package's __init__ is imported with any of its submodules
        parent = name.rsplit(".", 1)[0]
        if parent in graph and parent != name:
            graph[name].add(parent)
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if dep == node or (dep in graph and node.startswith(dep + ".")):
                continue  # a submodule and its own package
            assert state.get(dep) != 1, "import cycle: " + " -> ".join([*trail, node, dep])
            if dep not in state:
                visit(dep, [*trail, node])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])


def test_functions_and_modules_stay_small():
    too_long = []
    for path in FRAMEWORK.rglob("*.py"):
        source = path.read_text()
        assert source.count("\n") <= 400, f"{path.relative_to(ROOT)}: {source.count(chr(10))} lines"
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > 80:
                too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert not too_long, too_long
