"""No import circles between the modules of one package, checked on the source.

The layers test (``test_core_layers.py``) keeps each package from importing a package above it;
this one keeps the modules inside a package (``orchestrate.train``, ``orchestrate.backends``
with its subpackages, ...) from importing one another in a circle. A circle is read off the
source, not off a running import: an import inside a function or under ``TYPE_CHECKING`` counts
as much as one at the top, because hiding one end of a circle that way is what keeps two
modules one concept split in two (review C4, 2026-12-04).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
TOP = "orchestrate"


def module_name(path: Path, root: Path) -> str:
    """``orchestrate/train/saving.py`` -> ``orchestrate.train.saving`` (a package: its name)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported(tree: ast.AST, name: str, is_package: bool, known: Iterable[str]) -> set[str]:
    """The ``known`` modules that a module's source imports anywhere in it (functions and
    ``TYPE_CHECKING`` blocks included); ``from package import module`` names the module."""
    modules = set(known)
    here = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")[: len(here.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {module for module in found if module in modules and module != name}


def package_of(module: str) -> str:
    """The package whose modules may not import one another in a circle: the top-level one
    below ``orchestrate`` (``orchestrate.backends.local.supervisor``: ``orchestrate.backends``)."""
    return ".".join(module.split(".")[:2])


def edges_within_packages(sources: Mapping[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """``module -> modules it imports`` from ``{module: (source, is_package)}``, keeping only
    imports between modules of one package."""
    edges: dict[str, set[str]] = {}
    for name, (source, is_package) in sources.items():
        targets = imported(ast.parse(source), name, is_package, sources)
        edges[name] = {t for t in targets if package_of(t) == package_of(name)}
    return edges


def cycles(edges: Mapping[str, set[str]]) -> list[list[str]]:
    """Every group of modules that import one another in a circle (Tarjan's strongly connected
    components of more than one module), each sorted, as one circle through them."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(edges.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(found)


def circle(group: list[str], edges: Mapping[str, set[str]]) -> str:
    """One circle through a group, as ``a -> b -> a`` (for the failure message)."""
    members = set(group)
    path = [group[0]]
    while True:
        step = min(t for t in edges[path[-1]] if t in members)
        if step in path:
            return " -> ".join([*path[path.index(step):], step])
        path.append(step)


def _sources(root: Path) -> dict[str, tuple[str, bool]]:
    return {module_name(p, root): (p.read_text(encoding="utf-8"), p.name == "__init__.py")
            for p in sorted((root / TOP).rglob("*.py")) if "__pycache__" not in p.parts}


def test_no_import_circle_inside_a_package() -> None:
    edges = edges_within_packages(_sources(ROOT))
    assert [circle(group, edges) for group in cycles(edges)] == []


def test_the_check_sees_a_circle_hidden_in_a_function_or_type_checking() -> None:
    sources = {
        "orchestrate.train": ("", True),
        "orchestrate.train.a": ("from orchestrate.train import b\n", False),
        "orchestrate.train.b": ("def f():\n    from orchestrate.train.c import g\n", False),
        "orchestrate.train.c": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                "    from orchestrate.train import a\n", False),
        "orchestrate.train.d": ("import orchestrate.train.a\n", False),
        # across packages: the layers test's business, not a circle here
        "orchestrate.run.x": ("from orchestrate.backends import y\n", False),
        "orchestrate.backends.y": ("from orchestrate.run import x\n", False),
        "orchestrate.backends.local.z": ("from ..y import thing\n", False),
    }
    edges = edges_within_packages(sources)
    assert edges["orchestrate.backends.local.z"] == {"orchestrate.backends.y"}
    found = cycles(edges)
    assert found == [["orchestrate.train.a", "orchestrate.train.b", "orchestrate.train.c"]]
    assert circle(found[0], edges) == ("orchestrate.train.a -> orchestrate.train.b -> "
                                       "orchestrate.train.c -> orchestrate.train.a")
