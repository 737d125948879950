"""Whether ``train.model``/``dataset``/``loss`` resolve from the job's workdir, checked before
launch and read, not run.

A typo in ``model:`` used to pass ``validate`` and ``plan`` and fail only on the ranks, after
their start-up, exit 1 (issue #33). Importing the user's module to check it would run it, and its
own imports (torch alone takes seconds): too slow for ``validate``. So the check reads instead:
the module is found the way Python's import system finds it (``importlib.machinery.PathFinder``,
the workdir first; no code runs, not even a package's ``__init__``), its source is parsed, and
the names it binds at top level (``def``, ``class``, assignments, imports) are searched for the
function, with a did-you-mean over them (:func:`suggest`, which the ranks' own errors use too).
A module that makes names at run time (a module ``__getattr__``, a star import) or is not Python
source is not second-guessed; a module not found here is only a note where the ranks run on
other machines, whose Python may have it. ``ORCHESTRATE_IMPORT_CHECK=0`` skips the check (code
the controller cannot see; the benchmark's "without" side).

Nothing of the user's runs, so the check needs no child process to contain it: it runs in a
daemon thread under :data:`DEADLINE_S` (a hung file system costs seconds, never the command; a
child would cost an interpreter's start, a second on a busy machine, and unit tests start none).
"""

from __future__ import annotations

import ast
import difflib
import os
import sys
import threading
from collections.abc import Sequence
from importlib.machinery import PathFinder, SourceFileLoader
from pathlib import Path
from typing import Any

from orchestrate.core.errors import Problem

#: How long the child may take; past it the check is skipped with a note.
DEADLINE_S = 10.0
#: The train fields that name code, and what each is called in messages.
FIELDS = {"model": "model factory", "dataset": "dataset factory", "loss": "loss"}
#: Loss names the trainer knows without an import (orchestrate/train/losses.py).
BUILTIN_LOSSES = ("cross_entropy", "mse")


def suggest(word: str, names: Sequence[str]) -> str:
    """`` did you mean 'x'?`` for the closest of ``names``, else ``""``."""
    close = difflib.get_close_matches(word, sorted(set(names)), n=1, cutoff=0.6)
    return f" did you mean '{close[0]}'?" if close else ""


def _modules_in(folders: Sequence[str]) -> list[str]:
    """The module names importable from ``folders`` (for a did-you-mean)."""
    names = []
    for folder in folders:
        try:
            entries = os.listdir(folder or ".")
        except OSError:
            continue
        for entry in entries:
            stem, dot, ext = entry.partition(".")
            if stem.isidentifier() and (ext == "py" or (not dot and os.path.isfile(
                    os.path.join(folder, entry, "__init__.py")))):
                names.append(stem)
    return names


def _bound_names(tree: ast.Module) -> set[str] | None:
    """The names a module binds at top level; None when it may make more at run time."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    return None
                names.add(alias.asname or alias.name.split(".")[0])
    return None if "__getattr__" in names else names


def scan(path: str, search: list[str]) -> dict[str, str] | None:
    """What is wrong with ``module:function`` on ``search`` (``{"message", "hint"}``, with
    ``"missing": "module"`` when the module is not there at all), or None."""
    module_name, _, attr = path.partition(":")
    folders: list[str] | None = search
    spec = None
    parts = module_name.split(".")
    for depth, part in enumerate(parts):
        if depth and not folders:
            return None  # not a package (os.path): its submodules are made at run time
        spec = PathFinder.find_spec(".".join(parts[:depth + 1]), folders)
        if spec is None:
            where = ("the job's workdir and the Python path" if depth == 0 else
                     f"package {'.'.join(parts[:depth])}")
            nearby = (folders or [])[:1] if depth == 0 else folders or []  # the workdir's
            return {"message": f"module '{part}' not found in {where}", "missing": "module",
                    "hint": ("check the spelling; the path is 'module:function', the module "
                             "relative to the workdir." + suggest(part, _modules_in(nearby)))}
        folders = list(spec.submodule_search_locations or [])
    if spec is None or not isinstance(spec.loader, SourceFileLoader) or not spec.origin:
        return None  # a namespace package, an extension module: not second-guessed
    try:
        with open(spec.origin, encoding="utf-8") as f:
            tree = ast.parse(f.read(), spec.origin)
    except (OSError, SyntaxError, ValueError) as exc:
        return {"message": f"{module_name} cannot be read: {type(exc).__name__}: {exc}",
                "hint": f"fix {spec.origin}"}
    names = _bound_names(tree)
    first = attr.split(".")[0]
    if names is None or first in names:
        return None
    public = [n for n in names if not n.startswith("_")]
    return {"message": f"{module_name} ({spec.origin}) has no '{first}'",
            "hint": "name a function the module defines." + suggest(first, public)}


def _scan_all(paths: list[str], search: list[str], answers: dict[str, Any]) -> None:
    for path in paths:
        answers[path] = scan(path, search)


def check(train: Any, workdir: Path, source: str, lines: dict[tuple[str, ...], int],
          overrides: Sequence[str], elsewhere: bool, pythonpath: str | None = None
          ) -> tuple[list[Problem], list[str]]:
    """The problems of ``train``'s code paths (exit 2 before launch) and notes (a module not
    found here when ``elsewhere``: the ranks run on other machines; a check that timed out).
    ``pythonpath``: the job's own ``env: PYTHONPATH``, which the ranks search after the workdir
    (relative entries from the workdir, where the ranks start)."""
    fields = {f: getattr(train, f) for f in FIELDS
              if not (f == "loss" and getattr(train, f) in BUILTIN_LOSSES)}
    if os.environ.get("ORCHESTRATE_IMPORT_CHECK", "1") == "0" or not workdir.is_dir():
        return [], []  # skipped, or a workdir only the nodes have (a Slurm job's /srv/work)
    own = [str(workdir / os.path.expanduser(p)) for p in (pythonpath or "").split(os.pathsep) if p]
    search = [str(workdir), *own, *[p for p in sys.path if p and p != os.getcwd()]]
    answers: dict[str, Any] = {}
    scanner = threading.Thread(target=_scan_all, args=(list(fields.values()), search, answers),
                               daemon=True, name="import check")
    scanner.start()
    scanner.join(DEADLINE_S)
    if scanner.is_alive():
        return [], [f"the import check of train.model/dataset/loss took over {DEADLINE_S:g} s: "
                    "skipped"]
    problems, notes = [], []
    for field, path in fields.items():
        found = answers.get(path)
        if not found:
            continue
        if found.get("missing") and elsewhere:
            notes.append(f"train.{field}: {found['message']} here; the nodes must have it")
            continue
        given = any(o.partition("=")[0] == f"train.{field}" for o in overrides)
        problems.append(Problem(
            f"{FIELDS[field]} {found['message']}", source="--set" if given else source,
            field=f"train.{field}", got=path, hint=found["hint"],
            line=None if given else lines.get(("train", field))))
    return problems, notes

