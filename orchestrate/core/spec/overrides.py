"""``--set FIELD=VALUE``: overrides of a spec file's fields, type-checked like the file.

:func:`apply` writes each override into the file's data before validation (values parse as
the same text in the file would); :func:`blame` then says that a problem in an overridden
field comes from ``--set``, not from a line of the file.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pydantic import BaseModel

from orchestrate.core.errors import Problem, UserError
from orchestrate.core.spec.loader import known_fields, parse_value, suggest


def blame(problems: tuple[Problem, ...], overrides: list[str] | tuple[str, ...]
          ) -> list[Problem]:
    """A problem in a field that ``--set`` gave comes from ``--set``, not from a file line."""
    given = [tuple(item.partition("=")[0].strip().split(".")) for item in overrides]
    blamed = []
    for problem in problems:
        field = tuple(problem.field.split("."))
        if any(field[: len(g)] == g or g[: len(field)] == field for g in given):
            problem = replace(problem, source="--set", line=None)
        blamed.append(problem)
    return blamed


def apply(model: type[BaseModel], data: dict[str, Any],
          overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Apply ``field.path=value`` overrides to ``data`` (of ``model``'s shape); values parse as
    YAML (``2``, ``true``, ``[a, b]``)."""
    problems: list[Problem] = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            problems.append(
                Problem("expected FIELD=VALUE", source="--set", got=repr(item),
                        hint="for example --set resources.nodes=2")
            )
            continue
        path = key.strip().split(".")
        known = known_fields(model, tuple(path[:-1]))
        if known and path[-1] not in known and path[-2:-1] != ["env"]:
            close = suggest(model, tuple(path[:-1]), path[-1])
            problems.append(
                Problem("unknown field", source="--set", field=key,
                        hint=(f"did you mean '{'.'.join([*path[:-1], close])}'? " if close else "")
                        + "known keys here: " + ", ".join(sorted(known)))
            )
            continue
        # Read as the same text in the file would be (``4:00:00`` is a time, not base 60),
        # within the same bounds; text that is not YAML stays text.
        value = parse_value(raw, "--set", invalid_as_text=True) if raw.strip() else ""
        _assign(data, path, value)
    if problems:
        raise UserError(problems)
    return data


def _assign(data: dict[str, Any], path: list[str], value: Any) -> None:
    node = data
    for part in path[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[path[-1]] = value
