"""The package's layers, read from its source (nothing imported): no import cycle anywhere, and
the adaptation core (every runtime module below the policy) never imports the policy, the
method loader, the server or the CLI, directly or through another module. Imports under
``if TYPE_CHECKING:`` are for annotations only and do not count; imports inside functions do."""

from __future__ import annotations

import ast
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]

# The policy and what is built on it; everything else in eva0_edge.runtime is the core below it
ABOVE_CORE = ("eva0_edge.cli", "eva0_edge.runtime.cli", "eva0_edge.runtime.policy",
              "eva0_edge.runtime.fitting",
              "eva0_edge.runtime.methods", "eva0_edge.runtime.server")
# the runtime package itself: the public API facade (``from eva0_edge.runtime import ...``)
FACADE = "eva0_edge.runtime"


def package_modules() -> dict[str, Path]:
    """Every module of the distribution (pyproject's package-dir), by import name."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    modules = {}
    for package in config["packages"]:
        parent = max((name for name in config["package-dir"]
                      if package == name or package.startswith(name + ".")), key=len)
        folder = ROOT.joinpath(config["package-dir"][parent], *package[len(parent):].split(".")[1:])
        for path in sorted(folder.glob("*.py")):
            modules[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return modules


def imported(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package modules ``module`` imports, outside ``if TYPE_CHECKING:`` blocks."""
    package = module if path.stem == "__init__" else module.rsplit(".", 1)[0]
    found: set[str] = set()

    def resolve(name: str) -> None:
        while name not in known and "." in name:
            name = name.rsplit(".", 1)[0]
        if name in known and name != module:
            found.add(name)

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    resolve(alias.name)
            elif isinstance(child, ast.ImportFrom):
                base = package
                for _ in range(child.level - 1):
                    base = base.rsplit(".", 1)[0]
                target = (f"{base}.{child.module}" if child.module else base) if child.level \
                    else child.module or ""
                for alias in child.names:
                    resolve(f"{target}.{alias.name}")
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def import_graph() -> dict[str, set[str]]:
    known = package_modules()
    return {module: imported(module, path, known) for module, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                connect(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def above_core(module: str) -> bool:
    return module == FACADE or any(
        module == name or module.startswith(name + ".") for name in ABOVE_CORE)


def test_the_graph_sees_the_package():
    """The reader finds the modules and their imports (a graph of nothing would pass all)."""
    graph = import_graph()
    assert {"eva0_edge.runtime.engine", "eva0_edge.runtime.policy",
            "eva0_edge.runtime.server.worker", "eva0_edge.fleet.sync"} <= graph.keys()
    assert "eva0_edge.runtime.engine" in graph["eva0_edge.runtime.methods"] | \
        graph["eva0_edge.runtime.policy"]
    assert "eva0_edge.runtime.policy" in graph["eva0_edge.runtime.server.worker"]
    assert "eva0_edge.runtime.estimator" in graph["eva0_edge.runtime.engine"]


def test_no_import_cycle_in_the_package():
    assert cycles(import_graph()) == []


def test_the_adaptation_core_never_imports_the_policy_the_server_or_the_cli():
    graph = import_graph()

    def reached(module: str) -> set[str]:
        seen: set[str] = set()
        todo = [module]
        while todo:
            for other in graph[todo.pop()] - seen:
                seen.add(other)
                todo.append(other)
        return seen

    core = [m for m in graph if m.startswith("eva0_edge.runtime") and not above_core(m)]
    assert "eva0_edge.runtime.engine" in core and "eva0_edge.runtime.foa" in core
    leaks = {m: sorted(filter(above_core, reached(m))) for m in core}
    assert {m: up for m, up in leaks.items() if up} == {}
