"""The one door every YAML file comes in through.

It keeps the line of every field (so an error can say ``job.yaml:12``), validates into a frozen
spec model, and turns pydantic's errors into :class:`~orchestrate.core.errors.Problem` values:
unknown keys get a did-you-mean, wrong types and ranges name the dotted field and the value.
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from orchestrate.core.errors import Problem, UserError, show_value
from orchestrate.core.spec.limits import (
    ALIAS_LIMIT,
    MAX_DEPTH,
    MAX_FILE_BYTES,
    DepthLimit,
    TooDeep,
    check_aliases,
    check_size,
    too_deep,
)

__all__ = ["ALIAS_LIMIT", "MAX_DEPTH", "MAX_FILE_BYTES", "Lines", "parse_value", "parse_yaml",
           "read_yaml", "validate"]

M = TypeVar("M", bound=BaseModel)

Lines = dict[tuple[str, ...], int]


def read_yaml(path: Path) -> tuple[Any, Lines]:
    """Parse a YAML file into plain values plus a map from field path to line number."""
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)  # never more: a huge file is refused unread
        if len(raw) > MAX_FILE_BYTES:
            check_size(max(len(raw), path.stat().st_size), str(path))
        # Universal newlines, as read_text() would: a CRLF file parses like any other.
        text = raw.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
    except FileNotFoundError:
        raise UserError.single(
            "file not found", source=str(path), hint="check the path (relative to your cwd)"
        ) from None
    except UnicodeDecodeError as exc:
        line = exc.object[: exc.start].count(b"\n") + 1
        raise UserError.single(
            f"not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start})",
            source=str(path), line=line,
            hint="save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)",
        ) from None
    except OSError as exc:
        raise UserError.single(f"cannot read: {exc.strerror}", source=str(path)) from None
    return parse_yaml(text, str(path))


class _Loader(DepthLimit, yaml.SafeLoader):
    """YAML 1.2's plain scalars where YAML 1.1 surprises: ``4:00:00`` is the text of a time
    limit, not the base-60 number 14400 that PyYAML (YAML 1.1) would make of it, and ``on`` is a
    word, not a boolean. Nesting is bounded (:mod:`orchestrate.core.spec.limits`)."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers
            if tag not in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float",
                           "tag:yaml.org,2002:bool")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
# Booleans are true and false only: YAML 1.1 also reads on/off/yes/no, so a key called ``on``
# (restart.on) would become True, and a node called ``no`` False.
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool",
    re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
    list("tTfF"),
)
# PyYAML's own int and float patterns without their base-60 alternatives.
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:int",
    re.compile(r"""^(?:[-+]?0b[0-1_]+
                   |[-+]?0[0-7_]+
                   |[-+]?(?:0|[1-9][0-9_]*)
                   |[-+]?0x[0-9a-fA-F_]+)$""", re.X),
    list("-+0123456789"),
)
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?
                   |\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?
                   |[-+]?\.(?:inf|Inf|INF)
                   |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."),
)


def parse_yaml(text: str, source: str) -> tuple[Any, Lines]:
    """Parse YAML text; ``source`` names it in errors. A file that would cost more than the
    bounds of :mod:`orchestrate.core.spec.limits` is refused before any walk."""
    node = _compose(text, source)
    if node is None:
        return {}, {}
    duplicates = _duplicate_keys(node, (), source)
    if duplicates:
        raise UserError(duplicates)
    lines: Lines = {}
    _record_lines(node, (), lines)
    return _construct(node, source), lines


def parse_value(text: str, source: str, *, invalid_as_text: bool = False) -> Any:
    """One value written in YAML (a ``--set`` value), read exactly as the same text in a file
    would be, within the same bounds; ``invalid_as_text`` keeps text that is not YAML as it
    is (``--set command=[a`` is the string ``[a``)."""
    try:
        node = _compose(text, source)
        return None if node is None else _construct(node, source)
    except _NotYaml:
        if invalid_as_text:
            return text
        raise


class _NotYaml(UserError):
    """The text is not YAML at all (as opposed to YAML refused for its cost)."""


def _compose(text: str, source: str) -> yaml.Node | None:
    check_size(len(text.encode("utf-8", "surrogatepass")), source)
    try:
        node = yaml.compose(text, Loader=_Loader)
    except TooDeep as exc:
        raise too_deep(exc, source) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc)
        raise _NotYaml(
            Problem(
                f"not valid YAML: {problem}",
                source=source,
                line=None if mark is None else mark.line + 1,
                hint="check indentation and quoting around that line",
            )
        ) from None
    if node is not None:
        check_aliases(node, source)
    return node


def _construct(node: yaml.Node, source: str) -> Any:
    """The values of a composed document; a tag safe YAML cannot build (``!0``,
    ``!!python/object``) is the user's mistake, named with its line."""
    loader = _Loader("")
    try:
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise _NotYaml(Problem(
            f"not valid YAML here: {getattr(exc, 'problem', None) or exc}", source=source,
            line=None if mark is None else mark.line + 1,
            hint="quote the value if the '!' is meant as text",
        )) from None
    finally:
        loader.dispose()


def _duplicate_keys(node: yaml.Node, path: tuple[str, ...], source: str) -> list[Problem]:
    """Keys given twice in one mapping: YAML keeps the last silently, which hides a mistake."""
    problems: list[Problem] = []
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = str(key_node.value)
            line = key_node.start_mark.line + 1
            if key in seen:
                problems.append(
                    Problem(
                        f"key given twice (first on line {seen[key]}); YAML would keep only "
                        "the last",
                        source=source,
                        field=".".join((*path, key)),
                        line=line,
                        hint="merge the two into one",
                    )
                )
            else:
                seen[key] = line
            problems += _duplicate_keys(value_node, (*path, key), source)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            problems += _duplicate_keys(item, (*path, str(i)), source)
    return problems


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
    union_errors: dict[str, list[str]] = {}  # field -> messages of the union's branches
    for err in exc.errors(include_url=False):
        loc, tagged = _field_path(err["loc"], data)
        field = ".".join(loc)
        line = _line_for(loc, lines)
        kind = err["type"]
        if kind == "extra_forbidden":
            known = known_fields(model, loc[:-1])
            close = suggest(model, loc[:-1], loc[-1])
            hint = f"did you mean '{close}'?" if close else ""
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
            message = _sentence(str(err["msg"]).removeprefix("Value error, ")) or kind
            if tagged:
                # One branch of a union (``int | 'all'``): the branches are merged into one
                # problem below, so a person reads one line per field.
                if field in union_errors:
                    union_errors[field].append(message)
                    continue
                union_errors[field] = [message]
            value = err.get("input")
            problems.append(
                Problem(
                    message,
                    source=source,
                    field=field,
                    line=line,
                    # A whole mapping (a model-level check) is noise; the field names it.
                    got=None if isinstance(value, Mapping) else show_value(value),
                    hint=_quote_hint(kind, value),
                )
            )
    merged = [
        replace(p, message=_either(union_errors[p.field]))
        if len(union_errors.get(p.field, ())) > 1
        else p
        for p in problems
    ]
    return _dedupe(merged)


def _quote_hint(kind: str, value: object) -> str:
    """YAML reads ``3`` and ``true`` as a number and a boolean; a text field wants quotes, a
    switch wants true or false, a number a finite one."""
    if kind == "bool_type":
        return "write true or false (yes, no, on and off are text in these files)"
    if kind == "finite_number":
        return "JSON (plan --json, train.json) has no inf or nan: give a number"
    if kind != "string_type":
        return ""
    if isinstance(value, bool):
        return "put it in quotes: YAML reads an unquoted true/false as a boolean"
    if isinstance(value, int | float):
        return f"put it in quotes ('{value}'): YAML reads an unquoted {value} as a number"
    return ""


def _sentence(message: str) -> str:
    """pydantic's "Input should be ..." as a clause; "NCCL ..." and "RANK ..." keep their case."""
    if message[:1].isupper() and message[1:2].islower():
        return message[0].lower() + message[1:]
    return message


def _either(messages: list[str]) -> str:
    """``input should be a valid integer`` + ``input should be 'all'`` -> one sentence."""
    prefix = "input should be "
    if all(m.startswith(prefix) for m in messages):
        parts = list(dict.fromkeys(m.removeprefix(prefix).split(",")[0] for m in messages))
        return prefix + (", ".join(parts[:-1]) + " or " + parts[-1] if len(parts) > 1 else parts[0])
    return "; or ".join(messages)


def _dedupe(problems: list[Problem]) -> list[Problem]:
    seen: set[tuple[str, str]] = set()
    out = []
    for p in problems:
        if (p.field, p.message) not in seen:
            seen.add((p.field, p.message))
            out.append(p)
    return out


def _field_path(loc: tuple[int | str, ...], data: Any) -> tuple[tuple[str, ...], bool]:
    """The dotted path of an error (as strings) and whether union tags were dropped from it.

    pydantic puts a union member's name in the loc (``int``, ``literal['all']``, a model name).
    A part is kept when it is a key or index of the data at that point (so an env variable
    called ``FOO`` or ``Bar`` stays), or when it does not look like such a tag.
    """
    out: list[str] = []
    tagged = False
    current: Any = data
    for part in loc:
        in_mapping = isinstance(current, Mapping) and part in current
        in_list = isinstance(current, list) and isinstance(part, int) and 0 <= part < len(current)
        if in_mapping or in_list:
            current = current[part]
        elif _is_union_tag(part):
            tagged = True
            continue
        else:
            current = None
        out.append(str(part))
    return tuple(out), tagged


def _is_union_tag(part: object) -> bool:
    return isinstance(part, str) and (
        part[:1].isupper() or part in ("int", "float", "str", "bool", "list", "dict")
        or part.startswith(("literal[", "function-", "constrained-"))
    )


def _line_for(loc: tuple[str, ...], lines: Lines) -> int | None:
    for end in range(len(loc), -1, -1):
        if loc[:end] in lines:
            return lines[loc[:end]]
    return None


def suggest(model: type[BaseModel], loc: tuple[str, ...], key: str) -> str | None:
    """The key a person probably meant by ``key`` at ``loc``: a close spelling there, or the
    same name one level down (a top-level ``nodes`` in a job means ``resources.nodes``)."""
    known = known_fields(model, loc)
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if close:
        return close[0]
    deeper = [f"{k}.{key}" for k in known if key in known_fields(model, (*loc, k))]
    return deeper[0] if deeper else None


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
