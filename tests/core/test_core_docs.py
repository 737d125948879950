"""The docs name what exists: every module is on the architecture map, every path points at a file.

docs/architecture.md is where a newcomer finds which module does what; a module it does not name
is one they find only by grepping, and a path in any page that no longer exists (a file moved,
the page did not) sends them nowhere. Both drifted before (the code review of 2026-12-04: 11
modules unmapped, ``docs/slurm.md`` naming a moved file), so both are checked here, as the
published schemas are: a new module fails this test until the map says where it belongs.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "orchestrate"
ARCHITECTURE = REPO / "docs" / "architecture.md"
PAGES = [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]

#: A path to a module: ``orchestrate/…/x.py``, or one that starts at a top-level package of it
#: (``backends/slurm/allocation.py``), as the pages write them; not ``tests/core/…``.
_PACKAGES = "|".join(sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()))
_PATH = re.compile(rf"(?<![\w/.-])(?:orchestrate/)?((?:{_PACKAGES})/[\w/]+\.py)\b")
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)
_CODE = re.compile(r"`([^`]+)`")


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if not p.name.startswith("__"))


def test_every_module_is_on_the_architecture_map() -> None:
    """Each module's name appears in code on the page (``session``, ``train/session.py``),
    not only as a word of prose (``failure``)."""
    page = _FENCE.sub("", ARCHITECTURE.read_text(encoding="utf-8"))
    code = "\n".join(_CODE.findall(page))
    missing = [str(p.relative_to(REPO)) for p in _modules()
               if not re.search(rf"\b{re.escape(p.stem)}\b", code)]
    assert missing == [], "name these in docs/architecture.md, where they belong"


def test_every_module_path_in_the_docs_exists() -> None:
    stale = [f"{page.relative_to(REPO)}:{text.count(chr(10), 0, found.start()) + 1}: "
             f"{found.group(0)}"
             for page in PAGES
             for text in [page.read_text(encoding="utf-8")]
             for found in _PATH.finditer(text)
             if not (PACKAGE / found.group(1)).is_file()]
    assert stale == []


def test_the_checks_can_fail() -> None:
    """The patterns find what they are for: a path written either way, and a module named only
    in prose or only in a code block is not on the map."""
    found = [m.group(1) for m in _PATH.finditer(
        "see orchestrate/core/render/allocation.py and `backends/slurm/allocation.py`; "
        "tests/core/test_core_docs.py is not a module path")]
    assert found == ["core/render/allocation.py", "backends/slurm/allocation.py"]
    assert not (PACKAGE / found[0]).is_file()
    page = _FENCE.sub("", "a failure here\n```\n`failure`\n```\n`session` runs\n")
    code = "\n".join(_CODE.findall(page))
    assert re.search(r"\bsession\b", code) and not re.search(r"\bfailure\b", code)
