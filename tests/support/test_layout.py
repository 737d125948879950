"""Where the tests' helpers live: in tests/support/, imported by one name (``tests.support.x``).

A conftest is pytest's, not a module to import: pytest loads it under its own name, so a test
that also imports it runs it twice as two modules, and a reader must know which conftest holds
a helper. So conftests hold fixtures and hooks only (fixtures reach tests by pytest's own
discovery, never by an import or an ``__all__`` re-export), and every helper module is imported
from the repository root, never by a bare name that works only because pytest put its folder on
``sys.path``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
BENCH = TESTS.parent / "bench"

pytestmark = pytest.mark.unit


def _modules() -> Iterator[tuple[Path, ast.Module]]:
    """The suite's test modules, conftests and support modules (not the rank programs, which
    run as scripts, nor the user code that jobs import)."""
    for path in sorted(TESTS.rglob("*.py")):
        if (path.name.startswith("test_") or path.name == "conftest.py"
                or path.parent.name == "support"):
            yield path, ast.parse(path.read_text(), str(path))


def _imported(tree: ast.Module) -> Iterator[tuple[int, str]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.lineno, node.module


def _is_fixture(node: ast.FunctionDef) -> bool:
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if isinstance(target, ast.Attribute) and target.attr == "fixture":
            return True
    return False


def _public_helpers(tree: ast.Module) -> Iterator[tuple[int, str]]:
    """Top-level names of a conftest that are neither fixtures, pytest's hooks and settings, nor
    private."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names = [] if isinstance(node, ast.FunctionDef) and _is_fixture(node) else [node.name]
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
        else:
            continue
        yield from ((node.lineno, name) for name in names
                    if not name.startswith(("_", "pytest_")))


def test_no_module_imports_a_conftest_or_re_exports_fixtures() -> None:
    found = [f"{path.relative_to(TESTS)}:{line}: imports {name}"
             for path, tree in _modules() for line, name in _imported(tree)
             if name.split(".")[-1] == "conftest"]
    found += [f"{path.relative_to(TESTS)}:{node.lineno}: __all__"
              for path, tree in _modules() if path.name != "conftest.py"
              for node in tree.body if isinstance(node, ast.Assign)
              for target in node.targets if isinstance(target, ast.Name)
              and target.id == "__all__"]
    assert not found, "import helpers from tests.support, and let pytest find fixtures:\n" + \
        "\n".join(found)


def test_conftests_define_fixtures_and_hooks_only() -> None:
    found = [f"{path.relative_to(TESTS)}:{line}: {name}"
             for path, tree in _modules() if path.name == "conftest.py"
             for line, name in _public_helpers(tree)]
    assert not found, "a helper in a conftest belongs in tests/support/:\n" + "\n".join(found)


def test_helper_modules_are_imported_by_their_full_name() -> None:
    helpers = {path.stem for path in TESTS.rglob("*.py")
               if not path.name.startswith("test_") and path.name != "conftest.py"}
    found = [f"{path.relative_to(TESTS)}:{line}: {name}"
             for path, tree in _modules() for line, name in _imported(tree)
             if name.split(".")[0] in helpers]
    assert not found, "import as tests.support.<name> (or move the module there):\n" + \
        "\n".join(found)


def _imports_a_test_module(name: str) -> bool:
    """``name`` (an imported module) is a test module: what two of them share belongs in
    tests/support/, or the importer also collects and runs the other's tests' module code and
    depends on a file that is free to change with its own tests."""
    return name.split(".")[-1].startswith("test_")


def test_no_module_imports_a_test_module() -> None:
    benches = sorted(BENCH.glob("*.py"))
    scanned = [*_modules(), *((path, ast.parse(path.read_text(), str(path))) for path in benches)]
    found = [f"{path.relative_to(TESTS.parent)}:{line}: imports {name}"
             for path, tree in scanned for line, name in _imported(tree)
             if _imports_a_test_module(name)]
    assert not found, "move what test modules share into tests/support/:\n" + "\n".join(found)


def test_the_checks_see_what_they_forbid() -> None:
    conftest = ast.parse("import pytest\nLIMIT = 3\n\n@pytest.fixture\ndef cli(): ...\n"
                         "def helper(): ...\nclass Runner: ...\ndef _private(): ...\n"
                         "def pytest_configure(config): ...\n")
    assert [name for _, name in _public_helpers(conftest)] == ["LIMIT", "helper", "Runner"]
    module = ast.parse("from tests.backends.local.conftest import Cli\nfrom conftest import x\n"
                       "import probe_support\nfrom .rel import y\n")
    assert [name for _, name in _imported(module)] == [
        "tests.backends.local.conftest", "conftest", "probe_support"]
    shared = ast.parse("from tests.backends.local.test_local_shared import LAB\n"
                       "import tests.support.test_layout\nfrom tests.support.labserver import LAB\n"
                       "from tests.support.tiers import tier_of\n")
    assert [_imports_a_test_module(name) for _, name in _imported(shared)] == [
        True, True, False, False]
