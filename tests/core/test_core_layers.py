"""The layers hold: each package loads only the packages below it, and the core stays pure.

The packages are stacked, bottom up (docs/architecture.md):
``hostside < core (spec < plan < render) < diagnosis < report | probe < train < run < backends
< doctor < cli`` (the report reads the diagnosis' records and the plan; the metrics record that
the trainer writes and the report reads sits in core). Each one is imported whole (every module
in it) in a fresh interpreter, and the ``orchestrate`` packages that then sit in
``sys.modules`` must all be below it: an import that runs back up, at module level or through
another module, fails here. The core also loads no process, database, SSH, Slurm or torch code,
and the host side nothing but the standard library.

A static pass (a ``unit`` test, a fraction of a second) reads every module instead: every
import, at module level, inside a function or under ``TYPE_CHECKING``, and every string that
names an ``orchestrate.`` module, must point at the module's own layer or one below it. It
catches what loading cannot: an import in a function that does not run at import, and a module
named as a string and imported by name.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

pytestmark = pytest.mark.process  # fresh interpreters (the static pass: unit, marked below)

#: Bottom up; every package may load the ones before it in its own chain.
BELOW: dict[str, set[str]] = {
    "hostside": set(),
    "core.spec": {"core"},
    "core.plan": {"core", "core.spec"},
    "core.render": {"core", "core.spec", "core.plan", "hostside"},
    "diagnosis": {"core", "hostside"},
    "report": {"core", "core.spec", "core.plan", "hostside", "diagnosis"},
    "probe": {"core", "core.spec", "hostside"},
}
CORE = {"core", "core.spec", "core.plan", "core.render"}
BELOW["core"] = CORE | {"hostside"}
BELOW["train"] = BELOW["core"] | {"diagnosis"}
BELOW["run"] = BELOW["train"] | {"report", "probe", "train"}
BELOW["backends"] = BELOW["run"] | {"run"}
BELOW["doctor"] = BELOW["backends"] | {"backends"}
BELOW["cli"] = BELOW["doctor"] | {"doctor"}

#: What the pure core must never load, and what the host side may load beyond the stdlib (none).
FORBIDDEN_IN_CORE = ("subprocess", "sqlite3", "fabric", "paramiko", "submitit", "torch")
THIRD_PARTY = ("pydantic", "yaml", "jinja2", "click", "rich", "fabric", "submitit", "torch")

_PROBE = """
import importlib, json, pkgutil, sys
package = importlib.import_module("orchestrate." + sys.argv[1])
names = [package.__name__] + [
    info.name for info in pkgutil.walk_packages(package.__path__, package.__name__ + ".")
    if not info.name.endswith("__main__")]
for name in names:
    importlib.import_module(name)
def layer(module):
    parts = module.split(".")[1:]
    sub = ".".join(parts[:2])
    return sub if parts[0] == "core" and hasattr(sys.modules["orchestrate." + sub], "__path__") \
        else parts[0]
loaded = sorted({layer(m) for m in sys.modules if m.startswith("orchestrate.")})
print(json.dumps({"layers": loaded, "modules": sorted(sys.modules)}))
"""


def _load(package: str) -> tuple[set[str], set[str]]:
    done = subprocess.run([sys.executable, "-c", _PROBE, package], capture_output=True,
                          text=True, check=True)
    found = json.loads(done.stdout)
    return set(found["layers"]), set(found["modules"])


@pytest.mark.parametrize("package", sorted(BELOW))
def test_a_package_loads_only_the_layers_below_it(package: str) -> None:
    layers, _ = _load(package)
    allowed = BELOW[package] | {package, "version", package.split(".")[0]}
    assert layers - allowed == set(), f"{package} reaches up into {sorted(layers - allowed)}"


def test_importing_the_core_loads_nothing_impure() -> None:
    _, modules = _load("core")
    assert sorted(m for m in FORBIDDEN_IN_CORE if m in modules) == []


def test_the_host_side_loads_only_the_standard_library() -> None:
    _, modules = _load("hostside")
    assert sorted(m for m in THIRD_PARTY if m in modules) == []


def test_the_check_can_fail() -> None:
    """The checks above can fail: the backends do load what the core must not, and the CLI
    sits above every other layer."""
    layers, modules = _load("backends")
    assert "submitit" in modules and "sqlite3" in modules
    assert "run" in layers and "run" not in BELOW["core"]



# The static pass: what the import test above cannot see (an upward import inside a function
# that does not run at import, one under TYPE_CHECKING, a module named in a string and imported
# by name, as hostside/shipping.py once did: review E1). Every ``import``/``from`` in every
# module, at any depth, and every string constant that starts with ``orchestrate.``, is mapped
# to its layer and checked against BELOW. Parsing all of orchestrate takes a second or more, so
# a text scan first finds the files that could break the rule (every import or string it checks
# is also a dotted name in the file's text, bar the few forms ``_suspect`` treats apart) and
# only those are parsed.

PACKAGE = Path(__file__).resolve().parents[2] / "orchestrate"
#: The root's face (``orchestrate.submit_function``, ``python -m orchestrate``, the api):
#: above every layer. ``version`` may be imported by every layer.
FACE = {"", "api", "__main__"}
ANYWHERE = {"version"}
#: Programs any layer may name in a command line (``python -m``): run, never imported.
COMMANDS = {"orchestrate.train"}
_DOTTED = re.compile(r"orchestrate(?:\.\w+)+")
_FROM_PACKAGE = re.compile(
    r"from[ \t]+(orchestrate(?:\.core)?)[ \t]+import[ \t]+(\([^)]*\)|[^\n]*)")
_RELATIVE = re.compile(r"from[ \t]+\.")


@cache
def layer_of(module: str, root: Path = PACKAGE) -> str:
    """The layer a module (dotted name, ``orchestrate`` first) belongs to: BELOW's keys, a root
    module's name, or ``""`` for the root package."""
    parts = module.split(".")[1:]
    if not parts:
        return ""
    if parts[0] == "core" and len(parts) > 1 and (root / "core" / parts[1]).is_dir():
        return f"core.{parts[1]}"
    return parts[0]


def _may_import(importer: str, imported: str) -> bool:
    if importer in FACE or imported in ANYWHERE or imported == importer:
        return True
    return imported in BELOW.get(importer, set())


def _suspect(importer: str, text: str, root: Path) -> set[int]:
    """The lines of ``text`` that could name a layer ``importer`` may not import: a dotted name
    that does, a relative import, ``from orchestrate[.core] import`` a package of another
    layer. Every import or string :func:`upward` would report is on one of them."""
    at: list[int] = [found.start() for found in _RELATIVE.finditer(text)]
    for found in _DOTTED.finditer(text):
        if not _may_import(importer, layer_of(found.group(0), root)):
            at.append(found.start())
    for found in _FROM_PACKAGE.finditer(text):
        names = [f"{found.group(1)}.{name}" for name in re.findall(r"\w+", found.group(2))]
        if not all(_may_import(importer, layer_of(name, root)) for name in names):
            at.append(found.start())
    return {text.count("\n", 0, start) + 1 for start in at}


def _near(tree: ast.AST, lines: set[int]) -> Iterator[ast.AST]:
    """The nodes of ``tree`` whose lines (decorators included) hold one of ``lines``."""
    pending = [tree]
    while pending:
        node = pending.pop()
        first = getattr(node, "lineno", None)
        if first is not None:
            first = min([first, *(d.lineno for d in getattr(node, "decorator_list", ()))])
            last = getattr(node, "end_lineno", None) or first
            if not any(first <= line <= last for line in lines):
                continue
        yield node
        pending.extend(ast.iter_child_nodes(node))


def _is_module(dotted: str, root: Path) -> bool:
    where = root.parent / dotted.replace(".", "/")
    return where.is_dir() or where.with_suffix(".py").is_file()


def _named(node: ast.AST, package: str, root: Path) -> list[str]:
    """The orchestrate modules ``node`` imports or names (``package``: the package it is in)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative: from the package the module is in, or one above it
            up = package.split(".")[:len(package.split(".")) - node.level + 1]
            base = ".".join([*up, base]) if base else ".".join(up)
        return [f"{base}.{alias.name}" if _is_module(f"{base}.{alias.name}", root) else base
                for alias in node.names]
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        found = _DOTTED.match(node.value)
        return [found.group(0)] if found and found.group(0) not in COMMANDS else []
    return []


def upward(sources: dict[str, str], root: Path = PACKAGE) -> list[str]:
    """``file:line: what`` for every import or name in ``sources`` (path relative to the
    repository -> text) that reaches a layer its module may not import."""
    found: list[tuple[str, int, str]] = []
    for path, text in sources.items():
        module = path.removesuffix(".py").replace("/", ".")
        package = module.removesuffix(".__init__") if module.endswith(".__init__") \
            else module.rsplit(".", 1)[0]
        importer = layer_of(module.removesuffix(".__init__"), root)
        lines = _suspect(importer, text, root)
        if not lines:
            continue
        for node in _near(ast.parse(text, path), lines):
            for name in _named(node, package, root):
                target = layer_of(name, root)
                if name.split(".")[0] == "orchestrate" and not _may_import(importer, target):
                    found.append((path, getattr(node, "lineno", 0),
                                  f"{importer or 'root'} names {name} ({target or 'root'})"))
    return [f"{path}:{line}: {what}" for path, line, what in sorted(found)]


def _sources() -> dict[str, str]:
    base = PACKAGE.parent
    return {str(path.relative_to(base)): path.read_text(encoding="utf-8")
            for path in PACKAGE.rglob("*.py")}


@pytest.mark.unit
def test_no_module_names_a_layer_above_its_own() -> None:
    """Static: every import (module level, in a function, under TYPE_CHECKING) and every
    ``"orchestrate.…"`` string, in every module."""
    assert upward(_sources()) == []


@pytest.mark.unit
def test_the_static_pass_can_fail() -> None:
    """An upward import the import test cannot see (in a function that does not run at import,
    under TYPE_CHECKING, from a package, relative, or a module named as a string) is named with
    its file and line; the same module without them passes."""
    path = "orchestrate/core/plan/ports.py"
    text = (PACKAGE / "core" / "plan" / "ports.py").read_text(encoding="utf-8")
    lines = len(text.splitlines())
    planted = text + (
        "\n\ndef _planted() -> None:\n"
        "    from orchestrate.backends.detached import DetachedBackend\n"
        "\n\nif TYPE_CHECKING:\n"
        "    import orchestrate.run.store\n"
        "_BY_NAME = 'orchestrate.cli.main'\n"
        "from orchestrate.core import render\n"
        "from ... import doctor\n")
    assert upward({path: planted}) == [
        f"{path}:{lines + 4}: core.plan names orchestrate.backends.detached (backends)",
        f"{path}:{lines + 8}: core.plan names orchestrate.run.store (run)",
        f"{path}:{lines + 9}: core.plan names orchestrate.cli.main (cli)",
        f"{path}:{lines + 10}: core.plan names orchestrate.core.render (core.render)",
        f"{path}:{lines + 11}: core.plan names orchestrate.doctor (doctor)",
    ]
    assert upward({path: text}) == []
    for line in planted.splitlines()[lines + 3:]:  # each alone is enough to parse the file
        assert bool(_suspect("core.plan", line, PACKAGE)) == (line.strip() not in (
            "", "def _planted() -> None:", "if TYPE_CHECKING:"))
