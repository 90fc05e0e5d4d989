"""The codebase keeps its shape: small functions and modules, models free of torch.distributed,
and a layered import graph: no module imports, directly or not, a module that imports it,
counting imports inside functions and the package `__init__` every import runs first."""

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


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Framework modules that importing `name` runs: every import statement in it, at module level
    or inside a function (a deferred import still needs its target when it runs), and for
    `a.b.c` each package on the way (`a.b`'s `__init__` runs first), except this module's own
    packages (already running when it is imported)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level-1
                parts = package.split(".")
                base = ".".join([*parts[: len(parts) - node.level + 1], *([base] if base else [])])
            targets = [base, *(f"{base}.{a.name}" for a in node.names)]
        for target in targets:
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                dep = ".".join(parts[:i])
                if dep in modules and dep != name and not name.startswith(dep + "."):
                    found.add(dep)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, trail: list[str]) -> list[str] | None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                path = [*trail, node]
                return path[path.index(dep) :] + [dep]
            if dep not in state and (cycle := visit(dep, [*trail, node])):
                return cycle
        state[node] = 2
        return None

    for name in sorted(graph):
        if name not in state and (cycle := visit(name, [])):
            return cycle
    return None


def test_framework_import_graph_has_no_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_graph_sees_function_local_imports_and_package_inits():
    """The check itself: a deferred import is an edge, and importing a submodule runs its package."""
    graph = import_graph()
    assert "framework.trainer" in graph["framework.launch"]  # launch imports the trainer inside a function
    assert "framework.config" not in graph["framework.config.validate"]  # its own package: already running
    # importing framework.parallel.dims runs framework.parallel's __init__ first
    assert {"framework.parallel", "framework.parallel.dims"} <= graph["framework.config.validate"]
    assert find_cycle({"a": {"b.c"}, "b.c": set(), "b": {"b.d"}, "b.d": {"a"}}) is None  # b.c alone
    assert find_cycle({"a": {"b", "b.c"}, "b.c": set(), "b": {"b.d"}, "b.d": {"a"}}) == ["a", "b", "b.d", "a"]


def test_functions_and_modules_stay_small():
    too_long = []
    for path in FRAMEWORK.rglob("*.py"):
        source = path.read_text()
        assert source.count("\n") <= 400, f"{path.relative_to(ROOT)}: {source.count(chr(10))} lines"
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > 80:
                too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert not too_long, too_long
