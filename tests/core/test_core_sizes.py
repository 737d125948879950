"""The house rules on size, checked: no module over 500 lines, no function over 60 code lines.

A function's code lines run from its first statement after the docstring to its last line, so a
long docstring costs nothing and a long body cannot hide in one. Complexity (ruff's C901 at 12)
is checked by ruff itself (pyproject.toml). Read the numbers as a reason to split by concept,
not to squeeze lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parents[2] / "orchestrate"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _code_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    if not body:
        return 0
    assert node.end_lineno is not None
    return node.end_lineno - body[0].lineno + 1


def test_no_module_is_over_500_lines() -> None:
    long = {str(p.relative_to(PACKAGE)): n for p in _modules()
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES}
    assert long == {}


def test_no_function_is_over_60_code_lines() -> None:
    long = {}
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = _code_lines(node)
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}"] = lines
    assert long == {}


def test_the_check_sees_a_long_function() -> None:
    source = "def f():\n    '''doc'''\n" + "    x = 1\n" * 61
    node = ast.parse(source).body[0]
    assert isinstance(node, ast.FunctionDef) and _code_lines(node) == 61
