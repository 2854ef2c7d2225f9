"""The package's layers: the import graph of `smartremat/`, read from the source (imports at
module level, inside functions and under `TYPE_CHECKING` alike), has no cycle; no module imports
a package module inside a function (optional dependencies such as matplotlib aside), and none
imports another module's private name."""

from __future__ import annotations

import ast
import pathlib

import pytest

import smartremat

PACKAGE = pathlib.Path(smartremat.__file__).parent


def _imports(path: pathlib.Path) -> list[tuple[str, str, bool]]:
    """`(module, name, inside a function)` for each name `path` imports from the package
    (`name` is `""` for `from . import module` / `import smartremat`)."""
    tree = ast.parse(path.read_text())
    found: list[tuple[str, str, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.ImportFrom) and (child.level > 0 or (child.module or "").startswith("smartremat")):
                base = (child.module or "").removeprefix("smartremat").lstrip(".")
                for alias in child.names:
                    if base:
                        found.append((base, alias.name, in_function))
                    else:  # `from . import _x`: the module itself
                        found.append((alias.name, "", in_function))
            elif isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name.split(".")[0] == "smartremat":
                        found.append((alias.name.removeprefix("smartremat").lstrip(".") or "__init__", "", in_function))
            visit(child, inner)

    visit(tree, False)
    return found


def _modules() -> dict[str, list[tuple[str, str, bool]]]:
    return {p.stem: _imports(p) for p in sorted(PACKAGE.glob("*.py"))}


def graph() -> dict[str, set[str]]:
    """`{module: the package modules it imports}` (`__init__` for `import smartremat`)."""
    modules = _modules()
    return {m: {target for target, _, _ in found if target in modules} for m, found in modules.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, or of one importing itself
    (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges.get(v, ()):
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return out


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set(), "c": {"c"}}) == [["c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_import_graph_has_no_cycle():
    assert cycles(graph()) == []


def test_no_package_import_inside_a_function():
    late = [(m, target, name) for m, found in _modules().items() for target, name, inside in found if inside]
    assert late == []


def test_no_private_name_crosses_modules():
    crossing = [(m, target, name) for m, found in _modules().items() for target, name, _ in found
                if name.startswith("_") and not name.startswith("__")]
    assert crossing == []


@pytest.mark.parametrize("module", sorted(p.stem for p in PACKAGE.glob("*.py")))
def test_each_module_is_short(module):
    assert len((PACKAGE / f"{module}.py").read_text().splitlines()) <= 450
