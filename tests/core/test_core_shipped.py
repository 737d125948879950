"""What orchestrate ships to other machines: one registry, linted and compiled for Python 3.8.

Every program in ``hostside.shipping.SHIPPED`` runs on nodes with the standard library only and
often an old Python (a compute node's system python3, Python 3.8 on an older distribution), with
``-S``. So each module it carries must be in pyproject's Python 3.8 target (ruff then flags
newer syntax), and each whole program must compile under Python 3.8 where one is installed.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path, PurePosixPath

import pytest
import tomllib

from orchestrate.hostside.shipping import SHIPPED, module_source, program
from tests.support.python38 import python38

REPO = Path(__file__).resolve().parents[2]


def _py38_patterns() -> list[str]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    targets = config["tool"]["ruff"]["per-file-target-version"]
    return [pattern for pattern, version in targets.items() if version == "py38"]


def _file_of(module: str) -> str:
    return module.replace(".", "/") + ".py"


@pytest.mark.unit
def test_every_shipped_module_is_linted_for_python_3_8() -> None:
    patterns = _py38_patterns()
    missing = sorted({module for modules in SHIPPED.values() for module in modules
                      if not any(PurePosixPath(_file_of(module)).match(p) or
                                 _file_of(module).startswith(p.removesuffix("**"))
                                 for p in patterns)})
    assert missing == []


def _module_level_imports(source: str) -> list[str]:
    """The top-level packages a module imports when it loads (not inside its functions: a
    shipped module may import torch lazily, in the rank that has it)."""
    found: list[str] = []
    pending: list[ast.AST] = list(ast.parse(source).body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import):
            found.extend(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append(node.module.split(".")[0])
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            pending.extend(ast.iter_child_nodes(node))
    return found


def _orchestrate_imports(source: str) -> set[str]:
    """The orchestrate modules a module imports when it loads (module level, as above)."""
    found: set[str] = set()
    pending: list[ast.AST] = list(ast.parse(source).body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("orchestrate."))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                node.module.startswith("orchestrate."):
            found.add(node.module)
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            pending.extend(ast.iter_child_nodes(node))
    return found


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_every_shipped_program_carries_what_its_modules_import(name: str) -> None:
    """A shipped program runs with ``-S`` where orchestrate is not installed: a module it
    carries that imports one it does not carry fails there at start (the watchdog did, when
    the lease book came to import gpuuse)."""
    carried = set(SHIPPED[name])
    for module in SHIPPED[name]:
        wanted = _orchestrate_imports(module_source(module))
        assert wanted <= carried, f"{name}: {module} imports {sorted(wanted - carried)}"


@pytest.mark.unit
def test_every_shipped_module_uses_only_the_standard_library() -> None:
    allowed = set(sys.stdlib_module_names) | {"orchestrate", "__future__"}
    for modules in SHIPPED.values():
        for module in modules:
            imported = set(_module_level_imports(module_source(module)))
            assert imported <= allowed, f"{module} imports {sorted(imported - allowed)}"


@pytest.mark.process
@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_every_shipped_program_compiles_on_python_3_8(name: str, tmp_path: Path) -> None:
    python = python38()
    if python is None:
        pytest.skip("no Python 3.8 interpreter on this machine")
    text = program(SHIPPED[name], "pass")
    path = tmp_path / f"{name}.py"
    path.write_text(text, encoding="utf-8")
    sources = [module_source(m) for m in SHIPPED[name]]
    check = ("import sys\n"
             "for path in sys.argv[1:]:\n"
             "    compile(open(path, encoding='utf-8').read(), path, 'exec')\n")
    modules = []
    for i, source in enumerate(sources):
        module_file = tmp_path / f"m{i}.py"
        module_file.write_text(source, encoding="utf-8")
        modules.append(str(module_file))
    done = subprocess.run([python, "-S", "-c", check, str(path), *modules],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
