"""Every class name in orchestrate/ means one thing.

Two classes of one name (``Run`` for a doctor run and for one run of a Slurm batch script,
``Decision`` for a strategy and for a restart) make every import, traceback, log line and
``grep -n "class Run"`` ambiguous, and a reader of one module takes the other's meaning. The
review of 2026-12-04 found five such pairs; this keeps the count at none.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parents[2] / "orchestrate"

#: Class names allowed in more than one module, each with the reason it was reviewed and kept.
#: Empty: add a name only when two modules truly need it (say why, here).
REVIEWED: dict[str, str] = {}


def _classes() -> dict[str, list[str]]:
    """Class name -> where each class of that name is defined (``path:line``), nested ones
    included."""
    found: dict[str, list[str]] = defaultdict(list)
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                found[node.name].append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    return found


def test_no_class_name_is_defined_twice() -> None:
    twice = {name: places for name, places in _classes().items()
             if len(places) > 1 and name not in REVIEWED}
    assert not twice, "class names defined more than once (rename one of each to say what it " \
        f"is, or review it into REVIEWED): {twice}"


def test_the_reviewed_exceptions_are_still_needed() -> None:
    classes = _classes()
    stale = [name for name in REVIEWED if len(classes.get(name, [])) < 2]
    assert not stale, f"REVIEWED names a class no longer defined twice: {stale}"
