"""Programs shipped to other machines as source text: several stdlib-only modules, one program.

The SSH agent, the Slurm batch job's monitor and the rank sidecar run where orchestrate may not
be installed (a bare server, a compute node, a user's own Python), so orchestrate sends their
text and the remote interpreter runs it (``python -S -c TEXT`` or a file in the run directory).
Each such program is made of modules of this package that use the standard library only; here
they are joined into one text, in dependency order. Two conventions in those modules make that
possible:

- imports of sibling modules sit between ``# <in-package>`` and ``# </in-package>`` lines: they
  serve the package (and the type checker) and are dropped from the bundle, where the sibling's
  definitions come earlier in the same text;
- ``from __future__ import annotations`` may only open a file, so it is hoisted to the top once.

Importing this module costs nothing beyond the standard library.
"""

from __future__ import annotations

import ast
import hashlib
from functools import lru_cache
from importlib import import_module
from pathlib import Path

FUTURE = "from __future__ import annotations"
OPEN = "# <in-package>"
CLOSE = "# </in-package>"


@lru_cache(maxsize=64)
def module_text(name: str) -> str:
    """A module's source, without its in-package imports and ``__future__`` line."""
    module = import_module(name)
    path = module.__file__
    if path is None:  # pragma: no cover - namespace packages have no file
        raise ValueError(f"{name} has no source file")
    kept: list[str] = []
    skipping = False
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        stripped = line.strip()
        if stripped == OPEN:
            skipping = True
        elif stripped == CLOSE:
            skipping = False
        elif not skipping and stripped != FUTURE:
            kept.append(line)
    if skipping:
        raise ValueError(f"{name}: '{OPEN}' without '{CLOSE}'")
    return "\n".join(kept) + "\n"


#: Names every shipped module may define alike (they mean the same everywhere).
SHARED_NAMES = frozenset({"TYPE_CHECKING"})


def top_level_names(text: str) -> set[str]:
    """The names a module's text defines at its top level (functions, classes, assignments)."""
    names: set[str] = set()
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names - SHARED_NAMES


@lru_cache(maxsize=16)
def bundle(*names: str) -> str:
    """One program from the named modules, in the order given (dependencies first); the last
    one's ``if __name__ == "__main__":`` block is what runs.

    The modules share one namespace once joined, so a name two of them define would silently
    replace the first one's: that is refused here (:class:`ValueError`), at render time and in
    the tests, never at run time on a host.
    """
    owners: dict[str, str] = {}
    for name in names:
        for defined in top_level_names(module_text(name)):
            if defined in owners:
                raise ValueError(f"{name} and {owners[defined]} both define {defined!r}: "
                                 "they cannot be shipped as one program")
            owners[defined] = name
    parts = [f"{FUTURE}\n"]
    for name in names:
        parts.append(f"# ---- {name} " + "-" * max(0, 90 - len(name)) + "\n")
        parts.append(module_text(name))
    return "".join(parts)


def fingerprint(text: str) -> str:
    """A short digest of a shipped program (it names the program's version in logs)."""
    return hashlib.sha256(text.encode()).hexdigest()[:12]
