"""The one door every YAML file comes in through.

It keeps the line of every field (so an error can say ``job.yaml:12``), validates into a frozen
spec model, and turns pydantic's errors into :class:`~orchestrate.errors.Problem` values: unknown
keys get a did-you-mean, wrong types and ranges name the dotted field and the value.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from orchestrate.errors import Problem, UserError, show_value

M = TypeVar("M", bound=BaseModel)

Lines = dict[tuple[str, ...], int]


def read_yaml(path: Path) -> tuple[Any, Lines]:
    """Parse a YAML file into plain values plus a map from field path to line number."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError.single(
            "file not found", source=str(path), hint="check the path (relative to your cwd)"
        ) from None
    except OSError as exc:
        raise UserError.single(f"cannot read: {exc.strerror}", source=str(path)) from None
    return parse_yaml(text, str(path))


def parse_yaml(text: str, source: str) -> tuple[Any, Lines]:
    """Parse YAML text; ``source`` names it in errors."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc)
        raise UserError(
            Problem(
                f"not valid YAML: {problem}",
                source=source,
                line=None if mark is None else mark.line + 1,
                hint="check indentation and quoting around that line",
            )
        ) from None
    if node is None:
        return {}, {}
    loader = yaml.SafeLoader("")
    try:
        data = loader.construct_document(node)
    finally:
        loader.dispose()
    lines: Lines = {}
    _record_lines(node, (), lines)
    return data, lines


def _record_lines(node: yaml.Node, path: tuple[str, ...], lines: Lines) -> None:
    lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            child = (*path, str(key_node.value))
            lines[child] = key_node.start_mark.line + 1
            _record_lines(value_node, child, lines)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _record_lines(item, (*path, str(i)), lines)


def validate(model: type[M], data: Any, source: str, lines: Lines | None = None) -> M:
    """Validate plain data into ``model``; every problem is reported at once."""
    if not isinstance(data, Mapping):
        raise UserError.single(
            "the file must be a YAML mapping (key: value lines)",
            source=source,
            got=type(data).__name__,
        )
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise UserError(problems_from(exc, model, data, source, lines or {})) from None


def problems_from(
    exc: ValidationError, model: type[BaseModel], data: Any, source: str, lines: Lines
) -> list[Problem]:
    """Translate pydantic's errors into problems a person can act on."""
    problems: list[Problem] = []
    for err in exc.errors(include_url=False):
        loc = tuple(str(part) for part in err["loc"] if not _is_union_tag(part))
        field = ".".join(loc)
        line = _line_for(loc, lines)
        kind = err["type"]
        if kind == "extra_forbidden":
            known = known_fields(model, loc[:-1])
            close = difflib.get_close_matches(loc[-1], known, n=1, cutoff=0.6)
            hint = f"did you mean '{close[0]}'?" if close else ""
            if known:
                hint = (hint + " " if hint else "") + "known keys: " + ", ".join(sorted(known))
            problems.append(
                Problem("unknown key", source=source, field=field, line=line, hint=hint)
            )
        elif kind == "missing":
            problems.append(
                Problem("required field is missing", source=source, field=field, line=line)
            )
        else:
            message = str(err["msg"])
            message = message.removeprefix("Value error, ")
            problems.append(
                Problem(
                    message[0].lower() + message[1:] if message else kind,
                    source=source,
                    field=field,
                    line=line,
                    got=show_value(err.get("input")),
                )
            )
    return _dedupe(problems)


def _dedupe(problems: list[Problem]) -> list[Problem]:
    seen: set[tuple[str, str]] = set()
    out = []
    for p in problems:
        if (p.field, p.message) not in seen:
            seen.add((p.field, p.message))
            out.append(p)
    return out


def _is_union_tag(part: object) -> bool:
    # pydantic puts the union member's name in the loc ("int", "literal['all']", a model name);
    # a person wants the field path only.
    return isinstance(part, str) and (
        part[:1].isupper() or part in ("int", "float", "str", "bool", "list", "dict")
        or part.startswith(("literal[", "function-", "constrained-"))
    )


def _line_for(loc: tuple[str, ...], lines: Lines) -> int | None:
    for end in range(len(loc), -1, -1):
        if loc[:end] in lines:
            return lines[loc[:end]]
    return None


def known_fields(model: type[BaseModel], loc: tuple[str, ...]) -> list[str]:
    """The keys a mapping at ``loc`` inside ``model`` accepts (for did-you-mean)."""
    current: Any = model
    for part in loc:
        current = _descend(current, part)
        if current is None:
            return []
    sub = _model_in(current)
    if sub is None:
        return []
    return [f.alias or name for name, f in sub.model_fields.items()]


def _descend(annotation: Any, part: str) -> Any:
    model = _model_in(annotation)
    if model is not None:
        field = model.model_fields.get(part)
        if field is None:
            for f in model.model_fields.values():
                if f.alias == part:
                    field = f
        return None if field is None else field.annotation
    for arg in _args(annotation):
        origin = typing.get_origin(arg)
        if origin in (list, tuple, dict):
            inner = typing.get_args(arg)
            return inner[-1] if inner else None
    return None


def _model_in(annotation: Any) -> type[BaseModel] | None:
    for arg in _args(annotation):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def _args(annotation: Any) -> list[Any]:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(annotation) if a is not type(None)]
    return [annotation]
